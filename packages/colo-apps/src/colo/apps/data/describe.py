"""`colo data inspect`: what a prepared corpus holds, a few of its documents decoded, and every checksum on request."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from .shards import TokenCorpus
from .tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

_BUCKET_BASE = 4
"""Document lengths are counted in buckets ``[4**k, 4**(k + 1))`` tokens."""


def describe_corpus(
    path: str | os.PathLike,
    *,
    samples: int = 3,
    verify: bool = False,
    tokenizer=None,
    sample_tokens: int = 96,
) -> dict:
    """Describe the prepared corpus at ``path``.

    Args:
        path: the corpus directory.
        samples: documents to decode, spread evenly over the corpus (first to last). Default: 3.
        verify: check every block of every shard against its CRC-32 (reads the whole corpus). Default: ``False``.
        tokenizer: decodes the samples: a ``tokenizer.json`` path or a tokenizer, which must be the corpus's; by
            default the one the manifest names, when it is the byte tokenizer or its file is still there unchanged.
        sample_tokens: tokens decoded from the start of each sample. Default: 96.

    Returns:
        dict: ``path``, ``tokens``, ``documents``, ``shards``, ``dtype``, ``bytes`` (of the token files),
        ``tokenizer`` (the manifest's record), ``prepared`` (inputs and settings, when `colo data prepare` wrote it),
        ``document_tokens`` (``min``, ``mean``, ``max``), ``histogram`` (``{"from", "to", "documents"}`` per
        log-spaced bucket of document lengths, framing tokens included), ``samples`` (``{"document", "tokens",
        "text"}``; ``text`` is ``None`` when no tokenizer can decode; bytes that are not UTF-8 appear as ``\\xNN``
        where the tokenizer is byte-level) and ``verified``.

    Raises:
        CorpusError: not a corpus, another tokenizer, or (with ``verify``) a damaged shard, naming the file.
    """
    if tokenizer is not None and not hasattr(tokenizer, "vocab_size"):
        tokenizer = load_tokenizer(tokenizer)
    corpus = TokenCorpus(path, tokenizer=tokenizer)
    if verify:
        corpus.verify()
    lengths_seen = 0
    counts = np.zeros(33, dtype=np.int64)
    shortest, longest, total = None, 0, 0
    for shard in range(len(corpus.shards)):
        lengths = np.diff(corpus.document_offsets(shard))
        if lengths.size == 0:
            continue
        lengths_seen += lengths.size
        buckets = np.floor(np.log2(np.maximum(lengths, 1)) / np.log2(_BUCKET_BASE)).astype(np.int64)
        counts += np.bincount(buckets, minlength=counts.size)[: counts.size]
        shortest = int(lengths.min()) if shortest is None else min(shortest, int(lengths.min()))
        longest = max(longest, int(lengths.max()))
        total += int(lengths.sum())
    used = np.flatnonzero(counts)
    histogram = [
        {"from": _BUCKET_BASE**k, "to": _BUCKET_BASE ** (k + 1), "documents": int(counts[k])}
        for k in (range(used[0], used[-1] + 1) if used.size else ())
    ]
    decoder = tokenizer if tokenizer is not None else _manifest_tokenizer(corpus.manifest["tokenizer"])
    chosen = sorted({round(i) for i in np.linspace(0, corpus.num_documents - 1, samples)}) if samples > 0 else []
    shown = []
    for document in chosen if corpus.num_documents else []:
        start, stop = corpus.document_span(document)
        ids = corpus.read(start, min(stop, start + sample_tokens))
        text = decode_escaped(decoder, ids) if decoder is not None else None
        shown.append({"document": int(document), "tokens": stop - start, "text": text})
    token_bytes = sum(shard.tokens.path.stat().st_size for shard in corpus.shards)
    return {
        "path": str(path),
        "tokens": corpus.num_tokens,
        "documents": corpus.num_documents,
        "shards": len(corpus.shards),
        "dtype": np.dtype(corpus.manifest["dtype"]).name,
        "bytes": token_bytes,
        "tokenizer": corpus.manifest["tokenizer"],
        "prepared": corpus.manifest.get("prepared"),
        "document_tokens": {
            "min": shortest or 0,
            "mean": round(total / lengths_seen, 1) if lengths_seen else 0.0,
            "max": longest,
        },
        "histogram": histogram,
        "samples": shown,
        "verified": verify,
    }


def _manifest_tokenizer(recorded: dict):
    """The tokenizer a manifest names, if it can still be loaded as it was (same SHA-256), else ``None``."""
    if recorded.get("kind") == "ByteTokenizer":
        return ByteTokenizer()
    file = Path(str(recorded.get("name", "")))
    if recorded.get("kind") == "HFTokenizer" and file.is_file():
        if hashlib.sha256(file.read_bytes()).hexdigest() == recorded.get("sha256"):
            return HFTokenizer(file)
    return None


def decode_escaped(tokenizer, ids) -> str:
    """``ids`` as text without special tokens, bytes that are not UTF-8 shown as ``\\xNN`` (the byte tokenizer and
    byte-level Hugging Face tokenizers; others decode as their ``decode`` does, U+FFFD included)."""
    ids = [int(i) for i in np.asarray(ids).reshape(-1)]
    if isinstance(tokenizer, ByteTokenizer):
        return tokenizer.decode(ids, errors="backslashreplace")
    raw = _byte_level_bytes(tokenizer, ids) if isinstance(tokenizer, HFTokenizer) else None
    if raw is None:
        return tokenizer.decode(ids)
    return raw.decode("utf-8", errors="backslashreplace")


def _byte_level_bytes(tokenizer: HFTokenizer, ids: list[int]) -> bytes | None:
    """The raw bytes of ``ids`` for a tokenizer with a byte-level decoder (GPT-2's byte alphabet), else ``None``."""
    rust = tokenizer._tokenizer
    if type(rust.decoder).__name__ != "ByteLevel":
        return None
    alphabet = _byte_alphabet()
    added = rust.get_added_tokens_decoder()
    pieces = bytearray()
    for token_id in ids:
        if token_id in added:
            if not added[token_id].special:
                pieces += added[token_id].content.encode("utf-8")
            continue
        token = rust.id_to_token(token_id)
        if token is None or any(char not in alphabet for char in token):
            return None
        pieces += bytes(alphabet[char] for char in token)
    return bytes(pieces)


def _byte_alphabet() -> dict[str, int]:
    """GPT-2's map from the printable stand-in characters of byte-level BPE back to the bytes they stand for."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    stand_ins = {byte: byte for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in stand_ins:
            stand_ins[byte] = 256 + extra
            extra += 1
    return {chr(code): byte for byte, code in stand_ins.items()}
