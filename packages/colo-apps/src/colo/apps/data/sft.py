"""Supervised fine-tuning: chat conversations rendered by a template, with the loss on the assistant's replies only."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from .packing import IGNORE_INDEX, pack_to_token_budget
from .sources import validate_messages
from .tokenizer import Tokenizer


def _default_role_markers() -> dict[str, str]:
    return {"system": "<|system|>\n", "user": "<|user|>\n", "assistant": "<|assistant|>\n"}


@dataclass(frozen=True, kw_only=True)
class ChatTemplate:
    """How a conversation becomes tokens, and which of them carry a loss.

    A conversation renders as ``[bos]``, then for every message its role marker and its content; a non-assistant
    message is followed by ``turn_end``, an assistant message by the ``eos`` token. With the defaults::

        [bos]<|system|>\\nBe brief.\\n<|user|>\\nHi\\n<|assistant|>\\nHello![eos]<|user|>\\n...

    Only the assistant's content and its closing ``eos`` are labelled (so the model learns to answer and to stop);
    the ``bos``, every role marker (the assistant's too) and every other message are ``-100``. Each piece is
    tokenized on its own, so the mask is exact for any tokenizer.

    Attributes:
        role_markers (dict[str, str]): text that opens a message of each role. Default: ``<|system|>\\n``,
            ``<|user|>\\n``, ``<|assistant|>\\n``. Add roles (e.g. ``"tool"``) here.
        turn_end (str): text after every non-assistant message. Default: ``"\\n"``.
        assistant_role (str): the role whose messages are trained on. Default: ``"assistant"``.
        add_bos (bool): start with the ``bos`` token. Default: ``True``.
    """

    role_markers: dict[str, str] = field(default_factory=_default_role_markers)
    """Text that opens a message of each role."""
    turn_end: str = "\n"
    """Text after every non-assistant message (an assistant message ends with the eos token)."""
    assistant_role: str = "assistant"
    """The role whose messages carry the loss."""
    add_bos: bool = True
    """Start every conversation with the bos token."""

    def __post_init__(self) -> None:
        if self.assistant_role not in self.role_markers:
            raise ValueError(
                f"ChatTemplate: assistant_role={self.assistant_role!r} has no entry in role_markers "
                f"({sorted(self.role_markers)}); add a marker for it"
            )

    def _marker(self, role: str, index: int) -> str:
        if role not in self.role_markers:
            raise ValueError(
                f"message {index} has role {role!r}; the chat template knows {sorted(self.role_markers)} "
                "(add it to ChatTemplate.role_markers)"
            )
        return self.role_markers[role]

    def render(self, messages: list[Mapping[str, str]], *, add_generation_prompt: bool = False) -> str:
        """The conversation as text, special tokens written ``<bos>``/``<eos>`` (for display and prompts).

        Args:
            messages (list[dict[str, str]]): ``{"role": ..., "content": ...}`` messages.
            add_generation_prompt (bool): end with the assistant's marker, ready for the model to answer.
                Default: ``False``.
        """
        messages = validate_messages(messages)
        parts = ["<bos>"] if self.add_bos else []
        for index, message in enumerate(messages):
            parts.append(self._marker(message["role"], index) + message["content"])
            parts.append("<eos>" if message["role"] == self.assistant_role else self.turn_end)
        if add_generation_prompt:
            parts.append(self.role_markers[self.assistant_role])
        return "".join(parts)

    def tokenize(
        self, messages: list[Mapping[str, str]], tokenizer: Tokenizer, *, add_generation_prompt: bool = False
    ) -> tuple[list[int], list[int]]:
        """Token ids and labels of a conversation.

        Args:
            messages (list[dict[str, str]]): ``{"role": ..., "content": ...}`` messages.
            tokenizer (Tokenizer): the tokenizer.
            add_generation_prompt (bool): end with the assistant's marker (a prompt for generation).
                Default: ``False``.

        Returns:
            tuple[list[int], list[int]]: ``input_ids`` and ``labels`` of the same length; labels equal the ids on
            the assistant's content and closing ``eos`` and are ``-100`` elsewhere.

        Raises:
            ValueError: a malformed message or a role without a marker.
        """
        messages = validate_messages(messages)
        input_ids: list[int] = [tokenizer.bos_id] if self.add_bos else []
        labels: list[int] = [IGNORE_INDEX] * len(input_ids)

        def add(ids: list[int], trained: bool) -> None:
            input_ids.extend(ids)
            labels.extend(ids if trained else [IGNORE_INDEX] * len(ids))

        for index, message in enumerate(messages):
            add(tokenizer.encode(self._marker(message["role"], index)), trained=False)
            if message["role"] == self.assistant_role:
                add(tokenizer.encode(message["content"]) + [tokenizer.eos_id], trained=True)
            else:
                add(tokenizer.encode(message["content"] + self.turn_end), trained=False)
        if add_generation_prompt:
            add(tokenizer.encode(self.role_markers[self.assistant_role]), trained=False)
        return input_ids, labels


def conversation_of(record: Any, *, index: int = 0) -> list[dict[str, str]]:
    """A conversation from a list of messages or a ``{"prompt": ..., "response": ...}`` record.

    Args:
        record: messages, or a mapping with string ``prompt`` and ``response`` (and optionally ``system``).
        index (int): the record's position, for error messages. Default: ``0``.

    Raises:
        ValueError: anything else (plain text included).
    """
    where = f"conversation {index}"
    if isinstance(record, Mapping) and "prompt" in record and "response" in record:
        messages = [{"role": "system", "content": record["system"]}] if record.get("system") else []
        messages += [
            {"role": "user", "content": record["prompt"]},
            {"role": "assistant", "content": record["response"]},
        ]
        return validate_messages(messages, where=where)
    if isinstance(record, str):
        raise ValueError(
            f"{where} is plain text; SFT needs chat messages or prompt/response records (read JSONL with a "
            "'messages' field or 'prompt' and 'response' fields)"
        )
    return validate_messages(record, where=where)


class SFTDataset(Dataset):
    """Conversations tokenized with a `ChatTemplate`, one per row (or several packed per row), padded to ``seq_len``.

    With ``packing="none"`` item ``i`` is ``{"input_ids", "labels"}`` (int64, ``(seq_len,)``): the template's tokens,
    cut at ``seq_len`` (the end is dropped) or right-padded with ``pad_id``; labels are ``-100`` except on the
    assistant's replies (and on padding always ``-100``). Right padding is safe with causal attention: no real token
    attends to it. A conversation with no labelled token left after truncation is skipped (counted in
    `num_skipped`), since it would carry no loss.

    With ``packing="documents"`` whole conversations (each cut at ``seq_len`` as above) are bin-packed into rows
    (`pack_to_token_budget`), and items also carry ``position_ids`` restarting at each conversation: the model
    derives its document mask from them, so a packed row trains exactly as its conversations would one per row,
    with far less padding. Each conversation's first token carries no label (nothing predicts across a boundary).

    Args:
        conversations (Iterable): message lists, or ``{"prompt", "response"}`` records (e.g. from `read_documents`).
        tokenizer (Tokenizer): the tokenizer.
        seq_len (int): tokens per row.
        template (ChatTemplate | None): the chat template. Default: ``None`` (``ChatTemplate()``).
        packing (str): ``"none"`` (one conversation per row) or ``"documents"`` (several per row). Default:
            ``"none"``.

    Raises:
        ValueError: a malformed conversation (named by its index), none with a trainable token within
            ``seq_len``, or an unknown ``packing``.
    """

    def __init__(
        self,
        conversations: Iterable[Any],
        tokenizer: Tokenizer,
        *,
        seq_len: int,
        template: ChatTemplate | None = None,
        packing: str = "none",
    ) -> None:
        if seq_len <= 1:
            raise ValueError(f"seq_len={seq_len} must be at least 2")
        if packing not in ("none", "documents"):
            raise ValueError(f"SFTDataset: packing={packing!r} is unknown; use 'none' or 'documents'")
        self.packing = packing
        self.seq_len = seq_len
        self.template = template or ChatTemplate()
        self.pad_id = tokenizer.pad_id
        self.num_skipped = 0
        self.num_truncated = 0
        self._rows: list[tuple[np.ndarray, np.ndarray]] = []
        count = 0
        for index, record in enumerate(conversations):
            count += 1
            ids, labels = self.template.tokenize(conversation_of(record, index=index), tokenizer)
            if len(ids) > seq_len:
                self.num_truncated += 1
                ids, labels = ids[:seq_len], labels[:seq_len]
            labels_array = np.asarray(labels, dtype=np.int64)
            # labels[0] is never a prediction target (the model shifts), so a row needs one past it.
            if not (labels_array[1:] != IGNORE_INDEX).any():
                self.num_skipped += 1
                continue
            self._rows.append((np.asarray(ids, dtype=np.int64), labels_array))
        if not self._rows:
            raise ValueError(
                f"none of the {count} conversations has an assistant token within seq_len={seq_len}; raise seq_len "
                "or check that the data holds assistant replies"
            )
        self.num_conversations = len(self._rows)
        if packing == "documents":
            packed = pack_to_token_budget([ids.size for ids, _ in self._rows], seq_len=seq_len)
        else:
            packed = [[i] for i in range(len(self._rows))]
        self.conversation_rows: list[list[int]] = packed
        """For each row, the indices of its conversations (in `_rows`), in row order."""

    @property
    def row_lengths(self) -> np.ndarray:
        """Tokens (not padding) in each row, int64: what a tokens-per-second count should count."""
        return np.asarray([sum(self._rows[i][0].size for i in row) for row in self.conversation_rows], dtype=np.int64)

    def __len__(self) -> int:
        return len(self.conversation_rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"row {index} out of range for {len(self)} rows")
        input_ids = torch.full((self.seq_len,), self.pad_id, dtype=torch.long)
        padded_labels = torch.full((self.seq_len,), IGNORE_INDEX, dtype=torch.long)
        position_ids = torch.zeros(self.seq_len, dtype=torch.long)
        cursor = 0
        for conversation in self.conversation_rows[index]:
            ids, labels = self._rows[conversation]
            end = cursor + ids.size
            input_ids[cursor:end] = torch.from_numpy(ids)
            padded_labels[cursor:end] = torch.from_numpy(labels)
            padded_labels[cursor] = IGNORE_INDEX  # nothing predicts the first token of a conversation
            position_ids[cursor:end] = torch.arange(ids.size)
            cursor = end
        if self.packing == "none":
            return {"input_ids": input_ids, "labels": padded_labels}
        return {"input_ids": input_ids, "labels": padded_labels, "position_ids": position_ids}
