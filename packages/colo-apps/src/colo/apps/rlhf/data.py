"""Preference data: ``{prompt, chosen, rejected}`` records into pairs of rows that one forward runs together.

A record is read from JSON Lines (``.jsonl`` / ``.json``) or a Hugging Face dataset saved to disk. Its fields are
plain text (``prompt``, ``chosen``, ``rejected`` strings) or chat: ``prompt`` a list of ``{"role", "content"}``
messages (or a string, taken as one user message) and each response a string or a list holding one assistant
message; chat records go through the run's `colo.apps.data.ChatTemplate`.

Each example becomes one item whose tensors have a leading pair dimension of 2 (row 0 chosen, row 1 rejected), so a
batch is ``(pairs, 2, seq_len)``: `Booster.train_step` splits batches on dim 0, so the two responses of an example
always land in the same microbatch on the same rank, and the model runs them in one forward (``(2 * pairs,
seq_len)``). Labels are ``-100`` except on the response tokens (the closing ``eos`` included); prompts longer than
``max_prompt_len`` lose tokens from the left (counted in `num_prompts_truncated`), responses that do not fit after
the prompt are cut on the right (`num_responses_truncated`).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from ..data import IGNORE_INDEX, ChatTemplate, Tokenizer, validate_messages
from ..data.sources import _detect, _expand

FIELDS = ("prompt", "chosen", "rejected")


def read_preference_records(
    paths: str | Path | Sequence[str | Path], *, format: str = "auto", split: str = "train"
) -> Iterator[tuple[dict[str, Any], str]]:
    """Yield ``(record, where)`` from JSON Lines files or saved Hugging Face datasets; ``where`` names the file and
    line (or row) for error messages.

    Raises:
        ValueError: invalid JSON (file and line named) or an unknown ``format``.
    """
    if format not in ("auto", "jsonl", "hf"):
        raise ValueError(f"preference data: format={format!r} is unknown; use 'auto', 'jsonl' or 'hf'")
    entries = [paths] if isinstance(paths, (str, Path)) else list(paths)
    for entry in entries:
        for path in _expand(entry, format):
            kind = _detect(path) if format == "auto" else format
            if kind == "hf":
                import datasets

                dataset = datasets.load_from_disk(str(path))
                if isinstance(dataset, datasets.DatasetDict):
                    dataset = dataset[split]
                for index, record in enumerate(dataset):
                    yield dict(record), f"{path} row {index}"
                continue
            text = path.read_text(encoding="utf-8")
            if path.suffix.lower() == ".json" and text.lstrip().startswith("["):
                for index, record in enumerate(json.loads(text)):
                    yield record, f"{path} record {index}"
                continue
            for number, line in enumerate(text.splitlines(), start=1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as error:
                    raise ValueError(f"{path} line {number}: not valid JSON ({error.msg})") from None
                yield record, f"{path} line {number}"


class PreferenceDataset(Dataset):
    """Preference pairs, tokenized: item ``i`` is ``{"input_ids", "labels"}`` (int64, ``(2, seq_len)``, chosen then
    rejected, right-padded with the tokenizer's ``pad_id``) and ``"lengths"`` (``(2,)``, real tokens per row).

    Args:
        records (Iterable): ``{"prompt", "chosen", "rejected"}`` mappings, or ``(record, where)`` pairs from
            `read_preference_records` (``where`` then names the file and line in errors).
        tokenizer (Tokenizer): the tokenizer.
        seq_len (int): tokens per row (prompt + response).
        template (ChatTemplate | None): renders chat records (and, when given, plain-string prompts as a user
            message). Default: ``None`` (plain text; chat records still use ``ChatTemplate()``).
        max_prompt_len (int | None): prompts keep at most this many tokens, from the right. Default: ``None``
            (``seq_len // 2``).
        add_bos (bool): start plain-text rows with the ``bos`` token (the template decides for chat). Default:
            ``True``.

    Raises:
        ValueError: a record without one of the fields, of the wrong type, with ``chosen == rejected``, or with no
            response token left after truncation; each names the record (file and line).
    """

    def __init__(
        self,
        records: Iterable[Any],
        tokenizer: Tokenizer,
        *,
        seq_len: int,
        template: ChatTemplate | None = None,
        max_prompt_len: int | None = None,
        add_bos: bool = True,
    ) -> None:
        if seq_len < 2:
            raise ValueError(f"PreferenceDataset: seq_len={seq_len} must be at least 2")
        self.seq_len = seq_len
        self.max_prompt_len = seq_len // 2 if max_prompt_len is None else max_prompt_len
        if not 0 < self.max_prompt_len:
            raise ValueError(f"PreferenceDataset: max_prompt_len={max_prompt_len} must be positive")
        self.pad_id = tokenizer.pad_id
        self.num_prompts_truncated = 0
        self.num_responses_truncated = 0
        self._pairs: list[tuple[list[int], list[int], list[int]]] = []
        for index, item in enumerate(records):
            record, where = item if isinstance(item, tuple) else (item, f"record {index}")
            prompt, chosen, rejected = self._tokenize(record, where, tokenizer, template, add_bos)
            if len(prompt) > self.max_prompt_len:
                self.num_prompts_truncated += 1
                prompt = prompt[len(prompt) - self.max_prompt_len :]
            room = seq_len - len(prompt)
            if room <= 0:
                raise ValueError(
                    f"{where}: the prompt keeps {len(prompt)} tokens (max_prompt_len={self.max_prompt_len}) of "
                    f"seq_len={seq_len}, leaving no response token; lower max_prompt_len or raise seq_len"
                )
            if len(chosen) > room or len(rejected) > room:
                self.num_responses_truncated += 1
                chosen, rejected = chosen[:room], rejected[:room]
            if chosen == rejected:
                raise ValueError(
                    f"{where}: chosen and rejected are the same tokens"
                    + (" after truncation to seq_len" if self.num_responses_truncated else "")
                    + "; a preference pair needs two different responses (drop the record)"
                )
            self._pairs.append((prompt, chosen, rejected))
        if not self._pairs:
            raise ValueError("PreferenceDataset: no records; check the data paths")

    def _tokenize(self, record, where, tokenizer, template, add_bos):
        if not isinstance(record, Mapping):
            raise ValueError(
                f"{where}: a preference record is a JSON object with {FIELDS}, not {type(record).__name__}"
            )
        missing = [name for name in FIELDS if record.get(name) is None]
        if missing:
            raise ValueError(
                f"{where}: missing field(s) {missing}; a preference record needs 'prompt', 'chosen' and 'rejected' "
                f"(it has {sorted(record)})"
            )
        prompt = record["prompt"]
        chat = template is not None or not isinstance(prompt, str)
        responses = []
        for name in ("chosen", "rejected"):
            value = record[name]
            if isinstance(value, list):
                messages = validate_messages(value, where=f"{where} field {name!r}")
                if len(messages) != 1 or messages[0]["role"] != (template or ChatTemplate()).assistant_role:
                    raise ValueError(f"{where}: field {name!r} must hold exactly one assistant message")
                value = messages[0]["content"]
            if not isinstance(value, str):
                raise ValueError(f"{where}: field {name!r} must be a string or one assistant message")
            if record["chosen"] == record["rejected"]:
                raise ValueError(f"{where}: chosen and rejected are equal; a preference pair needs two responses")
            responses.append(tokenizer.encode(value) + [tokenizer.eos_id])
        if chat:
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            messages = validate_messages(messages, where=f"{where} field 'prompt'")
            prompt_ids, _ = (template or ChatTemplate()).tokenize(messages, tokenizer, add_generation_prompt=True)
        else:
            prompt_ids = ([tokenizer.bos_id] if add_bos else []) + tokenizer.encode(prompt)
        return prompt_ids, responses[0], responses[1]

    def __len__(self) -> int:
        return len(self._pairs)

    def pair_tokens(self, index: int) -> tuple[list[int], list[int], list[int]]:
        """``(prompt, chosen, rejected)`` token ids of pair ``index`` (after truncation)."""
        return self._pairs[index]

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        prompt, chosen, rejected = self._pairs[index]
        input_ids = torch.full((2, self.seq_len), self.pad_id, dtype=torch.long)
        labels = torch.full((2, self.seq_len), IGNORE_INDEX, dtype=torch.long)
        lengths = torch.zeros(2, dtype=torch.long)
        for row, response in enumerate((chosen, rejected)):
            ids = prompt + response
            input_ids[row, : len(ids)] = torch.tensor(ids)
            labels[row, len(prompt) : len(ids)] = torch.tensor(response)
            lengths[row] = len(ids)
        return {"input_ids": input_ids, "labels": labels, "lengths": lengths}

    @property
    def row_lengths(self):
        """Real tokens of each item (both rows), int64 numpy: what a tokens-per-second count counts."""
        import numpy as np

        return np.asarray([2 * len(p) + len(c) + len(r) for p, c, r in self._pairs], dtype=np.int64)


def build_preference_dataset(data, preference, tokenizer) -> tuple[Dataset, Any, str]:
    """``task='rm' | 'dpo'``: `colo.apps.rlhf.PreferenceDataset` items (chosen and rejected rows of one record as one
    ``(2, seq_len)`` item), from ``data.paths`` or the embedded Python-line set (``preference.synthetic_records``)."""
    from .synthetic import python_line_records

    if data.paths:
        records = read_preference_records(data.paths, format=data.format)
        source = ", ".join(data.paths)
    else:
        records = python_line_records(preference.synthetic_records, seed=0)
        source = f"{preference.synthetic_records} synthetic records (Python lines vs their words shuffled)"
    template = data.chat_template.template() if "chat_template" in data.model_fields_set else None
    try:
        pairs = PreferenceDataset(
            records, tokenizer, seq_len=data.seq_len, template=template, max_prompt_len=preference.max_prompt_len
        )
    except ValueError as error:
        raise ValueError(f"data.task={data.task!r}: {error}") from None
    description = (
        f"{data.task}: {len(pairs)} preference pairs from {source} (chosen and rejected in one forward), "
        f"{pairs.num_prompts_truncated} prompts truncated from the left, {pairs.num_responses_truncated} pairs "
        "with responses cut at data.seq_len"
    )
    return pairs, pairs.row_lengths, description
