"""Prompt datasets of online RL (``data.task: grpo``): records with a ``prompt`` and any other columns.

Records come from JSON Lines files or saved Hugging Face datasets (`colo.apps.rlhf.read_preference_records` reads
both) or from the embedded arithmetic set (`colo.apps.rlhf.synthetic.arithmetic_prompts`). Each item keeps the
prompt's token ids (the bos first when asked for), its text, and the record's other columns, which the reward
functions receive (the arithmetic set's ``answer``). A prompt longer than the budget is an error naming the record:
cutting it would change the question the reward checks.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
from torch.utils.data import Dataset


class PromptDataset(Dataset):
    """Tokenized prompts: item ``i`` is ``{"prompt_ids": list[int], "prompt": str, **other columns}``.

    Args:
        records (Iterable): mappings with ``prompt_field``, or ``(record, where)`` pairs (``where`` names the file and
            line in errors).
        tokenizer: the run's tokenizer (``encode``, ``bos_id``).
        max_prompt_len (int): the budget in tokens, bos included.
        prompt_field (str): the prompt's field. Default: ``"prompt"``.
        add_bos (bool): start every prompt with the tokenizer's bos. Default: ``True``.

    Raises:
        ValueError: a record without the prompt field or with a non-string prompt, an empty prompt, or a prompt over
            ``max_prompt_len`` tokens (each naming the record), or no records.
    """

    def __init__(
        self,
        records: Iterable,
        tokenizer,
        *,
        max_prompt_len: int,
        prompt_field: str = "prompt",
        add_bos: bool = True,
    ) -> None:
        self.items: list[dict[str, Any]] = []
        bos = [tokenizer.bos_id] if add_bos and getattr(tokenizer, "bos_id", None) is not None else []
        for index, entry in enumerate(records):
            record, where = entry if isinstance(entry, tuple) else (entry, f"record {index}")
            if not isinstance(record, Mapping) or not isinstance(record.get(prompt_field), str):
                raise ValueError(f"{where}: a prompt record needs a string field {prompt_field!r}, got {record!r}")
            text = record[prompt_field]
            ids = bos + list(tokenizer.encode(text))
            if len(ids) <= len(bos):
                raise ValueError(f"{where}: the prompt is empty")
            if len(ids) > max_prompt_len:
                raise ValueError(
                    f"{where}: the prompt has {len(ids)} tokens, over the budget grpo.max_prompt_len={max_prompt_len}; "
                    "raise grpo.max_prompt_len or shorten the prompt"
                )
            columns = {name: value for name, value in record.items() if name != prompt_field}
            self.items.append({**columns, "prompt_ids": ids, "prompt": text})
        if not self.items:
            raise ValueError("the prompt dataset is empty")

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.items[index]

    @property
    def prompt_lengths(self) -> np.ndarray:
        """Tokens of every prompt."""
        return np.array([len(item["prompt_ids"]) for item in self.items], dtype=np.int64)


def build_prompt_dataset(data, grpo, tokenizer) -> tuple[Dataset, Any, str]:
    """``task='grpo'`` or ``'ppo'`` (``grpo`` is then the ``ppo`` section): `colo.apps.rlhf.prompts.PromptDataset`
    items (a prompt's ids, text and other columns), from ``data.paths`` or the embedded arithmetic prompts
    (``grpo.synthetic_prompts``); every prompt within ``grpo.max_prompt_len`` tokens (else a `ValueError` naming
    the record)."""
    from .data import read_preference_records
    from .synthetic import arithmetic_prompts

    if data.paths:
        records = read_preference_records(data.paths, format=data.format)
        source = ", ".join(data.paths)
    else:
        worked = grpo.synthetic_answer == "worked"
        records = arithmetic_prompts(grpo.synthetic_prompts, seed=0, max_operand=grpo.max_operand, worked=worked)
        source = f"{grpo.synthetic_prompts} synthetic addition prompts (operands below {grpo.max_operand})"
        source += ", worked answers" if worked else ""
    try:
        prompts = PromptDataset(records, tokenizer, max_prompt_len=grpo.max_prompt_len, prompt_field=data.prompt_field)
    except ValueError as error:
        raise ValueError(f"data.task={data.task!r}: {error}") from None
    description = (
        f"{data.task}: {len(prompts)} prompts from {source}, {grpo.group_size} completions each per step, up to "
        f"{grpo.max_new_tokens} new tokens"
    )
    return prompts, prompts.prompt_lengths, description
