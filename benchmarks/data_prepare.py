#!/usr/bin/env python3
"""Tokenizing a pre-training corpus: `colo data prepare` vs `datasets` map + save_to_disk vs `litdata.optimize`.

The work: a corpus of JSON Lines files (``{"text": ...}`` per line), each one copy of the Python standard library's
sources (`colo.apps.data.default_corpus`, one document per file), as many copies as make ``--tokens`` tokens; the
tokenizer: a Hugging Face ``tokenizers`` byte-level BPE with a 32,000-token vocabulary trained here on the same
standard library (cached in the work directory). Every contestant frames each document ``[bos] tokens [eos]``,
tokenizes with that tokenizer's batched call (``encode_batch_fast``, 1,024 documents at a time) in ``--workers``
processes, and writes the token ids to disk:

- colo: ``colo data prepare FILES --out DIR --tokenizer tokenizer.json --workers N`` (uint16 shards, document index,
  CRC-32s, manifest);
- datasets: ``load_dataset("json", data_files=FILES, num_proc=N)``, ``.map(tokenize, batched=True, num_proc=N,
  remove_columns=["text"])``, ``.save_to_disk(DIR)`` (a fresh cache directory each time; ids returned as the
  Python lists the tokenizer gives, as Hugging Face's ``run_clm.py`` does, which datasets stores as
  ``list<int32>`` for an ``input_ids`` column);
- litdata: ``optimize(fn, inputs=FILES, output_dir=DIR, chunk_size=2049 * 8012, item_loader=TokensLoader(),
  num_workers=N)`` with ``fn`` reading a file and yielding each document's int32 tensor (litdata's documented
  pre-training recipe; litdata is imported from ``--litdata-path``, a ``pip install --target`` directory, so the
  shared environment's torch is left alone).

Each contestant runs as a fresh process (its imports and worker start-up are part of its time) with
``RAYON_NUM_THREADS=1`` (one tokenizer thread per worker process, the best setting with one process per core);
rounds rotate the order; the output directory is deleted before each run. The first round checks that the three
hold the same number of tokens and that colo's token stream equals the datasets one. Throughput is corpus tokens
over the wall time; the ratios are colo's throughput over each peer's (> 1: colo is faster). The machine is shared,
so the CPU time of each contestant's whole process tree is measured too (this process is made the child subreaper,
so worker and server processes that outlive their parent are still reaped and counted): tokens per CPU-second
moves far less with other jobs' load than tokens per second does.

    python benchmarks/data_prepare.py [--tokens 100000000] [--repeats 3] [--workers 2] [--litdata-path DIR]

Writes ``benchmarks/results/data_prepare_cpu.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
CONTESTANTS = ("colo", "datasets", "litdata")
VOCAB_SIZE = 32_000
SPECIALS = ["<s>", "</s>", "<pad>"]
BATCH = 1024


def _train_tokenizer(work: Path) -> Path:
    path = work / f"tokenizer-py{sys.version_info.major}{sys.version_info.minor}-{VOCAB_SIZE}.json"
    if path.is_file():
        return path
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from colo.apps.data import default_corpus

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        show_progress=False,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train([str(file) for file in default_corpus()], trainer)
    tokenizer.save(str(path))
    return path


def _build_corpus(work: Path, tokenizer_path: Path, tokens: int) -> tuple[list[Path], int, int]:
    """JSON Lines copies of the standard library, enough for ``tokens``; returns (files, tokens, bytes)."""
    from colo.apps.data import default_corpus, read_documents

    one_copy = work / "stdlib-copy.jsonl"
    count_file = work / f"stdlib-copy-tokens-{tokenizer_path.stem}.json"
    if not one_copy.is_file():
        lines = [json.dumps({"text": text}, ensure_ascii=False) for text in read_documents(default_corpus())]
        one_copy.write_text("\n".join(lines) + "\n")
    if not count_file.is_file():
        from tokenizers import Tokenizer

        tokenizer = Tokenizer.from_file(str(tokenizer_path))
        texts = [json.loads(line)["text"] for line in one_copy.read_text().splitlines()]
        counted = sum(len(e.ids) + 2 for e in tokenizer.encode_batch_fast(texts, add_special_tokens=False))
        count_file.write_text(json.dumps({"tokens": counted, "documents": len(texts)}))
    per_copy = json.loads(count_file.read_text())["tokens"]
    copies = max(1, -(-tokens // per_copy))
    corpus = work / "corpus"
    corpus.mkdir(exist_ok=True)
    files = [corpus / f"part-{n:05d}.jsonl" for n in range(copies)]
    for file in files:
        if not file.is_file() or file.stat().st_size != one_copy.stat().st_size:
            shutil.copyfile(one_copy, file)
    return files, copies * per_copy, copies * one_copy.stat().st_size


# --- the peers, each run in a fresh process by `--run NAME` -------------------------------------------------------


def _run_datasets(files: list[str], tokenizer_path: str, out: Path, workers: int) -> dict:
    import datasets
    from tokenizers import Tokenizer

    datasets.disable_progress_bars()
    tokenizer = Tokenizer.from_file(tokenizer_path)
    bos, eos = tokenizer.token_to_id(SPECIALS[0]), tokenizer.token_to_id(SPECIALS[1])

    def tokenize(batch):
        encodings = tokenizer.encode_batch_fast(batch["text"], add_special_tokens=False)
        return {"input_ids": [[bos, *encoding.ids, eos] for encoding in encodings]}

    started = time.perf_counter()
    raw = datasets.load_dataset("json", data_files=files, split="train", cache_dir=str(out / "cache"), num_proc=workers)
    loaded = time.perf_counter()
    tokenized = raw.map(tokenize, batched=True, batch_size=BATCH, num_proc=workers, remove_columns=["text"])
    mapped = time.perf_counter()
    tokenized.save_to_disk(str(out / "saved"), num_proc=workers)
    saved = time.perf_counter()
    return {
        "phases_s": {"load_json": loaded - started, "map": mapped - loaded, "save_to_disk": saved - mapped},
        "dtype": str(tokenized.features["input_ids"].feature.dtype),
    }


def _litdata_tokenize(path: str, tokenizer_path: str):
    import numpy as np
    import torch
    from tokenizers import Tokenizer

    tokenizer = _litdata_tokenize.__dict__.setdefault("tokenizer", Tokenizer.from_file(tokenizer_path))
    bos, eos = tokenizer.token_to_id(SPECIALS[0]), tokenizer.token_to_id(SPECIALS[1])
    with open(path, encoding="utf-8") as lines:
        batch = []
        for line in lines:
            batch.append(json.loads(line)["text"])
            if len(batch) == BATCH:
                for encoding in tokenizer.encode_batch_fast(batch, add_special_tokens=False):
                    yield torch.from_numpy(np.asarray([bos, *encoding.ids, eos], dtype=np.int32))
                batch = []
        for encoding in tokenizer.encode_batch_fast(batch, add_special_tokens=False):
            yield torch.from_numpy(np.asarray([bos, *encoding.ids, eos], dtype=np.int32))


def _run_litdata(files: list[str], tokenizer_path: str, out: Path, workers: int) -> dict:
    from functools import partial

    from litdata import TokensLoader, optimize

    optimize(
        fn=partial(_litdata_tokenize, tokenizer_path=tokenizer_path),
        inputs=files,
        output_dir=str(out),
        chunk_size=2049 * 8012,
        item_loader=TokensLoader(),
        num_workers=workers,
        mode="overwrite",
        verbose=False,
    )
    return {"dtype": "int32"}


def _run_in_process(name: str, files: list[str], tokenizer_path: str, out: Path, workers: int) -> None:
    details = {"datasets": _run_datasets, "litdata": _run_litdata}[name](files, tokenizer_path, out, workers)
    (out.parent / f"{out.name}.details.json").write_text(json.dumps(details))


# --- the harness ---------------------------------------------------------------------------------------------------


def _command(name: str, files: list[Path], tokenizer_path: Path, out: Path, workers: int, list_file: Path) -> list:
    if name == "colo":
        return [
            sys.executable,
            "-m",
            "colo.apps.cli",
            "data",
            "prepare",
            *map(str, files),
            "--out",
            str(out),
            "--tokenizer",
            str(tokenizer_path),
            "--workers",
            str(workers),
            "--no-progress",
        ]
    return [
        sys.executable,
        __file__,
        *("--run", name, "--files", str(list_file), "--tokenizer-path", str(tokenizer_path)),
        *("--work-dir", str(out.parent), "--workers", str(workers)),
    ]


def _count_tokens(name: str, out: Path) -> int:
    if name == "colo":
        return json.loads((out / "manifest.json").read_text())["num_tokens"]
    if name == "datasets":
        import datasets

        table = datasets.load_from_disk(str(out / "saved")).data.table
        return int(sum(len(chunk.values) for chunk in table.column("input_ids").chunks))
    index = json.loads((out / "index.json").read_text())
    return int(sum(chunk["dim"] for chunk in index["chunks"]))


def _same_stream(colo_out: Path, datasets_out: Path) -> bool:
    import datasets
    import numpy as np

    from colo.apps.data import TokenCorpus

    corpus = TokenCorpus(colo_out)
    column = datasets.load_from_disk(str(datasets_out / "saved")).data.table.column("input_ids")
    position = 0
    for chunk in column.chunks:
        values = chunk.values.to_numpy()
        if not np.array_equal(corpus.read(position, position + values.size), values):
            return False
        position += values.size
    return position == corpus.num_tokens


def _become_subreaper() -> None:
    """Orphaned descendants (a forkserver outliving its parent, say) are re-parented to this process, which reaps
    them, so `resource.getrusage(RUSAGE_CHILDREN)` counts every process a contestant started (Linux only)."""
    import ctypes

    PR_SET_CHILD_SUBREAPER = 36
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def _reap_all() -> None:
    while True:
        try:
            os.wait()
        except ChildProcessError:
            return


def _cpu_seconds() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=100_000_000, help="corpus size in tokens (about)")
    parser.add_argument("--repeats", type=int, default=3, help="rounds; medians are reported")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--contestants", default=",".join(CONTESTANTS))
    parser.add_argument("--work-dir", default="/tmp/colo_data_prepare_bench")
    parser.add_argument("--litdata-path", default=None, help="a directory holding litdata (pip install --target)")
    parser.add_argument("--json", default=str(RESULTS / "data_prepare_cpu.json"))
    parser.add_argument("--run", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--files", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--tokenizer-path", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    work = Path(args.work_dir)
    if args.run:
        files = json.loads(Path(args.files).read_text())
        _run_in_process(args.run, files, args.tokenizer_path, work / f"out-{args.run}", args.workers)
        return

    work.mkdir(parents=True, exist_ok=True)
    tokenizer_path = _train_tokenizer(work)
    files, corpus_tokens, corpus_bytes = _build_corpus(work, tokenizer_path, args.tokens)
    list_file = work / "files.json"
    list_file.write_text(json.dumps([str(file) for file in files]))
    names = [name for name in args.contestants.split(",") if name]
    environment = {**os.environ, "RAYON_NUM_THREADS": "1"}
    if args.litdata_path:
        environment["PYTHONPATH"] = os.pathsep.join(filter(None, [args.litdata_path, os.environ.get("PYTHONPATH")]))
    print(f"corpus: {len(files)} files, {corpus_bytes / 1e6:.0f} MB, {corpus_tokens / 1e6:.1f}M tokens", flush=True)

    _become_subreaper()
    seconds: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    details: dict[str, dict] = {}
    failures: dict[str, str] = {}
    checks: dict = {}
    for round_ in range(args.repeats):
        order = names[round_ % len(names) :] + names[: round_ % len(names)]
        for name in order:
            if name in failures:
                continue
            out = work / f"out-{name}"
            shutil.rmtree(out, ignore_errors=True)
            (work / f"out-{name}.details.json").unlink(missing_ok=True)
            command = _command(name, files, tokenizer_path, out, args.workers, list_file)
            cpu_before = _cpu_seconds()
            started = time.perf_counter()
            finished = subprocess.run(command, env=environment, capture_output=True, text=True)
            elapsed = time.perf_counter() - started
            _reap_all()  # the contestant's orphans (their CPU time is counted once they are reaped)
            cpu_seconds = _cpu_seconds() - cpu_before
            if finished.returncode != 0:
                failures[name] = (finished.stderr or finished.stdout).strip().splitlines()[-1:]
                print(f"{name}: failed: {failures[name]}", flush=True)
                continue
            seconds[name].append(elapsed)
            cpu[name].append(cpu_seconds)
            detail_file = work / f"out-{name}.details.json"
            if detail_file.is_file():
                details.setdefault(name, {})[f"round_{round_}"] = json.loads(detail_file.read_text())
            if round_ == 0:
                checks.setdefault("tokens", {})[name] = _count_tokens(name, out)
                if name == "datasets" and "colo" in names and (work / "out-colo").is_dir():
                    checks["colo_stream_equals_datasets"] = _same_stream(work / "out-colo", out)
            print(
                f"round {round_} {name}: {elapsed:.1f} s ({corpus_tokens / elapsed / 1e6:.2f}M tokens/s), "
                f"{cpu_seconds:.1f} CPU s ({corpus_tokens / cpu_seconds / 1e6:.2f}M tokens per CPU s)",
                flush=True,
            )
        if round_ == 0 and "colo" in names and "datasets" in names and "colo_stream_equals_datasets" not in checks:
            checks["colo_stream_equals_datasets"] = _same_stream(work / "out-colo", work / "out-datasets")

    medians = {name: statistics.median(times) for name, times in seconds.items() if times}
    cpu_medians = {name: statistics.median(times) for name, times in cpu.items() if times}
    result = {
        "benchmark": "pre-training corpus tokenization: colo data prepare vs datasets map + save_to_disk vs "
        "litdata.optimize, same BPE tokenizer and batched encode, same worker count",
        "environment": {
            "machine": f"{os.cpu_count()}-core CPU ({platform.machine()}), shared with other jobs",
            "python": platform.python_version(),
            "workers": args.workers,
            "rayon_threads_per_process": 1,
            "versions": _versions(environment),
        },
        "corpus": {
            "files": len(files),
            "bytes": corpus_bytes,
            "tokens": corpus_tokens,
            "documents_per_file": json.loads(next(work.glob("stdlib-copy-tokens-*.json")).read_text())["documents"],
            "tokenizer": f"byte-level BPE, {VOCAB_SIZE} ids, trained on the standard library",
        },
        "repeats": args.repeats,
        "seconds": {name: {"median": medians.get(name), "rounds": times} for name, times in seconds.items()},
        "tokens_per_s": {name: corpus_tokens / median for name, median in medians.items()},
        "throughput_ratios": {
            f"colo_vs_{name}": medians[name] / medians["colo"]
            for name in medians
            if name != "colo" and "colo" in medians
        },
        "cpu_seconds": {name: {"median": cpu_medians.get(name), "rounds": times} for name, times in cpu.items()},
        "tokens_per_cpu_s": {name: corpus_tokens / median for name, median in cpu_medians.items()},
        "cpu_efficiency_ratios": {
            f"colo_vs_{name}": cpu_medians[name] / cpu_medians["colo"]
            for name in cpu_medians
            if name != "colo" and "colo" in cpu_medians
        },
        "checks": checks,
        "details": details,
        "failures": failures,
    }
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    shown = ("tokens_per_s", "throughput_ratios", "tokens_per_cpu_s", "cpu_efficiency_ratios", "checks", "failures")
    print(json.dumps({key: result[key] for key in shown}, indent=1))


def _versions(environment: dict) -> dict:
    probe = (
        "import json, importlib.metadata as m\n"
        "out = {}\n"
        "for name in ('tokenizers', 'datasets', 'litdata', 'pyarrow', 'torch'):\n"
        "    try: out[name] = m.version(name)\n"
        "    except m.PackageNotFoundError: out[name] = None\n"
        "print(json.dumps(out))"
    )
    return json.loads(
        subprocess.run([sys.executable, "-c", probe], env=environment, capture_output=True, text=True).stdout
    )


if __name__ == "__main__":
    main()
