"""Where documents come from: text files, JSON Lines, Parquet, Hugging Face datasets on disk, and the default corpus.

A *document* is either a string (pre-training text) or a conversation: a list of ``{"role": ..., "content": ...}``
messages (for `colo.apps.data.SFTDataset`). `read_documents` yields them in a deterministic order, so every rank
and every restart sees the same corpus.
"""

from __future__ import annotations

import glob
import json
import os
import sysconfig
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

Message = dict[str, str]
Document = str | list[Message]

FORMATS = ("auto", "text", "jsonl", "hf", "parquet")
_JSONL_SUFFIXES = (".jsonl", ".ndjson", ".json")
_PARQUET_SUFFIXES = (".parquet",)
_HF_MARKERS = ("dataset_info.json", "dataset_dict.json", "state.json")
_SKIPPED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}
NOT_TEXT_FRACTION = 0.2
"""The share of a text file's characters that may be undecodable (U+FFFD after UTF-8 decoding, e.g. a Latin-1
file's accented letters) before it is refused as not text."""
_SNIFF_BYTES = 64 * 1024
"""How much of each data file `data_files_problem` reads."""


def read_documents(
    paths: str | os.PathLike | Sequence[str | os.PathLike],
    *,
    format: Literal["auto", "text", "jsonl", "hf", "parquet"] = "auto",
    text_field: str = "text",
    messages_field: str = "messages",
    prompt_field: str = "prompt",
    response_field: str = "response",
    split: str = "train",
) -> Iterator[Document]:
    """Yield the documents of ``paths`` in a deterministic order.

    Each entry of ``paths`` is a file, a directory (every file under it, sorted, or a saved Hugging Face dataset)
    or a glob pattern (``data/*.txt``, ``corpus/**/*.md``; matches sorted). Entries are read in the order given.

    Formats (``"auto"`` picks per file: ``.jsonl``/``.ndjson``/``.json`` are JSON, ``.parquet`` is Parquet, a
    directory holding ``dataset_info.json``/``dataset_dict.json``/``state.json`` is a Hugging Face dataset, anything
    else is text):

    - ``"text"``: one document per file, the whole file (UTF-8; undecodable bytes become U+FFFD). Empty files are
      skipped; a file that is not text (NUL bytes, or more than `NOT_TEXT_FRACTION` of it undecodable) is an error
      naming it, not trained on as replacement characters.
    - ``"jsonl"``: one record per line (blank lines skipped); a ``.json`` file holding one JSON array is read as its
      records. A record with ``messages_field`` yields that conversation; one with ``prompt_field`` and
      ``response_field`` yields ``[{"role": "user", ...}, {"role": "assistant", ...}]``; one with ``text_field``
      yields that string.
    - ``"hf"``: a dataset saved with ``datasets.Dataset.save_to_disk`` (rows read as JSONL records); a
      ``DatasetDict`` is read at ``split``. Needs ``pip install 'colo-apps[data]'``.
    - ``"parquet"``: a Parquet file's rows read as JSONL records, in row order. Needs ``pip install 'colo-apps[data]'``.

    Args:
        paths (str | os.PathLike | Sequence[str | os.PathLike]): files, directories or glob patterns.
        format (str): ``"auto"``, ``"text"``, ``"jsonl"``, ``"hf"`` or ``"parquet"``. Default: ``"auto"``.
        text_field (str): the field holding a record's text. Default: ``"text"``.
        messages_field (str): the field holding a record's chat messages. Default: ``"messages"``.
        prompt_field (str): the prompt field of a prompt/response record. Default: ``"prompt"``.
        response_field (str): the response field of a prompt/response record. Default: ``"response"``.
        split (str): the split of a saved ``DatasetDict``. Default: ``"train"``.

    Yields:
        str | list[dict[str, str]]: a text, or a conversation.

    Raises:
        FileNotFoundError: a path does not exist, or a glob matches nothing.
        ValueError: an unknown format, a file read as text that is not text, a line that is not JSON, a record
            without the fields (each message names the file, the line and the fix).
        ImportError: a Hugging Face dataset without the ``datasets`` package, a Parquet file without ``pyarrow``.
    """
    if format not in FORMATS:
        raise ValueError(f"format={format!r} is not one of {FORMATS}")
    fields = _Fields(text_field, messages_field, prompt_field, response_field)
    entries = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    if not entries:
        raise ValueError("read_documents got no paths; pass files, directories or glob patterns")
    for entry in entries:
        for path in _expand(entry, format):
            kind = format if format != "auto" else _detect(path)
            if kind == "hf":
                yield from _read_hf(path, fields, split)
            elif kind == "jsonl":
                yield from _read_jsonl(path, fields)
            elif kind == "parquet":
                yield from _read_parquet(path, fields)
            else:
                text = _read_text(path)
                if text:
                    yield text


def default_corpus() -> list[Path]:
    """The Python standard library's own ``.py`` files, sorted: text every Python install carries.

    Skips ``site-packages``/``dist-packages`` (installed packages, which differ between machines) and test
    directories (``test``, ``tests``, ``idle_test``). About 12 MB of source on CPython 3.11. The list is the same on
    every run of the same Python; different Python versions carry different files.

    Returns:
        list[Path]: the files, sorted by their path relative to the standard library.

    Raises:
        FileNotFoundError: this Python ships no standard library source (some embedded builds ship only
            bytecode); pass data paths instead.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for file in root.rglob("*.py"):
        relative = file.relative_to(root)
        if not _SKIPPED_DIRS.intersection(relative.parts[:-1]) and file.is_file():
            files.append((relative.as_posix(), file))
    if not files:
        raise FileNotFoundError(
            f"no standard-library .py sources under {root} (this Python ships bytecode only); pass data paths"
        )
    return [file for _, file in sorted(files)]


class _Fields:
    """The record field names `read_documents` looks for."""

    def __init__(self, text: str, messages: str, prompt: str, response: str) -> None:
        self.text, self.messages, self.prompt, self.response = text, messages, prompt, response

    def document(self, record: Any, where: str) -> Document:
        """The document of one JSON record; ``where`` names it in errors (``"data.jsonl line 3"``)."""
        if not isinstance(record, Mapping):
            raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
        if self.messages in record and record[self.messages] is not None:
            return validate_messages(record[self.messages], where=f"{where}, field {self.messages!r}")
        if self.prompt in record and self.response in record:
            for field in (self.prompt, self.response):
                if not isinstance(record[field], str):
                    raise ValueError(f"{where}: field {field!r} must be a string, got {type(record[field]).__name__}")
            return [
                {"role": "user", "content": record[self.prompt]},
                {"role": "assistant", "content": record[self.response]},
            ]
        if self.text in record:
            text = record[self.text]
            if not isinstance(text, str):
                raise ValueError(f"{where}: field {self.text!r} must be a string, got {type(text).__name__}")
            return text
        raise ValueError(
            f"{where}: the record has none of the fields {self.text!r}, {self.messages!r}, or {self.prompt!r} and "
            f"{self.response!r} (it has {sorted(record)}); name its field with text_field=/messages_field= "
            "(data.text_field / data.messages_field in a run config)"
        )


def validate_messages(messages: Any, *, where: str = "conversation") -> list[Message]:
    """Check that ``messages`` is a list of ``{"role": str, "content": str}`` and return it as plain dicts.

    Raises:
        ValueError: naming ``where`` and the message index at fault.
    """
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: chat messages must be a non-empty list of {{'role': ..., 'content': ...}}")
    checked = []
    for index, message in enumerate(messages):
        if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
            raise ValueError(f"{where}: message {index} needs a string 'role' (e.g. 'user', 'assistant')")
        if not isinstance(message.get("content"), str):
            raise ValueError(f"{where}: message {index} needs a string 'content'")
        checked.append({"role": message["role"], "content": message["content"]})
    return checked


def _expand(entry: str | os.PathLike, format: str) -> list[Path]:
    """The files (or dataset directories) one ``paths`` entry names, sorted."""
    path = Path(entry)
    if path.is_file():
        return [path]
    if path.is_dir():
        if format == "hf" or (format == "auto" and _is_hf_dataset(path)):
            return [path]
        files = sorted((p for p in path.rglob("*") if p.is_file()), key=lambda p: p.relative_to(path).as_posix())
        if not files:
            raise FileNotFoundError(f"directory {path} holds no files; point data paths at files holding text")
        return files
    pattern = os.fspath(entry)
    if glob.has_magic(pattern):
        matches = sorted(Path(m) for m in glob.glob(pattern, recursive=True))
        files = [m for m in matches if m.is_file() or (format != "text" and _is_hf_dataset(m))]
        if not files:
            raise FileNotFoundError(f"the pattern {pattern!r} matches no files; check the data paths")
        return files
    raise FileNotFoundError(f"data path {pattern!r} does not exist; check the data paths (files, directories or globs)")


def _is_hf_dataset(path: Path) -> bool:
    return path.is_dir() and any((path / marker).is_file() for marker in _HF_MARKERS)


def _detect(path: Path) -> str:
    if _is_hf_dataset(path):
        return "hf"
    if path.suffix.lower() in _PARQUET_SUFFIXES:
        return "parquet"
    return "jsonl" if path.suffix.lower() in _JSONL_SUFFIXES else "text"


def source_files(
    paths: str | os.PathLike | Sequence[str | os.PathLike], *, format: str = "auto"
) -> list[tuple[Path, str]]:
    """The files (and saved dataset directories) `read_documents` reads for ``paths``, in its order, each with the
    format it is read as (``"text"``, ``"jsonl"``, ``"hf"`` or ``"parquet"``).

    Raises:
        FileNotFoundError: a path does not exist, or a glob matches nothing.
        ValueError: an unknown format, or no paths.
    """
    if format not in FORMATS:
        raise ValueError(f"format={format!r} is not one of {FORMATS}")
    entries = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    if not entries:
        raise ValueError("no data paths given; pass files, directories or glob patterns")
    return [
        (path, format if format != "auto" else _detect(path)) for entry in entries for path in _expand(entry, format)
    ]


def _read_text(path: Path) -> str:
    if path.is_dir():
        raise ValueError(f"{path} is a directory; format='text' reads files")
    raw = path.read_bytes()
    text = raw.decode("utf-8", errors="replace")
    problem = _not_text(raw, text)
    if problem is not None:
        raise ValueError(f"{path} {problem}")
    return text


def _not_text(raw: bytes, text: str) -> str | None:
    """Why these bytes are not text to train on (NUL bytes, mostly undecodable), with the fix; ``None`` if text."""
    if b"\0" in raw:
        why = "holds NUL bytes"
    elif text and text.count("\ufffd") > NOT_TEXT_FRACTION * len(text):
        why = f"is mostly not UTF-8 ({text.count(chr(0xFFFD)) / len(text):.0%} of it undecodable)"
    else:
        return None
    return (
        f"is not a text file: it {why}; data paths take UTF-8 text, JSON Lines or a saved Hugging Face dataset: "
        "leave it out of the data paths, or convert it to UTF-8 text"
    )


def data_files_problem(paths: str | os.PathLike | Sequence[str | os.PathLike], *, format: str = "auto") -> str | None:
    """What a look at the files of ``paths`` shows would stop `read_documents`, or ``None``: a file read as text
    that is not text (from its first 64 KiB), or files that hold no bytes at all. For the checks before a run
    starts (``colo train`` reports it in one line, where the run would fail inside every rank).

    Raises:
        FileNotFoundError: a path does not exist, or a glob matches nothing.
    """
    entries = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    files = []
    for entry in entries:
        for path in _expand(entry, format):
            kind = format if format != "auto" else _detect(path)
            if kind in ("hf", "parquet") or path.is_dir():
                return None  # a saved dataset or a Parquet file: their readers check the rows
            files.append(path)
            if kind == "text":
                with path.open("rb") as file:
                    head = file.read(_SNIFF_BYTES)
                problem = _not_text(head, head.decode("utf-8", errors="replace"))
                if problem is not None:
                    return f"{path} {problem}"
    if files and all(path.stat().st_size == 0 for path in files):
        named = str(files[0]) if len(files) == 1 else f"{files[0]} and the other {len(files) - 1} files"
        return f"{named}: empty, no data to train on; point data paths at files holding text"
    return None


def _read_jsonl(path: Path, fields: _Fields) -> Iterator[Document]:
    if path.is_dir():
        raise ValueError(f"{path} is a directory; format='jsonl' reads files (use format='hf' for a saved dataset)")
    if path.suffix.lower() == ".json":  # a JSON array of records, or JSON Lines under a .json name
        text = path.read_text(encoding="utf-8", errors="replace")
        if text.lstrip().startswith("["):
            try:
                records = json.loads(text)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}: not valid JSON ({error}); fix the file or write it as JSON Lines") from None
            for index, record in enumerate(records):
                yield fields.document(record, f"{path} record {index}")
            return
    with path.open(encoding="utf-8", errors="replace") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(
                    f"{path} line {number}: not valid JSON ({error.msg}); JSON Lines hold one JSON object per line "
                    "(fix the line, or read the file with format='text')"
                ) from None
            yield fields.document(record, f"{path} line {number}")


def load_hf_dataset(path: Path, split: str):
    """The dataset saved at ``path`` (``save_to_disk``); a ``DatasetDict``'s ``split``."""
    try:
        import datasets
    except ImportError:
        raise ImportError(
            f"{path} is a Hugging Face dataset; reading it needs the `datasets` package: pip install 'colo-apps[data]'"
        ) from None
    dataset = datasets.load_from_disk(str(path))
    if isinstance(dataset, datasets.DatasetDict):
        if split not in dataset:
            raise ValueError(f"{path}: no split {split!r}; it has {sorted(dataset)}; pass split= one of them")
        dataset = dataset[split]
    return dataset


def _read_hf(path: Path, fields: _Fields, split: str) -> Iterator[Document]:
    for index, record in enumerate(load_hf_dataset(path, split)):
        yield fields.document(record, f"{path} row {index}")


def _read_parquet(path: Path, fields: _Fields) -> Iterator[Document]:
    if path.is_dir():
        raise ValueError(f"{path} is a directory; format='parquet' reads files (or pass the directory's files)")
    parquet = import_parquet(path)
    file = parquet.ParquetFile(path)
    wanted = (fields.text, fields.messages, fields.prompt, fields.response)
    columns = [name for name in file.schema_arrow.names if name in wanted] or None
    row = 0
    for batch in file.iter_batches(batch_size=1024, columns=columns):
        for record in batch.to_pylist():
            yield fields.document(record, f"{path} row {row}")
            row += 1


def import_parquet(path: Path):
    """``pyarrow.parquet``, or an ImportError naming ``path`` and the fix."""
    try:
        import pyarrow.parquet as parquet
    except ImportError:
        raise ImportError(
            f"{path} is a Parquet file; reading it needs the `pyarrow` package: pip install 'colo-apps[data]'"
        ) from None
    return parquet
