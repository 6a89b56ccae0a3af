"""Reads of a module's parameters that wait for the overlapped parameter all-gather (stages 1/2).

With ``overlap_param_gather`` a step returns while the updated parameters are still being all-gathered into the
compute copies; colo's forward waits chunk by chunk. A read of the parameters outside a forward (an EMA update, a
weight norm logged, ``torch.save`` of the values) must not see the previous step's values, so:

- each module of the model gets its own ``named_parameters`` (which ``parameters`` calls) that first waits for the
  chunks of the module and its submodules;
- each module that owns parameters gets a ``_parameters`` dictionary whose item look-up waits for the module's own
  chunks: ``nn.Module.__getattr__`` reads parameters from it, so ``model.lm_head.weight`` read directly is current.

The module's class is left as it is (``type(model) is Llama`` still holds). A read with nothing in flight costs a
dictionary look-up; under ``torch.compile`` the forward pre-hooks already waited, so nothing is added to the graph.
A reference to a parameter kept from before the step is not a read through the model: read it after
`ZeroOptimizer.wait_params` (the Booster's ``unwrap`` waits).
"""

from __future__ import annotations

import copy
import types
from collections.abc import Callable

import torch
from torch import nn


def _waiting_named_parameters(module: nn.Module, *args, **kwargs):
    """``named_parameters`` after waiting for the chunks it returns."""
    if not torch.compiler.is_compiling():
        module.__dict__["_colo_wait_subtree"]()
    return type(module).named_parameters(module, *args, **kwargs)


class WaitingParameterDict(dict):
    """A module's ``_parameters`` whose item look-up (``module.weight`` goes through it) waits for the module's own
    chunks first. Iteration, ``in`` and assignment are a plain dictionary's; a copy or a pickle is a plain dict."""

    __slots__ = ("wait",)

    def __init__(self, items: dict, wait: Callable[[], None]) -> None:
        super().__init__(items)
        self.wait = wait

    def __getitem__(self, name: str):
        if not torch.compiler.is_compiling():
            self.wait()
        return dict.__getitem__(self, name)

    def __reduce__(self):
        return dict, (dict(self),)

    def __deepcopy__(self, memo):
        return copy.deepcopy(dict(self), memo)

    def __copy__(self):
        return dict(self)


class ReadsWaitHandle:
    """Undoes `wait_on_parameter_reads` for one module (``remove``, like a hook handle)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module

    def remove(self) -> None:
        self.module.__dict__.pop("named_parameters", None)
        self.module.__dict__.pop("_colo_wait_subtree", None)
        parameters = self.module.__dict__.get("_parameters")
        if isinstance(parameters, WaitingParameterDict):
            self.module.__dict__["_parameters"] = dict(parameters)


def wait_on_parameter_reads(
    module: nn.Module, *, subtree: Callable[[], None], owned: Callable[[], None] | None = None
) -> ReadsWaitHandle:
    """Make ``module.named_parameters()`` / ``module.parameters()`` call ``subtree`` (which waits for the chunks of the
    module and its submodules) first, and, given ``owned`` (which waits for the module's own chunks), a parameter
    read as an attribute (``module.weight``) call ``owned`` first.

    Returns:
        A handle whose ``remove()`` restores the class's ``named_parameters`` and a plain ``_parameters``.
    """
    earlier = module.__dict__.get("_colo_wait_subtree")  # another optimizer's chunks (the expert plugin's two parts)
    module.__dict__["_colo_wait_subtree"] = subtree if earlier is None else _both(earlier, subtree)
    module.__dict__["named_parameters"] = types.MethodType(_waiting_named_parameters, module)
    if owned is not None:
        parameters = module.__dict__["_parameters"]
        if isinstance(parameters, WaitingParameterDict):
            owned = _both(parameters.wait, owned)
        module.__dict__["_parameters"] = WaitingParameterDict(parameters, owned)
    return ReadsWaitHandle(module)


def _both(first: Callable[[], None], second: Callable[[], None]) -> Callable[[], None]:
    def wait() -> None:
        first()
        second()

    return wait
