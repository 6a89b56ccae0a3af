"""`colo data prepare`: raw text, JSON Lines, Parquet or saved Hugging Face datasets tokenized into a prepared corpus.

The inputs are cut into work units (`colo.apps.data.units`), each tokenized by a worker process
(`colo.apps.data.prepare_workers`) into one shard (`colo.apps.data.shards`), so the corpus is byte-identical whatever
the number of workers, and holds exactly the token stream `tokenize_documents(read_documents(inputs), tokenizer)`
gives, document for document.

Besides the corpus files the directory holds ``prepare.json`` (the inputs' fingerprint and the units) and one
``shard-NNNNN.json`` per finished shard (its manifest record, written after the shard's files). A crash leaves
finished shards behind; the next run on the same inputs tokenizes only the missing units, then writes
``manifest.json``. Once the manifest is written, a rerun on the same inputs checks the shards' sizes and checksum
files (every block with ``verify``) and rewrites nothing unless a shard is missing or damaged. Everything on disk
is JSON or raw little-endian integers.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Sequence
from dataclasses import fields
from itertools import islice
from pathlib import Path

import numpy as np

from .prepare_workers import ShardJob, available_cpus, run_units, start_forkserver
from .shards import (
    BLOCK_BYTES,
    MANIFEST,
    CorpusError,
    ShardRecord,
    TokenShard,
    _write_atomically,
    read_manifest,
    token_dtype,
    tokenizer_identity,
    write_manifest,
)
from .sources import read_documents, source_files
from .tokenizer import ByteTokenizer, HFTokenizer, encode_arrays, load_tokenizer
from .units import WorkUnit, plan_units

DEFAULT_SHARD_TOKENS = 1 << 24
"""Most tokens a shard holds by default (about 16.8M: 32 MiB of ``uint16`` tokens); a shard is one unit of work."""
MIN_SHARDS = 64
"""By default a corpus is cut into at least this many shards (where its files can be cut, and none smaller than
1 MiB of input), so that every worker has work until near the end; the count depends on the corpus alone."""
_MIN_UNIT_BYTES = 1 << 20
CACHE_DIR = "cache"
"""Where the trainer caches what it derives from a corpus (`colo.apps.data.row_index.CACHE_DIR`)."""
PLAN = "prepare.json"
_PLAN_VERSION = 1
_SAMPLE_CHARS = 1 << 18  # text tokenized to estimate input bytes per token when planning the units
_CORPUS_FILE_SUFFIXES = (".tokens", ".index", ".tokens.crc32", ".index.crc32", ".json", ".tmp")


def prepare_corpus(
    inputs: str | os.PathLike | Sequence[str | os.PathLike],
    out_dir: str | os.PathLike,
    *,
    tokenizer=None,
    format: str = "auto",
    text_field: str = "text",
    workers: int | None = None,
    shard_tokens: int | None = None,
    overwrite: bool = False,
    verify: bool = False,
    progress: bool = False,
) -> dict:
    """Tokenize ``inputs`` into a prepared corpus at ``out_dir`` (resuming a crashed run; a no-op when done).

    Args:
        inputs: files, directories or glob patterns, as `read_documents` takes them: text files (one document
            each), JSON Lines / JSON arrays (``text_field`` of each record), Parquet files (the ``text_field``
            column) and Hugging Face datasets saved to disk (its ``"train"`` split when a ``DatasetDict``).
        out_dir: the corpus directory (created; an existing one must be a corpus or a run of this function).
        tokenizer: a Hugging Face ``tokenizer.json`` path, ``None`` for the `ByteTokenizer`, or a tokenizer object
            (an `HFTokenizer` / `ByteTokenizer` is reloaded from its path in each worker; another object is sent to
            the workers as it is). Default: ``None``.
        format: ``"auto"``, ``"text"``, ``"jsonl"``, ``"hf"`` or ``"parquet"`` (`read_documents`' formats).
            Default: ``"auto"``.
        text_field: the field or column holding the text. Default: ``"text"``.
        workers: tokenizing processes. Default: ``None`` (one per CPU this process may use).
        shard_tokens: about how many tokens a shard holds (units are cut by input bytes at the tokenizer's bytes
            per token, measured on the first 256 KiB of text). Default: ``None``: `DEFAULT_SHARD_TOKENS`, or less
            for a corpus too small to make `MIN_SHARDS` shards of that size.
        overwrite: delete a corpus already at ``out_dir`` (its files only) and prepare afresh. Default: ``False``.
        verify: check every block of the shards a rerun keeps, rewriting the damaged ones. Default: ``False``.
        progress: draw a progress bar on stderr. Default: ``False``.

    Returns:
        dict: the manifest (`colo.apps.data.shards.write_manifest`), with ``"prepared"`` (input fingerprint and
        settings) and, not stored, ``"shards_written"``: how many shards this call wrote.

    Raises:
        FileNotFoundError: an input does not exist.
        ValueError: a bad setting, or input that is not text (each message names the file and line or row).
        CorpusError: ``out_dir`` holds a corpus of another tokenizer or other inputs (the fix: another ``out_dir``,
            or ``overwrite``), or files that are not a corpus.
    """
    if shard_tokens is not None and shard_tokens <= 0:
        raise ValueError(f"shard_tokens={shard_tokens} must be positive")
    workers = available_cpus() if workers is None else workers
    if workers < 1:
        raise ValueError(f"workers={workers} must be at least 1")
    loaded, spec = _load(tokenizer)
    identity = tokenizer_identity(loaded)
    dtype = token_dtype(identity["vocab_size"])
    sources = source_files(inputs, format=format)
    fingerprint = _fingerprint(sources, format, text_field, shard_tokens, identity)
    digest = hashlib.sha256(json.dumps(fingerprint, sort_keys=True).encode()).hexdigest()
    out = Path(out_dir)
    for path, _ in sources:
        if out.resolve() in path.resolve().parents:
            raise ValueError(
                f"the input {path} lies inside the output directory {out}: write the corpus outside the input "
                "directories, or name the input files"
            )
    if overwrite:
        _remove_corpus(out)
    plan = _check_existing(out, identity, fingerprint, digest)
    if plan is None:
        input_bytes = sum(entry[2] for entry in fingerprint["files"])
        if workers > 1 and input_bytes > 2 * _MIN_UNIT_BYTES:  # enough for two units: workers will be started
            start_forkserver()  # its imports run while the units are planned here
        bytes_per_token = _bytes_per_token(sources, loaded, format, text_field)
        if shard_tokens is None:
            target_bytes = min(DEFAULT_SHARD_TOKENS * bytes_per_token, max(input_bytes / MIN_SHARDS, _MIN_UNIT_BYTES))
        else:
            target_bytes = shard_tokens * bytes_per_token
        units = plan_units(sources, target_bytes=round(target_bytes), text_field=text_field)
        plan = {
            "fingerprint": digest,
            "tokenizer": identity,
            "bytes_per_token": bytes_per_token,
            "target_shard_tokens": round(target_bytes / bytes_per_token),
            "inputs": fingerprint,
            "units": [unit.to_json() for unit in units],
        }
        out.mkdir(parents=True, exist_ok=True)
        _write_atomically(out / PLAN, (json.dumps(plan, indent=1) + "\n").encode())
    units = [WorkUnit.from_json(unit) for unit in plan["units"]]

    records = {unit.number: _finished(out, unit, digest, dtype, verify) for unit in units}
    todo = [unit for unit in units if records[unit.number] is None]
    if not todo and (out / MANIFEST).is_file():
        return {**read_manifest(out), "shards_written": 0}
    for unit in todo:
        _remove_shard(out, unit.name)
    job = ShardJob(str(out), text_field, dtype.str, digest)
    for record in run_units(todo, job, loaded, spec, workers=workers, progress=progress):
        records[record["unit"]["number"]] = record
    shards = [_shard_record(records[unit.number]) for unit in units]
    manifest = _write_manifest(out, identity, shards, plan, sources)
    return {**manifest, "shards_written": len(todo)}


def _load(tokenizer):
    """``(tokenizer, what a worker loads it from)``: a path or ``None``, (path, special ids), or the object."""
    if tokenizer is None or str(tokenizer) == "byte":
        tokenizer = load_tokenizer(None)
    elif isinstance(tokenizer, (str, os.PathLike)):
        tokenizer = load_tokenizer(Path(tokenizer).resolve())  # the manifest names it wherever it is read from
    if isinstance(tokenizer, ByteTokenizer):
        return tokenizer, None
    if isinstance(tokenizer, HFTokenizer):
        return tokenizer, (str(tokenizer.path), tokenizer.bos_id, tokenizer.eos_id, tokenizer.pad_id)
    return tokenizer, tokenizer


def _fingerprint(sources, format: str, text_field: str, shard_tokens: int, identity: dict) -> dict:
    """What a prepared corpus is a function of: every input file's resolved path, size and mtime, the settings that
    change what is read or how it is cut, and the tokenizer."""
    files = []
    for path, kind in sources:
        members = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        for member in members:
            stat = member.stat()
            files.append([str(member.resolve()), kind, stat.st_size, stat.st_mtime_ns])
    return {
        "plan_version": _PLAN_VERSION,
        "format": format,
        "text_field": text_field,
        "shard_tokens": shard_tokens,
        "tokenizer_sha256": identity["sha256"],
        "files": files,
    }


def _remove_corpus(out: Path) -> None:
    """Delete the corpus files at ``out``, and the trainer's caches in its ``cache/`` (nothing else: a folder holding
    other files is refused)."""
    if not out.is_dir():
        return
    _check_only_corpus_files(out)
    for path in out.iterdir():
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()


def _check_only_corpus_files(out: Path) -> None:
    for path in sorted(out.iterdir()):
        if path.name == CACHE_DIR and path.is_dir():  # the trainer's row indexes (`colo.apps.data.row_index`)
            continue
        ours = path.name in (MANIFEST, PLAN, MANIFEST + ".tmp", PLAN + ".tmp") or (
            path.name.startswith("shard-") and path.name.endswith(_CORPUS_FILE_SUFFIXES)
        )
        if not ours or not path.is_file():
            raise CorpusError(
                f"{out} holds {path.name}, which is not part of a prepared corpus; prepare into a new or empty --out"
            )


def _check_existing(out: Path, identity: dict, fingerprint: dict, digest: str) -> dict | None:
    """The plan of an earlier run on the same inputs (to resume or check), ``None`` for a fresh directory (or an
    unfinished run on other inputs, whose files are deleted: nothing of it was published), or a `CorpusError` for a
    directory prepared with another tokenizer, a finished corpus of other inputs, or one holding other files."""
    if not out.exists():
        return None
    if not out.is_dir():
        raise CorpusError(f"--out {out} is a file; name a directory")
    manifest = read_manifest(out) if (out / MANIFEST).is_file() else None
    try:
        plan = json.loads((out / PLAN).read_text()) if (out / PLAN).is_file() else None
    except ValueError:
        raise CorpusError(f"{out / PLAN} is not valid JSON; pass --overwrite to prepare {out} again") from None
    if manifest is None and plan is None:
        _check_only_corpus_files(out)
        return None
    recorded = (manifest or plan)["tokenizer"]
    if recorded.get("sha256") != identity["sha256"]:
        raise CorpusError(
            f"{out} was prepared with the tokenizer {recorded.get('name')!r} ({recorded.get('kind')}, "
            f"{recorded.get('vocab_size')} ids); this prepare's tokenizer is {identity['name']!r} ({identity['kind']}, "
            f"{identity['vocab_size']} ids): write to another --out, or pass --overwrite to replace that corpus"
        )
    if manifest is None and plan["fingerprint"] != digest:  # a run that never finished, on other inputs: start over
        _remove_corpus(out)
        return None
    if plan is None:  # a finished corpus whose plan was deleted: planned again (the same units) if the inputs match
        if manifest.get("prepared", {}).get("fingerprint") == digest:
            return None
        what = f"its inputs are unknown: no {PLAN}"
    else:
        what = _difference(plan["inputs"], fingerprint)
    if plan is None or plan["fingerprint"] != digest:
        raise CorpusError(
            f"{out} was prepared from other inputs or settings ({what}); write to another --out, or pass "
            "--overwrite to prepare it again"
        )
    return plan


def _difference(old: dict, new: dict) -> str:
    """The first thing that differs between two fingerprints, in words."""
    for key in ("format", "text_field", "shard_tokens", "plan_version"):
        if old.get(key) != new.get(key):
            return f"{key} was {old.get(key)!r}, now {new.get(key)!r}"
    before = {entry[0]: entry for entry in old.get("files", [])}
    after = {entry[0]: entry for entry in new.get("files", [])}
    for path in after:
        if path not in before:
            return f"{path} is new"
        if before[path][2] != after[path][2]:
            return f"{path} changed size ({before[path][2]} -> {after[path][2]} bytes)"
        if before[path][1] != after[path][1]:
            return f"{path} is read as {after[path][1]}, it was read as {before[path][1]}"
        if before[path] != after[path]:
            return f"{path} was modified"
    for path in before:
        if path not in after:
            return f"{path} is no longer an input"
    return "the input order differs"


def _bytes_per_token(sources, tokenizer, format: str, text_field: str) -> float:
    """Input bytes per framed token on the first 256 KiB of text: what turns ``shard_tokens`` into unit sizes."""
    if isinstance(tokenizer, ByteTokenizer):
        return 1.0
    texts, chars = [], 0
    documents = read_documents([path for path, _ in sources], format=format, text_field=text_field)
    for document in islice(documents, 4096):
        if isinstance(document, str) and document:
            texts.append(document[: _SAMPLE_CHARS - chars])
            chars += len(texts[-1])
            if chars >= _SAMPLE_CHARS:
                break
    tokens = sum(body.size + 2 for body in encode_arrays(tokenizer, texts))
    text_bytes = sum(len(text.encode("utf-8")) for text in texts)
    return round(text_bytes / tokens, 3) if tokens and text_bytes else 1.0


def _finished(out: Path, unit: WorkUnit, digest: str, dtype: np.dtype, verify: bool) -> dict | None:
    """The record of ``unit``'s shard if an earlier run finished it and it is whole (every block with ``verify``)."""
    path = out / f"{unit.name}.json"
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
        if record.get("fingerprint") != digest or record.get("unit") != unit.to_json():
            return None
        shard = TokenShard(out, record, dtype, BLOCK_BYTES)
        if verify:
            shard.tokens.verify()
            shard.index.verify()
    except (CorpusError, ValueError, KeyError, OSError):
        return None
    return record


def _remove_shard(out: Path, name: str) -> None:
    """Delete a shard's files and any partial ``.tmp`` ones a crash left."""
    for path in out.glob(f"{name}.*"):
        path.unlink()


def _shard_record(record: dict) -> ShardRecord:
    return ShardRecord(**{field.name: record[field.name] for field in fields(ShardRecord)})


def _write_manifest(out: Path, identity: dict, shards: list[ShardRecord], plan: dict, sources) -> dict:
    inputs = plan["inputs"]
    prepared = {
        "fingerprint": plan["fingerprint"],
        "format": inputs["format"],
        "text_field": inputs["text_field"],
        "shard_tokens": inputs["shard_tokens"],
        "target_shard_tokens": plan.get("target_shard_tokens"),
        "bytes_per_token": plan["bytes_per_token"],
        "num_input_files": len(inputs["files"]),
        "input_bytes": sum(entry[2] for entry in inputs["files"]),
        "inputs": [str(path) for path, _ in sources][:16],
    }
    # Shards without documents (a unit of empty files) stay on disk for resuming but out of the manifest.
    kept = [shard for shard in shards if shard.documents]
    return write_manifest(out, tokenizer=identity, shards=kept, prepared=prepared)
