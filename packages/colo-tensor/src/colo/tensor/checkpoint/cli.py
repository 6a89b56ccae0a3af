"""The checkpoint command line: ``python -m colo.tensor.checkpoint {info,verify,export} ...``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from .export import export_hf
from .index import CheckpointError, CheckpointFormatError, CheckpointIndex, TensorEntry, read_index
from .integrity import verify_checkpoint

_METADATA_CHARS = 2000
"""How much of the metadata ``info`` prints (``--json`` prints all of it)."""


def _layout(entry: TensorEntry) -> str:
    """How a tensor is split: ``whole``, ``4 flat ranges``, ``4 rectangles (2x2 grid)``, or a mix."""
    flat = [p for p in entry.pieces if p.flat_range is not None]
    rects = {(p.offsets, p.shape) for p in entry.pieces}
    if len(entry.pieces) == 1 and not flat and entry.pieces[0].shape == entry.shape:
        return "whole"
    grid = "x".join(str(len({offsets[d] for offsets, _ in rects})) for d in range(len(entry.shape)))
    if not flat:
        return f"{len(entry.pieces)} rectangles ({grid} grid)"
    if rects == {((0,) * len(entry.shape), entry.shape)}:
        return f"{len(flat)} flat ranges"
    kinds = (
        f"{len(entry.pieces) - len(flat)} rectangles + {len(flat)} flat ranges"
        if len(flat) < len(entry.pieces)
        else f"{len(flat)} flat ranges"
    )
    return f"{kinds} of {len(rects)} rectangles ({grid} grid)"


def summarize(path: str, index: CheckpointIndex) -> dict:
    """The JSON summary ``info --json`` prints: metadata, files, and every tensor's shape, dtype and pieces."""
    files: dict[str, dict] = {}
    tensors = {}
    for name, entry in index.tensors.items():
        for piece in entry.pieces:
            info = files.setdefault(piece.file, {"pieces": 0, "bytes": None})
            info["pieces"] += 1
        tensors[name] = {
            "shape": list(entry.shape),
            "dtype": str(entry.dtype).removeprefix("torch."),
            "bytes": entry.numel * entry.dtype.itemsize,
            "pieces": len(entry.pieces),
            "layout": _layout(entry),
        }
    for file, info in files.items():
        full = os.path.join(path, file)
        info["bytes"] = os.path.getsize(full) if os.path.exists(full) else None
    pieces = [p for e in index.tensors.values() for p in e.pieces]
    return {
        "path": path,
        "metadata": index.metadata,
        "num_tensors": len(tensors),
        "num_pieces": len(pieces),
        "num_flat_pieces": sum(p.flat_range is not None for p in pieces),
        "tensor_bytes": sum(t["bytes"] for t in tensors.values()),
        "files": dict(sorted(files.items())),
        "tensors": tensors,
    }


def _size(num_bytes: int | None) -> str:
    if num_bytes is None:
        return "missing"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if num_bytes >= scale:
            return f"{num_bytes / scale:.2f} {unit}"
    return f"{num_bytes} B"


def _print_info(summary: dict) -> None:
    metadata = json.dumps(summary["metadata"], sort_keys=True)
    if len(metadata) > _METADATA_CHARS:
        metadata = metadata[:_METADATA_CHARS] + f"... ({len(metadata)} characters; --json prints all)"
    print(f"checkpoint {summary['path']}")
    print(f"metadata   {metadata}")
    print(
        f"contents   {summary['num_tensors']} tensors ({_size(summary['tensor_bytes'])}) in "
        f"{summary['num_pieces']} pieces ({summary['num_flat_pieces']} flat ranges) "
        f"across {len(summary['files'])} files"
    )
    for file, info in summary["files"].items():
        print(f"  {file}  {_size(info['bytes'])}, {info['pieces']} pieces")
    rows = [
        (name, "x".join(map(str, t["shape"])) or "scalar", t["dtype"], t["layout"])
        for name, t in summary["tensors"].items()
    ]
    widths = [max([len(header)] + [len(row[i]) for row in rows]) for i, header in enumerate(("name", "shape", "dtype"))]
    print(f"{'name':<{widths[0]}}  {'shape':<{widths[1]}}  {'dtype':<{widths[2]}}  layout")
    for name, shape, dtype, layout in rows:
        print(f"{name:<{widths[0]}}  {shape:<{widths[1]}}  {dtype:<{widths[2]}}  {layout}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m colo.tensor.checkpoint", description="Inspect, verify and export colo sharded checkpoints."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    info = commands.add_parser("info", help="print the tensors, shapes, dtypes, pieces and metadata")
    info.add_argument("checkpoint", help="a committed checkpoint directory")
    info.add_argument("--json", action="store_true", help="print the summary as JSON")
    verify = commands.add_parser(
        "verify",
        help="re-read every piece, checking the index's schema, sizes, CRCs and coverage (exit 1 if damaged, 2 if "
        "malformed)",
    )
    verify.add_argument("checkpoint", help="a committed checkpoint directory")
    export = commands.add_parser("export", help="write Hugging Face-style consolidated safetensors")
    export.add_argument("checkpoint", help="a committed checkpoint directory")
    export.add_argument("out_dir", help="where to write model.safetensors (or shards and an index)")
    export.add_argument("--max-shard-size", default="5GB", help="most bytes per file, e.g. 5GB or 500MiB")
    export.add_argument("--dtype", default=None, help="convert floating-point tensors, e.g. bfloat16")
    export.add_argument("--include", action="append", default=None, help="glob of tensors to export (repeatable)")
    export.add_argument(
        "--exclude", action="append", default=None, help="glob of tensors to leave out (repeatable; default optim/*)"
    )
    export.add_argument("--overwrite", action="store_true", help="replace an earlier export in out_dir")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit status: 0 ok, 1 a failed check or a damaged checkpoint (a CRC, a
    truncated file, incomplete coverage), 2 bad usage or a checkpoint whose index or file header does not follow the
    format (a missing or malformed field; the line printed names the file, the tensor and the field)."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "info":
            summary = summarize(args.checkpoint, read_index(args.checkpoint))
            if args.json:
                print(json.dumps(summary, indent=1))
            else:
                _print_info(summary)
        elif args.command == "verify":
            report = verify_checkpoint(args.checkpoint)
            print(
                f"ok: {args.checkpoint}: {report.num_tensors} tensors, {report.num_pieces} pieces, "
                f"{report.num_elements} elements checked"
            )
        else:
            exclude = tuple(args.exclude) if args.exclude is not None else ("optim/*",)
            report = export_hf(
                args.checkpoint,
                args.out_dir,
                max_shard_bytes=args.max_shard_size,
                dtype=args.dtype,
                include=args.include,
                exclude=exclude,
                overwrite=args.overwrite,
            )
            for file in report.files + ((report.index_file,) if report.index_file else ()):
                print(file)
            print(f"exported {report.num_tensors} tensors ({_size(report.total_bytes)}) to {args.out_dir}")
    except CheckpointFormatError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    except (CheckpointError, FileExistsError, ValueError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0
