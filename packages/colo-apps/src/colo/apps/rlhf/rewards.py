"""Reward functions of online RL (``data.task: grpo``): loaded by import path, called on text, checked.

A reward function is any Python callable ``fn(prompts, completions, **columns) -> sequence of floats``, TRL's
convention: ``prompts`` and ``completions`` are lists of strings of equal length (one entry per completion: a
prompt repeats once per sample), ``columns`` the prompt dataset's other fields, repeated the same way (the
arithmetic set's ``answer``), and, when the caller has them (the trainer does), ``completion_ids``: each
completion's token ids, its eos included, as TRL passes them (so TRL's length rewards run unchanged); it returns one
finite number per completion. A function should take ``**kwargs`` for the fields it does not read. Name it in the
run config as ``"module:function"`` (``"colo.apps.rlhf.rewards:exact_answer"``); several functions add up.

`compute_rewards` calls each function and turns its mistakes into errors that name it: an exception inside it, a
result that is not one number per completion, a NaN.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Mapping, Sequence

import torch

RewardFunction = Callable[..., Sequence[float]]


class RewardFunctionError(ValueError):
    """A reward function could not be loaded, raised, or returned something other than one float per completion."""


def load_reward_function(path: str) -> RewardFunction:
    """The callable at ``path`` (``"package.module:function"``, a dotted attribute after the colon allowed).

    Raises:
        RewardFunctionError: a malformed path, a module that does not import, a missing or non-callable attribute.
    """
    if not isinstance(path, str) or path.count(":") != 1 or not all(path.split(":")):
        raise RewardFunctionError(
            f"reward function {path!r}: write it as 'module:function' (e.g. 'colo.apps.rlhf.rewards:exact_answer')"
        )
    module_name, attribute = path.split(":")
    try:
        target = importlib.import_module(module_name)
    except Exception as error:  # ImportError, or the module raising while it imports
        raise RewardFunctionError(
            f"reward function {path!r}: module {module_name!r} does not import ({type(error).__name__}: {error})"
        ) from error
    for name in attribute.split("."):
        if not hasattr(target, name):
            raise RewardFunctionError(f"reward function {path!r}: {module_name!r} has no attribute {attribute!r}")
        target = getattr(target, name)
    if not callable(target):
        raise RewardFunctionError(f"reward function {path!r} is a {type(target).__name__}, not a callable")
    return target


def compute_rewards(
    functions: Mapping[str, RewardFunction],
    prompts: Sequence[str],
    completions: Sequence[str],
    columns: Mapping[str, Sequence] | None = None,
    *,
    completion_ids: Sequence[Sequence[int]] | None = None,
) -> torch.Tensor:
    """The sum of every reward function's values, one float per completion.

    Args:
        functions: ``{name (for errors and metrics): callable}``.
        prompts: one prompt per completion.
        completions: the completions' texts.
        columns: extra keyword arguments, one value per completion each. Default: none.
        completion_ids: each completion's token ids, passed as ``completion_ids=`` when given. Default: ``None``.

    Returns:
        torch.Tensor: ``(len(completions),)`` float32.

    Raises:
        RewardFunctionError: naming the function that raised, returned the wrong number of values, a non-number, or a
            NaN / infinity.
    """
    count = len(completions)
    total = torch.zeros(count, dtype=torch.float64)
    extra = dict(columns or {})
    if completion_ids is not None:
        extra["completion_ids"] = [list(ids) for ids in completion_ids]
    for name, function in functions.items():
        try:
            values = function(prompts=list(prompts), completions=list(completions), **extra)
        except Exception as error:
            raise RewardFunctionError(
                f"reward function {name!r} raised {type(error).__name__}: {error} (called with {count} completions)"
            ) from error
        total += _check_values(name, values, count)
    return total.float()


def _check_values(name: str, values: object, count: int) -> torch.Tensor:
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().reshape(-1).tolist() if values.dim() <= 1 else values
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) and not hasattr(values, "__len__"):
        raise RewardFunctionError(
            f"reward function {name!r} returned a {type(values).__name__}; it must return one float per completion "
            f"(a list of {count})"
        )
    values = list(values)
    if len(values) != count:
        raise RewardFunctionError(
            f"reward function {name!r} returned {len(values)} values for {count} completions; it must return one "
            "float per completion"
        )
    numbers = []
    for index, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, (int, float)) and not hasattr(value, "__float__"):
            raise RewardFunctionError(
                f"reward function {name!r} returned {value!r} ({type(value).__name__}) for completion {index}; "
                "rewards are floats"
            )
        number = float(value)
        if not math.isfinite(number):
            raise RewardFunctionError(f"reward function {name!r} returned {number} for completion {index}")
        numbers.append(number)
    return torch.tensor(numbers, dtype=torch.float64)


def exact_answer(prompts: Sequence[str], completions: Sequence[str], answer: Sequence[str], **_) -> list[float]:
    """1.0 where the completion, stripped of surrounding whitespace, is exactly ``answer``, else 0.0: the verifiable
    reward of the arithmetic prompts (`colo.apps.rlhf.synthetic.arithmetic_prompts`)."""
    return [float(completion.strip() == str(expected).strip()) for completion, expected in zip(completions, answer)]
