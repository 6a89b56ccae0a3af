#!/usr/bin/env python3
"""The prepared-corpus loader at scale: trainer start-up and memory on a 2B-token corpus vs a 20M-token one, and the
loader's sustained tokens/s on ``llama-1b``'s batch shape vs what one GPU consumes (issue 42, "Measure").

The corpora (under ``--work``, reused when present):

- ``small``: about ``--small-tokens`` tokens (20M) of the Python standard library's sources
  (`colo.apps.data.default_corpus`, one document per file, as many copies as needed) written as JSON Lines and
  prepared by ``colo data prepare --workers 2`` with the byte tokenizer (its default layout: 64 shards);
- ``large``: at least ``--large-tokens`` tokens (2B), the layout ``colo data prepare`` writes for such a corpus
  (shards of at most 16.8M tokens): the same text prepared with ``--shard-tokens 16777216`` (2 shards), whose shard
  files are then *copied* (distinct pages, so the page cache can be emptied of them) under new shard names as many
  times as it takes, with a manifest listing them all (`shards.write_manifest` / `ShardRecord`, counts and CRC-file
  checksums from the copied shards);
- ``many``: the same number of tokens made of ``small``'s shards (20 here) hard-linked 100 times (2,000 shards;
  its pages are ``small``'s): how start-up grows with the number of shards (fixed packing only).

Start-up: the real trainer, ``colo train --preset tiny-llama`` on each corpus (``data.blend: [{path, weight: 1}]``,
``data.seq_len=512`` (``--startup-seq-len``; the tiny model's eager CPU attention takes ~30 s a step at 2048), 2 rows
per step, ``schedule.total_steps=1``, checkpoints, eval, samples and
TensorBoard off), a fresh process each time, corpora interleaved in each round: seconds from launch to the data
built (the run's ``colo train:`` header, printed after ``build_data``) and to the first step's metrics.jsonl record
(its ``time``), and the process's peak RSS (``os.wait4``'s ``ru_maxrss``). ``packing: fixed`` and ``packing:
documents``; for documents the row index is computed on the first run (cold: the corpus's ``cache/`` emptied first)
and mapped on the later ones (warm); the ``llama-1b`` (seq_len 2048) index is also built once by the loader below.

Loader: in a fresh process per measurement, the objects the trainer builds (`build_dataset` + `build_data` with the
``llama-1b`` run config: ``seq_len`` 2048, at ``num_replicas`` such that a rank's batch is ``--batch-rows`` rows,
8 by default, the per-GPU batch of the 70k tokens/s H200 figure in BENCHMARKS.md), then `RunData.train_batches`
(sampler -> rows -> collate -> token-id check) for ``--batches`` batches from a random global position: tokens/s,
compared with ``--gpu-tokens-per-s`` (70k) x 10. Each corpus is measured with its files evicted from the page cache
first (``posix_fadvise(DONTNEED)`` after ``fsync``; ``fincore`` reports what stayed) and again with them cached
(read whole first); each run then reads the same batches again in the same process (pages cached, every 1 MiB
block already CRC-checked: what the first pass pays for the check on first touch), and reports its resident memory
split into anonymous and file-backed (mapped shard pages).

    .venv/bin/python benchmarks/data_loader.py --out benchmarks/results/data_loader_cpu.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COLO = Path(sys.executable).with_name("colo")
LARGE_SHARD_TOKENS = 1 << 24  # colo data prepare's default cap per shard


# --- corpora --------------------------------------------------------------------------------------------------------


def _write_text(path: Path, target_tokens: int) -> None:
    """JSON Lines of standard-library files, repeated until the byte tokenizer gives ``target_tokens`` tokens."""
    from colo.apps.data import default_corpus

    files = default_corpus()
    tokens = 0
    with open(path.with_suffix(".tmp"), "w", encoding="utf-8") as out:
        for _copy in range(1000):
            for file in files:
                text = file.read_text(encoding="utf-8", errors="replace")
                out.write(json.dumps({"text": text}) + "\n")
                tokens += len(text.encode()) + 2  # bytes + bos/eos
                if tokens >= target_tokens:
                    break
            if tokens >= target_tokens:
                break
    path.with_suffix(".tmp").rename(path)


def _prepare(source: Path, out: Path, *extra: str) -> dict:
    if not (out / "manifest.json").is_file():
        command = [str(COLO), "data", "prepare", str(source), "--out", str(out), "--workers", "2", "--no-progress"]
        subprocess.run([*command, *extra], check=True)
    return json.loads((out / "manifest.json").read_text())


def _replicate(source: Path, out: Path, target_tokens: int, *, link: bool) -> dict:
    """A corpus of ``source``'s shards repeated (copied, or hard-linked with ``link``) to at least ``target_tokens``."""
    from colo.apps.data.shards import ShardRecord, write_manifest

    if (out / "manifest.json").is_file():
        return json.loads((out / "manifest.json").read_text())
    manifest = json.loads((source / "manifest.json").read_text())
    copies = math.ceil(target_tokens / manifest["num_tokens"])
    out.mkdir(parents=True, exist_ok=True)
    records = []
    for _copy in range(copies):
        for shard in manifest["shards"]:
            name = f"shard-{len(records):05d}"
            for suffix in (".tokens", ".index", ".tokens.crc32", ".index.crc32"):
                target = out / f"{name}{suffix}"
                target.unlink(missing_ok=True)
                if link:
                    os.link(source / f"{shard['name']}{suffix}", target)
                else:
                    shutil.copyfile(source / f"{shard['name']}{suffix}", target)
            records.append(ShardRecord(**{**shard, "name": name}))
    extra = {key: manifest[key] for key in ("inputs",) if key in manifest}
    return write_manifest(out, tokenizer=manifest["tokenizer"], shards=records, replicated_from=str(source), **extra)


def _corpus_files(corpus: Path) -> list[Path]:
    return sorted(path for path in corpus.iterdir() if path.suffix in (".tokens", ".index"))


def _evict(corpus: Path) -> None:
    """Drop the corpus's shard files from the page cache (clean pages of files nobody maps)."""
    for path in _corpus_files(corpus):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _read_all(corpus: Path) -> None:
    """Bring the corpus's shard files into the page cache (a sequential read)."""
    for path in _corpus_files(corpus):
        with open(path, "rb") as file:
            while file.read(16 << 20):
                pass


def _cached_fraction(corpus: Path) -> float | None:
    """Fraction of the shard files' bytes in the page cache (util-linux ``fincore``), or None without it."""
    files = [str(path) for path in _corpus_files(corpus)]
    if not shutil.which("fincore"):
        return None
    cached = total = 0
    for start in range(0, len(files), 500):
        out = subprocess.run(
            ["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES,SIZE", *files[start : start + 500]],
            capture_output=True,
            text=True,
        ).stdout
        for line in out.split("\n"):
            if line.strip():
                resident, size = line.split()
                cached, total = cached + int(resident), total + int(size)
    return cached / total if total else None


# --- start-up: the real trainer --------------------------------------------------------------------------------------


def _train_once(corpus: Path, packing: str, run_dir: Path, seq_len: int) -> dict:
    """One ``colo train`` on ``corpus``: seconds to the data built and to the first step, peak RSS."""
    shutil.rmtree(run_dir, ignore_errors=True)
    sets = {
        "output_dir": str(run_dir),
        "data.blend": f"[{{path: {corpus}, weight: 1}}]",
        "data.max_tokens": "null",
        "data.packing": packing,
        "data.seq_len": seq_len,
        "data.global_batch_size": 2,
        "model.max_position_embeddings": seq_len,
        "schedule.total_steps": 1,
        "schedule.warmup_steps": 0,
        "checkpoint.enabled": "false",
        "eval.every_steps": "null",
        "sample.max_new_tokens": 0,
        "sample.prompts": "[]",
        "logging.every_steps": 1,
        "logging.tensorboard": "false",
        "logging.progress_bar": "false",
    }
    command = [str(COLO), "train", "--preset", "tiny-llama"]
    for key, value in sets.items():
        command += ["--set", f"{key}={value}"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "COLUMNS": "400"}
    launched = time.time()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    data_built = None
    output = []
    for line in process.stdout:
        output.append(line)
        if data_built is None and line.startswith("colo train:"):
            data_built = time.time() - launched
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode != 0:
        raise RuntimeError(f"colo train failed ({process.returncode}):\n{''.join(output[-40:])}")
    metrics = run_dir / "metrics.jsonl"
    first = json.loads(metrics.read_text().splitlines()[0])
    rows = next((line.strip() for line in output if line.startswith("rows:")), "")
    return {
        "data_built_s": round(data_built, 3) if data_built is not None else None,
        "first_step_s": round(first["time"] - launched, 3),
        "peak_rss_mib": round(usage.ru_maxrss / 1024, 1),
        "rows": rows,
    }


def _clear_row_index(corpus: Path) -> None:
    for path in (corpus / "cache").glob("documents-*"):
        path.unlink()


# --- the loader alone -----------------------------------------------------------------------------------------------


def _loader_worker(args) -> None:
    """In this (fresh) process: the trainer's data objects for llama-1b's shape, then ``--batches`` batches."""
    import resource

    began = time.perf_counter()
    from colo.apps.data.tokenizer import load_tokenizer
    from colo.apps.train.data_setup import build_data, build_dataset
    from colo.apps.train.loading import load_config

    imported = time.perf_counter()
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    config = load_config(
        preset="llama-1b",
        overrides=[
            f"data.blend=[{{path: {args.corpus}, weight: 1}}]",
            f"data.packing={args.packing}",
            "eval.every_steps=null",
            f"output_dir={args.work / 'loader-run'}",
        ],
    )
    tokenizer = load_tokenizer(config.data.tokenizer)
    num_replicas = config.data.global_batch_size // args.batch_rows
    rows = build_dataset(config.data, tokenizer, chats=False, cache_dir=str(args.work / "loader-run" / "data-cache"))
    data = build_data(config, tokenizer, num_replicas=num_replicas, rank=0, vocab_size=None, rows=rows)
    built = time.perf_counter()
    rss_built = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # a random starting step: the shuffled order's rows anywhere in the corpus
    first_position = random.Random(args.seed).randrange(10**6) * data.sampler.global_batch_size
    data.sampler.position = first_position
    batches = data.train_batches()
    tokens = slots = 0
    start = time.perf_counter()
    for _ in range(args.batches):
        batch, real = next(batches)
        tokens += real
        slots += batch["input_ids"].numel()
    seconds = time.perf_counter() - start
    # the same batches again: their pages are cached and their 1 MiB blocks already CRC-checked in this process
    data.sampler.position = first_position
    batches = data.train_batches()
    start = time.perf_counter()
    for _ in range(args.batches):
        next(batches)
    again = time.perf_counter() - start
    print(
        json.dumps(
            {
                "import_s": round(imported - began, 3),
                "build_data_s": round(built - imported, 3),
                "rss_built_minus_imported_mib": round((rss_built - rss_before) / 1024, 1),
                "batch_shape": list(batch["input_ids"].shape),
                "batches": args.batches,
                "seconds": round(seconds, 4),
                "tokens": tokens,
                "slot_tokens_per_s": round(slots / seconds),
                "tokens_per_s": round(tokens / seconds),
                "same_rows_again_tokens_per_s": round(tokens / again),
                "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                **_rss_parts(),
            }
        )
    )


def _rss_parts() -> dict:
    """This process's resident memory now, anonymous vs file-backed (mapped shard pages), MiB."""
    parts = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssFile"):
            parts[f"{key.lower()}_mib"] = round(int(value.split()[0]) / 1024, 1)
    return parts


def _loader_once(args, corpus: Path, packing: str, seed: int) -> dict:
    command = [
        sys.executable, __file__, "--worker", "--corpus", str(corpus), "--packing", packing, "--work", str(args.work),
        "--batches", str(args.batches), "--batch-rows", str(args.batch_rows), "--seed", str(seed),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(command, capture_output=True, text=True, env=env)
    if out.returncode:
        raise RuntimeError(f"loader worker failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# --- the run ---------------------------------------------------------------------------------------------------------


def _median(rows: list[dict], key: str) -> float | None:
    values = [row[key] for row in rows if row.get(key) is not None]
    return round(statistics.median(values), 3) if values else None


def _loadavg() -> list[float]:
    return [round(value, 2) for value in os.getloadavg()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "data_loader_cpu.json")
    parser.add_argument("--work", type=Path, default=Path("/tmp/colo-data-loader-bench"))
    parser.add_argument("--small-tokens", type=int, default=20_000_000)
    parser.add_argument("--large-tokens", type=int, default=2_000_000_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--batch-rows", type=int, default=8)
    parser.add_argument(
        "--startup-seq-len",
        type=int,
        default=512,
        help="data.seq_len of the start-up runs (the tiny model's eager attention takes ~30 s a step at 2048 here)",
    )
    parser.add_argument("--gpu-tokens-per-s", type=float, default=70_000)
    parser.add_argument("--no-many", action="store_true", help="skip the many-small-shards start-up row")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--corpus", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--packing", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _loader_worker(args)
        return

    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    began = time.time()
    load_at_start = _loadavg()
    text = work / "stdlib.jsonl"
    if not text.is_file():
        _write_text(text, args.small_tokens)
    corpora = {"small": work / "small"}
    manifests = {"small": _prepare(text, corpora["small"])}
    big_shards = work / "small-16m-shards"
    _prepare(text, big_shards, "--shard-tokens", str(LARGE_SHARD_TOKENS))
    corpora["large"] = work / "large"
    manifests["large"] = _replicate(big_shards, corpora["large"], args.large_tokens, link=False)
    if not args.no_many:
        corpora["many"] = work / "many"
        manifests["many"] = _replicate(corpora["small"], corpora["many"], args.large_tokens, link=True)
    described = {
        name: {
            "path": str(path),
            "tokens": manifests[name]["num_tokens"],
            "documents": manifests[name]["num_documents"],
            "shards": len(manifests[name]["shards"]),
            "bytes": sum(p.stat().st_size for p in _corpus_files(path)),
            "files": "hard links of small's shards" if name == "many" else "distinct files",
        }
        for name, path in corpora.items()
    }
    print(json.dumps(described, indent=1), flush=True)
    seq_len = args.startup_seq_len
    runs = work / "runs"

    # start-up, packing fixed: corpora interleaved in every round, after one discarded run (imports' first load)
    _train_once(corpora["small"], "fixed", runs / "warm-up", seq_len)
    startup: dict[str, dict[str, list[dict]]] = {"fixed": {}, "documents-cold": {}, "documents-warm": {}}
    for _round in range(args.repeats):
        for name in corpora:
            row = _train_once(corpora[name], "fixed", runs / f"fixed-{name}", seq_len)
            startup["fixed"].setdefault(name, []).append(row)
            print("startup fixed", name, row, flush=True)
    # documents: the first run computes the row index (cold), later ones map it (warm)
    doc_corpora = [name for name in corpora if name != "many"]
    for name in doc_corpora:
        _clear_row_index(corpora[name])
        row = _train_once(corpora[name], "documents", runs / f"documents-{name}", seq_len)
        startup["documents-cold"].setdefault(name, []).append(row)
        print("startup documents cold", name, row, flush=True)
    for _round in range(args.repeats):
        for name in doc_corpora:
            row = _train_once(corpora[name], "documents", runs / f"documents-{name}", seq_len)
            startup["documents-warm"].setdefault(name, []).append(row)
            print("startup documents warm", name, row, flush=True)

    # the loader alone: cold pages (evicted) then cached, corpora interleaved, a new random position each time
    loader: dict[str, dict[str, list[dict]]] = {}
    seed = 0
    index_2048 = {}
    for name in doc_corpora:  # the llama-1b (seq_len 2048) row index, computed here: its build time
        _clear_row_index(corpora[name])
        row = _loader_once(args, corpora[name], "documents", seed)
        record = json.loads(next((corpora[name] / "cache").glob("documents-seq2048-*.json")).read_text())
        index_2048[name] = {
            "documents": described[name]["documents"],
            "pieces": record["pieces"],
            "rows": record["rows"],
            "build_data_s": row["build_data_s"],
            "per_million_pieces_s": round(row["build_data_s"] / (record["pieces"] / 1e6), 2),
            "per_billion_tokens_s": round(row["build_data_s"] / (described[name]["tokens"] / 1e9), 2),
            "run": row,
        }
        print("loader documents index build (seq_len 2048)", name, row, flush=True)
    for _round in range(args.repeats):
        for name in doc_corpora:
            seed += 1
            for state in ("evicted", "cached"):
                if state == "cached":
                    _read_all(corpora[name])
                for packing in ("fixed", "documents"):
                    if state == "evicted":
                        _evict(corpora[name])
                    fraction = _cached_fraction(corpora[name])
                    row = _loader_once(args, corpora[name], packing, seed)
                    row["page_cache_fraction_before"] = None if fraction is None else round(fraction, 4)
                    loader.setdefault(f"{packing}/{name}/{state}", []).append(row)
                    print("loader", packing, name, state, row, flush=True)
        if "many" in corpora:  # hard links of small's shards (cached with them): opening 2,000 shards
            row = _loader_once(args, corpora["many"], "fixed", seed)
            loader.setdefault("fixed/many/cached", []).append(row)
            print("loader fixed many cached", row, flush=True)

    target = 10 * args.gpu_tokens_per_s
    summary_startup = {}
    for kind, by_corpus in startup.items():
        summary_startup[kind] = {
            name: {
                "data_built_s": _median(rows, "data_built_s"),
                "first_step_s": _median(rows, "first_step_s"),
                "peak_rss_mib": _median(rows, "peak_rss_mib"),
                "runs": rows,
            }
            for name, rows in by_corpus.items()
        }
    ratios = {}
    for kind, by_corpus in summary_startup.items():
        if "small" not in by_corpus:
            continue
        base = by_corpus["small"]
        for name, row in by_corpus.items():
            if name == "small":
                continue
            ratios[f"{kind}: {name} / small first-step time"] = round(row["first_step_s"] / base["first_step_s"], 3)
            ratios[f"{kind}: {name} - small peak RSS MiB"] = round(row["peak_rss_mib"] - base["peak_rss_mib"], 1)
    cold, warm = summary_startup["documents-cold"], summary_startup["documents-warm"]
    index_build = {
        name: {
            "cold_minus_warm_data_built_s": round(cold[name]["data_built_s"] - warm[name]["data_built_s"], 2),
            "per_billion_tokens_s": round(
                (cold[name]["data_built_s"] - warm[name]["data_built_s"]) / (described[name]["tokens"] / 1e9), 2
            ),
        }
        for name in cold
    }
    summary_loader = {}
    for key, rows in loader.items():
        tokens_per_s = _median(rows, "tokens_per_s")
        summary_loader[key] = {
            "tokens_per_s": tokens_per_s,
            "slot_tokens_per_s": _median(rows, "slot_tokens_per_s"),
            "same_rows_again_tokens_per_s": _median(rows, "same_rows_again_tokens_per_s"),
            "rssfile_mib": _median(rows, "rssfile_mib"),
            "rssanon_mib": _median(rows, "rssanon_mib"),
            "build_data_s": _median(rows, "build_data_s"),
            "rss_built_minus_imported_mib": _median(rows, "rss_built_minus_imported_mib"),
            "x_one_gpu": round(tokens_per_s / args.gpu_tokens_per_s, 1),
            "meets_10x": tokens_per_s >= target,
            "runs": rows,
        }
    result = {
        "benchmark": "benchmarks/data_loader.py",
        "command": " ".join([".venv/bin/python", "benchmarks/data_loader.py", *sys.argv[1:]]),
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "memory_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
            "python": platform.python_version(),
            "load_average_start": load_at_start,
            "load_average_end": _loadavg(),
            "note": "shared 2-core CPU VM, other sessions running; start-up rows interleaved, medians",
        },
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(began)),
        "seconds": round(time.time() - began),
        "tokenizer": "byte (colo data prepare's default)",
        "corpora": described,
        "startup_setup": (
            "colo train --preset tiny-llama (a tiny Llama, DDP, 1 process, CPU) with data.blend=[{path, weight: 1}],"
            f" data.seq_len={seq_len}, data.global_batch_size=2, schedule.total_steps=1, checkpoint/eval/samples off;"
            " data_built_s: launch to the 'colo train:' header (after build_data); first_step_s: launch to the first"
            " metrics.jsonl record's time; peak_rss_mib: the process's ru_maxrss"
        ),
        "startup": summary_startup,
        "startup_ratios": ratios,
        "startup_goal": "large / small first-step time <= 1.2 and large - small peak RSS <= 100 MiB",
        "documents_index_build": {
            f"trainer, seq_len {seq_len} (cold minus warm start-up to the data built)": index_build,
            "loader, seq_len 2048 (build_data with no cached index)": index_2048,
        },
        "loader_setup": (
            f"llama-1b's run config (seq_len 2048), build_dataset + build_data at num_replicas = 1024 / "
            f"{args.batch_rows} (a rank's batch: {args.batch_rows} x 2048), then RunData.train_batches for "
            f"{args.batches} batches from a random global position, fresh process each; 'evicted': the corpus's files"
            " dropped from the page cache first (posix_fadvise DONTNEED), 'cached': after reading all its files;"
            " tokens_per_s counts real (non-padding) tokens; same_rows_again_tokens_per_s: the same batches re-read"
            " in the same process (blocks already CRC-checked)"
        ),
        "loader": summary_loader,
        "loader_goal_tokens_per_s": target,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({"startup_ratios": ratios, "index_build": result["documents_index_build"]}, indent=1))
    print(json.dumps({key: (row["tokens_per_s"], row["x_one_gpu"]) for key, row in summary_loader.items()}, indent=1))


if __name__ == "__main__":
    main()
