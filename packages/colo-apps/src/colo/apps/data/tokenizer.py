"""Tokenizers: a dependency-free byte tokenizer and a wrapper over a Hugging Face ``tokenizer.json``.

Both share one interface (`Tokenizer`): ``encode(text) -> list[int]``, ``decode(ids) -> str``, ``vocab_size``,
``bos_id``, ``eos_id``, ``pad_id``, and ``encode_arrays(texts)`` (a list of int32 numpy arrays, the fast path the
packing code uses). ``encode`` never adds special tokens: the dataset decides where ``bos`` and ``eos`` go.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np


@runtime_checkable
class Tokenizer(Protocol):
    """What the datasets need from a tokenizer."""

    vocab_size: int
    bos_id: int
    eos_id: int
    pad_id: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens: ids 0..255 are the bytes, then ``bos`` = 256, ``eos`` = 257, ``pad`` = 258.

    Needs no files and no training, covers every string, and encodes at memory speed (``str.encode`` and numpy),
    so the whole Python standard library tokenizes in well under a second. ``vocab_size`` is 259.
    """

    bos_id: int = 256
    eos_id: int = 257
    pad_id: int = 258
    vocab_size: int = 259

    def encode(self, text: str) -> list[int]:
        """The UTF-8 bytes of ``text`` (no special tokens)."""
        return list(text.encode("utf-8"))

    def encode_arrays(self, texts: Sequence[str]) -> list[np.ndarray]:
        """`encode` for many texts at once, each as an int32 numpy array."""
        return [np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.int32) for text in texts]

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True, errors: str = "replace") -> str:
        """The text of ``ids``; invalid UTF-8 becomes U+FFFD (``errors="backslashreplace"``: ``\\xNN``).

        Args:
            ids (Iterable[int]): token ids (a list, numpy array or tensor).
            skip_special_tokens (bool): drop ``bos``/``eos``/``pad``; otherwise they appear as ``<bos>``,
                ``<eos>``, ``<pad>``. Default: ``True``.
            errors (str): what `bytes.decode` does with invalid UTF-8. Default: ``"replace"``.

        Raises:
            ValueError: an id outside ``0..258``.
        """
        array = np.asarray(ids.tolist() if hasattr(ids, "tolist") else list(ids), dtype=np.int64).reshape(-1)
        bad = array[(array < 0) | (array >= self.vocab_size)]
        if bad.size:
            raise ValueError(f"ByteTokenizer: token id {int(bad[0])} is outside 0..{self.vocab_size - 1}")
        special = array >= 256
        if not special.any():
            return array.astype(np.uint8).tobytes().decode("utf-8", errors=errors)
        names = {self.bos_id: "<bos>", self.eos_id: "<eos>", self.pad_id: "<pad>"}
        pieces, start = [], 0
        for position in np.flatnonzero(special).tolist():
            pieces.append(array[start:position].astype(np.uint8).tobytes().decode("utf-8", errors=errors))
            if not skip_special_tokens:
                pieces.append(names[int(array[position])])
            start = position + 1
        pieces.append(array[start:].astype(np.uint8).tobytes().decode("utf-8", errors=errors))
        return "".join(pieces)

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab_size=259)"


# Names special tokens commonly have in Hugging Face tokenizers, tried in order when none is given.
_BOS_CANDIDATES = ("<s>", "<|begin_of_text|>", "<|bos|>", "<bos>", "[CLS]", "<|endoftext|>")
_EOS_CANDIDATES = ("</s>", "<|end_of_text|>", "<|eos|>", "<eos>", "<|endoftext|>", "<|im_end|>", "[SEP]")
_PAD_CANDIDATES = ("<pad>", "<|pad|>", "[PAD]", "<|finetune_right_pad_id|>")


class HFTokenizer:
    """A Hugging Face ``tokenizers`` tokenizer loaded from its ``tokenizer.json``.

    Special tokens come from the arguments, else from a ``tokenizer_config.json`` next to the file (as
    ``transformers`` saves it), else from common names (``<s>``/``</s>``/``<pad>``, ``<|begin_of_text|>``,
    ``<|endoftext|>``, ...). Without a beginning-of-sequence token ``bos`` is ``eos`` (as for GPT-2); without a
    padding token ``pad`` is ``eos`` (padding carries no loss, so any id serves).

    Args:
        path (str | Path): a ``tokenizer.json`` file, or a directory holding one.
        bos_token (str | None): the beginning-of-sequence token's text. Default: ``None`` (found as above).
        eos_token (str | None): the end-of-sequence token's text. Default: ``None``.
        pad_token (str | None): the padding token's text. Default: ``None``.

    Raises:
        ImportError: the ``tokenizers`` package is missing.
        FileNotFoundError: no ``tokenizer.json`` at ``path``.
        ValueError: a named token is not in the vocabulary, or no end-of-sequence token can be found.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        pad_token: str | None = None,
    ) -> None:
        try:
            from tokenizers import Tokenizer as _RustTokenizer
        except ImportError as error:  # pragma: no cover - tokenizers ships with the test environment
            raise ImportError("HFTokenizer needs the `tokenizers` package: pip install tokenizers") from error
        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(
                f"no tokenizer.json at {path}; pass the path of a Hugging Face tokenizer.json (or of a directory "
                "holding one), or no tokenizer path to use the byte tokenizer"
            )
        self.path = file
        self._tokenizer = _RustTokenizer.from_file(str(file))
        configured = _special_tokens_from_config(file.parent / "tokenizer_config.json")
        eos = self._find("eos_token", eos_token or configured.get("eos_token"), _EOS_CANDIDATES)
        if eos is None:
            raise ValueError(
                f"{file}: cannot tell which token ends a sequence (none of {list(_EOS_CANDIDATES)} is in the "
                "vocabulary); pass eos_token='<the token>'"
            )
        bos = self._find("bos_token", bos_token or configured.get("bos_token"), _BOS_CANDIDATES)
        pad = self._find("pad_token", pad_token or configured.get("pad_token"), _PAD_CANDIDATES)
        self.eos_id: int = eos
        self.bos_id: int = eos if bos is None else bos
        self.pad_id: int = eos if pad is None else pad
        self.vocab_size: int = self._tokenizer.get_vocab_size(with_added_tokens=True)

    def _find(self, field: str, name: str | None, candidates: Sequence[str]) -> int | None:
        if name is not None:
            token_id = self._tokenizer.token_to_id(name)
            if token_id is None:
                raise ValueError(f"{self.path}: {field}={name!r} is not in the vocabulary; pass a token it holds")
            return token_id
        for candidate in candidates:
            token_id = self._tokenizer.token_to_id(candidate)
            if token_id is not None:
                return token_id
        return None

    def encode(self, text: str) -> list[int]:
        """The token ids of ``text`` (no special tokens added)."""
        return self._tokenizer.encode(text, add_special_tokens=False).ids

    def encode_arrays(self, texts: Sequence[str]) -> list[np.ndarray]:
        """`encode` for many texts at once (the library's batched, multi-threaded path, without the character
        offsets when the library can skip them), as int32 arrays."""
        encode_batch = getattr(self._tokenizer, "encode_batch_fast", self._tokenizer.encode_batch)
        encodings = encode_batch(list(texts), add_special_tokens=False)
        return [np.asarray(encoding.ids, dtype=np.int32) for encoding in encodings]

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = True) -> str:
        """The text of ``ids`` (invalid UTF-8 from byte-level pieces becomes U+FFFD).

        Args:
            ids (Iterable[int]): token ids (a list, numpy array or tensor).
            skip_special_tokens (bool): drop special tokens. Default: ``True``.
        """
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def __repr__(self) -> str:
        return f"HFTokenizer({str(self.path)!r}, vocab_size={self.vocab_size})"


def _special_tokens_from_config(config_file: Path) -> dict[str, str]:
    """``bos_token`` / ``eos_token`` / ``pad_token`` from a transformers ``tokenizer_config.json``, if any."""
    if not config_file.is_file():
        return {}
    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    tokens = {}
    for field in ("bos_token", "eos_token", "pad_token"):
        value = config.get(field)
        if isinstance(value, dict):  # an AddedToken serialized as {"content": ..., ...}
            value = value.get("content")
        if isinstance(value, str):
            tokens[field] = value
    return tokens


def load_tokenizer(path: str | Path | None = None) -> ByteTokenizer | HFTokenizer:
    """The tokenizer a run config names.

    Args:
        path (str | Path | None): ``None`` or ``"byte"`` for the `ByteTokenizer`; otherwise a Hugging Face
            ``tokenizer.json`` (or a directory holding one) for an `HFTokenizer`. Default: ``None``.

    Returns:
        ByteTokenizer | HFTokenizer: the tokenizer.
    """
    if path is None or str(path) == "byte":
        return ByteTokenizer()
    return HFTokenizer(path)


def encode_arrays(tokenizer: Tokenizer, texts: Sequence[str]) -> list[np.ndarray]:
    """``tokenizer.encode_arrays(texts)`` when it has it, else `encode` text by text; int32 arrays."""
    fast = getattr(tokenizer, "encode_arrays", None)
    if fast is not None:
        return fast(texts)
    return [np.asarray(tokenizer.encode(text), dtype=np.int32) for text in texts]
