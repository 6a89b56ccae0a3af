"""The work units of `colo data prepare`: its inputs cut into deterministic pieces, each tokenized into one shard.

A unit is a list of *segments* read in order; a segment is a whole text file (one document), a byte range of a
JSON Lines file cut at line boundaries, a whole ``.json`` array, or a row range of a Parquet file or of a Hugging
Face dataset saved to disk. `plan_units` cuts the inputs into pieces of about ``target_bytes`` input bytes (Parquet
row groups and small files are kept whole and grouped) and depends on nothing but the inputs and that target, so
the shards are the same whatever the number of workers. `read_unit` streams a unit's documents: reading the units in
order yields exactly the documents `colo.apps.data.read_documents` yields for the inputs.

Only text is read: a record without the text field, or a chat conversation (``messages``, or ``prompt`` with
``response``), is an error naming the file and the line or row.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from .sources import _Fields, _read_jsonl, _read_text, import_parquet, load_hf_dataset

SPLIT = "train"
"""The split read from a saved ``DatasetDict`` (as `read_documents` reads it by default)."""
_READ_BYTES = 4 << 20  # bytes of a JSON Lines file read at a time
_ROWS = 1024  # rows of a Parquet file / Hugging Face dataset read at a time


@dataclass(frozen=True)
class Segment:
    """A piece of one input.

    Attributes:
        kind: ``"text"`` (the whole file), ``"json"`` (a whole JSON array), ``"jsonl"`` (bytes ``[start, stop)``,
            both at line starts), ``"parquet"`` or ``"hf"`` (rows ``[start, stop)``).
        path: the file or the saved dataset's directory.
        start: the first byte or row.
        stop: one past the last byte or row.
        weight: its estimated input bytes (for cutting units and the progress bar).
    """

    kind: str
    path: str
    start: int
    stop: int
    weight: int


@dataclass(frozen=True)
class WorkUnit:
    """The segments tokenized into one shard, ``shard-{number:05d}``."""

    number: int
    segments: tuple[Segment, ...]

    @property
    def name(self) -> str:
        return f"shard-{self.number:05d}"

    @property
    def weight(self) -> int:
        return sum(segment.weight for segment in self.segments)

    def to_json(self) -> dict:
        return {"number": self.number, "segments": [asdict(segment) for segment in self.segments]}

    @classmethod
    def from_json(cls, fields: dict) -> WorkUnit:
        return cls(int(fields["number"]), tuple(Segment(**segment) for segment in fields["segments"]))


def plan_units(sources: Sequence[tuple[Path, str]], *, target_bytes: int, text_field: str = "text") -> list[WorkUnit]:
    """Cut ``sources`` (`colo.apps.data.sources.source_files`) into units of about ``target_bytes`` input bytes.

    Big files are cut (JSON Lines at the first line start after each cut point, Parquet row groups and saved
    datasets by rows); consecutive small pieces are grouped until the next would pass the target. Files are never
    reordered.

    Raises:
        ValueError: a Parquet file or saved dataset without ``text_field`` (its columns named).
    """
    target_bytes = max(1, int(target_bytes))
    units: list[WorkUnit] = []
    current: list[Segment] = []
    weight = 0
    for path, kind in sources:
        for piece in _pieces(Path(path), kind, target_bytes, text_field):
            if current and weight + piece.weight > target_bytes:
                units.append(WorkUnit(len(units), tuple(current)))
                current, weight = [], 0
            current.append(piece)
            weight += piece.weight
    if current:
        units.append(WorkUnit(len(units), tuple(current)))
    return units


def _pieces(path: Path, kind: str, target_bytes: int, text_field: str) -> list[Segment]:
    if kind == "text":
        if path.is_dir():
            raise ValueError(f"{path} is a directory; format='text' reads files")
        size = path.stat().st_size
        return [Segment("text", str(path), 0, size, size)]
    if kind == "jsonl":
        return _jsonl_pieces(path, target_bytes)
    if kind == "parquet":
        return _parquet_pieces(path, target_bytes, text_field)
    if kind == "hf":
        return _hf_pieces(path, target_bytes, text_field)
    raise ValueError(f"{path}: unknown format {kind!r}")


def _jsonl_pieces(path: Path, target_bytes: int) -> list[Segment]:
    if path.is_dir():
        raise ValueError(f"{path} is a directory; format='jsonl' reads files (use format='hf' for a saved dataset)")
    size = path.stat().st_size
    with path.open("rb") as file:
        if path.suffix.lower() == ".json" and file.read(4096).lstrip().startswith(b"["):
            return [Segment("json", str(path), 0, size, size)]
        cuts = [0]
        for piece in range(1, max(1, round(size / target_bytes))):
            cut = _next_line_start(file, piece * size // max(1, round(size / target_bytes)), size)
            if cut > cuts[-1] and cut < size:
                cuts.append(cut)
    cuts.append(size)
    return [Segment("jsonl", str(path), start, stop, stop - start) for start, stop in zip(cuts, cuts[1:])]


def _next_line_start(file, offset: int, size: int) -> int:
    """The first line start at or after byte ``offset``."""
    if offset <= 0:
        return 0
    file.seek(offset - 1)
    position = offset - 1
    while position < size:
        chunk = file.read(1 << 16)
        if not chunk:
            break
        newline = chunk.find(b"\n")
        if newline >= 0:
            return position + newline + 1
        position += len(chunk)
    return size


def _parquet_pieces(path: Path, target_bytes: int, text_field: str) -> list[Segment]:
    if path.is_dir():
        raise ValueError(f"{path} is a directory; format='parquet' reads files (or pass the directory's files)")
    file = import_parquet(path).ParquetFile(path)
    names = file.schema_arrow.names
    _check_column(path, names, text_field, lambda: str(file.schema_arrow.field(text_field).type))
    pieces, row = [], 0
    for group in range(file.metadata.num_row_groups):
        metadata = file.metadata.row_group(group)
        rows = metadata.num_rows
        columns = [metadata.column(index) for index in range(metadata.num_columns)]
        weight = sum(column.total_uncompressed_size for column in columns if column.path_in_schema == text_field)
        weight = weight or metadata.total_byte_size
        parts = max(1, min(rows, math.ceil(weight / target_bytes)))
        for part in range(parts):
            start, stop = row + rows * part // parts, row + rows * (part + 1) // parts
            if stop > start:
                pieces.append(Segment("parquet", str(path), start, stop, weight * (stop - start) // rows))
        row += rows
    return pieces


def _hf_pieces(path: Path, target_bytes: int, text_field: str) -> list[Segment]:
    dataset = load_hf_dataset(path, SPLIT)
    _check_column(path, dataset.column_names, text_field, lambda: str(dataset.features[text_field]))
    rows = dataset.num_rows
    if rows == 0:
        return []
    weight = dataset.data.column(text_field).nbytes
    parts = max(1, min(rows, math.ceil(weight / target_bytes)))
    bounds = [rows * part // parts for part in range(parts + 1)]
    return [
        Segment("hf", str(path), start, stop, weight * (stop - start) // rows)
        for start, stop in zip(bounds, bounds[1:])
        if stop > start
    ]


def _check_column(path: Path, names: Sequence[str], text_field: str, type_of) -> None:
    if text_field not in names:
        chat = " (it looks like chat data: train it with data.task=sft)" if "messages" in names else ""
        raise ValueError(
            f"{path}: no column {text_field!r}{chat}; it has {list(names)}: name the text column with --text-field"
        )
    kind = type_of()
    if "string" not in kind:
        raise ValueError(
            f"{path}: column {text_field!r} holds {kind}, not text; name the text column with --text-field"
        )


def read_unit(unit: WorkUnit, *, text_field: str = "text") -> Iterator[str]:
    """The documents of ``unit``, in order (see the module docstring for what is read and refused)."""
    fields = _Fields(text_field, "messages", "prompt", "response")
    for segment in unit.segments:
        path = Path(segment.path)
        if segment.kind == "text":
            text = _read_text(path)
            if text:
                yield text
        elif segment.kind == "json":
            for document in _read_jsonl(path, fields):
                yield _text_of(document, f"{path}")
        elif segment.kind == "jsonl":
            yield from _read_jsonl_range(path, segment.start, segment.stop, fields)
        elif segment.kind == "parquet":
            yield from _read_parquet_rows(path, segment.start, segment.stop, text_field)
        elif segment.kind == "hf":
            yield from _read_hf_rows(path, segment.start, segment.stop, text_field)
        else:
            raise ValueError(f"{path}: unknown segment kind {segment.kind!r}")


def _text_of(document, where: str) -> str:
    if not isinstance(document, str):
        raise ValueError(
            f"{where}: a chat conversation; colo data prepare makes pre-training corpora from text (name the text "
            "field with --text-field; chat data trains with data.task=sft)"
        )
    return document


def _read_jsonl_range(path: Path, start: int, stop: int, fields: _Fields) -> Iterator[str]:
    """Lines ``[start, stop)`` of a JSON Lines file, decoded and split as text mode does (UTF-8 with U+FFFD for bad
    bytes, universal newlines), one JSON record a line."""
    text_field, messages, prompt, response = fields.text, fields.messages, fields.prompt, fields.response
    loads = json.loads
    with path.open("rb") as file:
        file.seek(start)
        remaining, carry, block_start = stop - start, b"", start
        while True:
            chunk = file.read(min(_READ_BYTES, remaining)) if remaining > 0 else b""
            remaining -= len(chunk)
            final = remaining <= 0 or not chunk
            data = carry + chunk
            if not data:
                return
            cut = len(data) if final else data.rfind(b"\n") + 1
            if cut == 0:  # a line longer than one read: read on
                carry = data
                continue
            block, carry = data[:cut], data[cut:]
            text = block.decode("utf-8", errors="replace")
            if "\r" in text:
                text = text.replace("\r\n", "\n").replace("\r", "\n")
            for number, line in enumerate(text.split("\n")):
                if not line or line.isspace():
                    continue
                try:
                    record = loads(line)
                except json.JSONDecodeError as error:
                    raise ValueError(
                        f"{_where(path, block_start, number)}: not valid JSON ({error.msg}); JSON Lines hold one JSON "
                        "object per line (fix the line, or read the file with --format text)"
                    ) from None
                if type(record) is dict and messages not in record and not (prompt in record and response in record):
                    value = record.get(text_field)
                    if type(value) is str:
                        yield value
                        continue
                where = _where(path, block_start, number)
                yield _text_of(fields.document(record, where), where)
            block_start += cut
            if final:
                return


def _where(path: Path, block_start: int, line_in_block: int) -> str:
    """``"<path> line N"`` for a line of a block starting at byte ``block_start`` (counted only for an error)."""
    with path.open("rb") as file:
        before = file.read(block_start).decode("utf-8", errors="replace")
    lines_before = before.replace("\r\n", "\n").replace("\r", "\n").count("\n")
    return f"{path} line {lines_before + line_in_block + 1}"


def _read_parquet_rows(path: Path, start: int, stop: int, text_field: str) -> Iterator[str]:
    file = import_parquet(path).ParquetFile(path)
    groups, first_row, row = [], None, 0
    for group in range(file.metadata.num_row_groups):
        rows = file.metadata.row_group(group).num_rows
        if row < stop and row + rows > start:
            groups.append(group)
            first_row = row if first_row is None else first_row
        row += rows
    if not groups:
        return
    row = first_row
    for batch in file.iter_batches(batch_size=_ROWS, row_groups=groups, columns=[text_field]):
        begin, end = max(start - row, 0), min(stop - row, batch.num_rows)
        if end > begin:
            yield from _checked_texts(
                batch.column(0).slice(begin, end - begin).to_pylist(), path, row + begin, text_field
            )
        row += batch.num_rows
        if row >= stop:
            return


def _read_hf_rows(path: Path, start: int, stop: int, text_field: str) -> Iterator[str]:
    rows = load_hf_dataset(path, SPLIT).with_format(None).select_columns([text_field]).select(range(start, stop))
    row = start
    for batch in rows.iter(batch_size=_ROWS):
        texts = batch[text_field]
        yield from _checked_texts(texts, path, row, text_field)
        row += len(texts)


def _checked_texts(texts: list, path: Path, first_row: int, text_field: str) -> list[str]:
    for offset, text in enumerate(texts):
        if type(text) is not str:
            raise ValueError(
                f"{path} row {first_row + offset}: field {text_field!r} must be a string, got {type(text).__name__}"
            )
    return texts
