"""``colo data``: prepare a pre-training corpus once (tokenized, sharded, checksummed) and inspect one."""

from __future__ import annotations

import json
import sys
import time
from typing import Annotated

import numpy as np
import typer

data_app = typer.Typer(
    name="data",
    help="Prepare pre-training corpora (tokenized shards every run maps) and inspect them.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

_INPUT_ERRORS = (ValueError, OSError, ImportError, TypeError)  # CorpusError is a ValueError


def _fail(error: Exception):
    typer.echo(f"colo: {error}", err=True)
    raise typer.Exit(2) from None


@data_app.command()
def prepare(
    inputs: Annotated[
        list[str], typer.Argument(help="Files, directories or globs: text, JSON Lines, Parquet, saved HF datasets.")
    ],
    out: Annotated[str, typer.Option("--out", "-o", help="The corpus directory to write.")],
    tokenizer: Annotated[
        str | None, typer.Option(help="A Hugging Face tokenizer.json (or its directory); default: the byte tokenizer.")
    ] = None,
    format: Annotated[str, typer.Option(help="auto, text, jsonl, parquet or hf (auto: by suffix).")] = "auto",
    text_field: Annotated[str, typer.Option(help="The record field / column holding the text.")] = "text",
    workers: Annotated[int | None, typer.Option(help="Tokenizing processes (default: one per CPU).")] = None,
    shard_tokens: Annotated[
        int | None,
        typer.Option(
            help="About how many tokens a shard holds (default: 16.8M, less to make 64 shards of a small corpus)."
        ),
    ] = None,
    overwrite: Annotated[bool, typer.Option(help="Replace a corpus already at --out.")] = False,
    verify: Annotated[
        bool, typer.Option(help="On a rerun, check every block of the kept shards and rewrite damaged ones.")
    ] = False,
    progress: Annotated[
        bool | None, typer.Option("--progress/--no-progress", help="Progress bar on stderr (default: on a terminal).")
    ] = None,
) -> None:
    """Tokenize INPUT... into a prepared corpus at --out: raw token shards, a document index, per-block CRC-32s.

    The output is the same whatever --workers; a crashed run resumes where it stopped and a rerun on unchanged
    inputs does nothing. Train on it with data.paths: [DIR] (or several in data.blend). Exit 2 on bad input (one
    colo: line).
    """
    from ..data.prepare import prepare_corpus

    started = time.perf_counter()
    try:
        manifest = prepare_corpus(
            inputs,
            out,
            tokenizer=tokenizer,
            format=format,
            text_field=text_field,
            workers=workers,
            shard_tokens=shard_tokens,
            overwrite=overwrite,
            verify=verify,
            progress=sys.stderr.isatty() if progress is None else progress,
        )
    except _INPUT_ERRORS as error:
        _fail(error)
    seconds = time.perf_counter() - started
    summary = (
        f"{out}: {manifest['num_tokens']:,} tokens in {manifest['num_documents']:,} documents, "
        f"{len(manifest['shards'])} shards ({np.dtype(manifest['dtype']).name})"
    )
    if manifest["shards_written"] == 0:
        typer.echo(f"{summary}; already prepared from these inputs, nothing to do")
    else:
        typer.echo(
            f"{summary}; wrote {manifest['shards_written']} shards in {seconds:.1f} s "
            f"({manifest['num_tokens'] / max(seconds, 1e-9):,.0f} tokens/s overall)"
        )


@data_app.command()
def inspect(
    directory: Annotated[str, typer.Argument(help="A prepared corpus directory.")],
    verify: Annotated[bool, typer.Option(help="Check every block of every shard against its CRC-32.")] = False,
    samples: Annotated[int, typer.Option(help="Documents to decode, spread over the corpus.")] = 3,
    tokenizer: Annotated[
        str | None, typer.Option(help="The tokenizer.json to decode with (default: the one the manifest names).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the description as JSON.")] = False,
) -> None:
    """Describe a prepared corpus: tokens, documents, dtype, tokenizer, document lengths, decoded samples.

    Exit 2 when it is not a corpus, was made with another --tokenizer, or (--verify) a shard is damaged.
    """
    from ..data.describe import describe_corpus

    try:
        description = describe_corpus(directory, samples=samples, verify=verify, tokenizer=tokenizer)
    except _INPUT_ERRORS as error:
        _fail(error)
    if as_json:
        typer.echo(json.dumps(description, indent=1, ensure_ascii=False))
        return
    typer.echo(_as_text(description))


def _as_text(description: dict) -> str:
    tokenizer = description["tokenizer"]
    lines = [
        f"corpus      {description['path']}",
        f"tokens      {description['tokens']:,} in {description['documents']:,} documents, "
        f"{description['shards']} shards ({description['dtype']}, {_size(description['bytes'])})",
        f"tokenizer   {tokenizer['name']} ({tokenizer['kind']}, {tokenizer['vocab_size']:,} ids, "
        f"bos {tokenizer['bos_id']}, eos {tokenizer['eos_id']}, sha256 {tokenizer['sha256'][:12]})",
    ]
    prepared = description.get("prepared")
    if prepared:
        lines.append(
            f"prepared    from {prepared['num_input_files']:,} input files ({_size(prepared['input_bytes'])}), "
            f"format {prepared['format']}, text field {prepared['text_field']!r}, "
            f"shards of ~{prepared.get('target_shard_tokens') or 0:,} tokens"
        )
    lengths = description["document_tokens"]
    lines.append(
        f"documents   tokens each (bos and eos included): min {lengths['min']:,}, mean {lengths['mean']:,}, "
        f"max {lengths['max']:,}"
    )
    widest = max((bucket["documents"] for bucket in description["histogram"]), default=1)
    for bucket in description["histogram"]:
        bar = "#" * max(1 if bucket["documents"] else 0, round(40 * bucket["documents"] / widest))
        lines.append(f"  [{bucket['from']:>9,}, {bucket['to']:>11,})  {bucket['documents']:>12,}  {bar}")
    lines.append(
        "checksums   every block verified"
        if description["verified"]
        else "checksums   checked when read (--verify checks every block now)"
    )
    for sample in description["samples"]:
        lines.append(f"document {sample['document']:,} ({sample['tokens']:,} tokens), its start:")
        if sample["text"] is None:
            lines.append("    (the tokenizer that made it is not at its recorded path; pass --tokenizer to decode)")
            continue
        lines += [f"    | {line}" for line in sample["text"].split("\n")]
    return "\n".join(lines)


def _size(count: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if count < 1024 or unit == "GiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} TiB"
