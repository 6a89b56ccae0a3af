#!/usr/bin/env bash
# The GPU checks of colo in one staged run (issue 32), for a lent CUDA machine with torch and triton but no network.
#
#   bash scripts/gpu_check.sh [STAGES]       STAGES: comma-separated subset of env,tests,llama,kernels,gemini (all)
#                                            and the opt-in suite (the whole test suite on the GPU machine, issue 39),
#                                            tune (benchmarks/kernel_tuning.py, issue 50: writes tuning.json, which every
#                                            later stage then runs with through COLO_KERNEL_TUNING; put it first) and
#                                            train (colo train --preset llama-1b on one GPU, ZeRO-2, 8 x 2048 per step)
#                                            and serve (benchmarks/serving.py in bf16 on the 1b preset: colo's engine vs
#                                            transformers generate with SDPA and its static cache, issue 48)
#
# Writes into $OUT (default ./gpu-out): log.txt (everything printed), tests_{kernels,comm,gemini}.xml (junit), llama_gpu.json,
# kernels_bench.json (one merged report; each op ran in its own process with the copy_ baseline beside it),
# gemini_offload_cuda.json. Each stage runs under its own time cap and the whole run under BUDGET_S seconds
# (default 540): a stage that would start with less than its minimum left is skipped and says so, so the JSON of
# the finished stages always comes back. Wheels for packages the machine lacks (pydantic, liger-kernel, deepspeed,
# hjson) are read from .whl/ when present. TEST_GROUPS (kernels,comm,gemini), TEST_KERNELS_K (a pytest -k
# expression for the kernel group) and KERNEL_OPS (space-separated) narrow a rerun; KERNEL_BENCH_ARGS and LLAMA_ARGS
# add arguments to the kernel bench and the Llama benchmark (a CPU dry run:
# KERNEL_BENCH_ARGS="--quick --device cpu" TRITON_INTERPRET=1 bash scripts/gpu_check.sh env,kernels).
set -u
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
BUDGET_S=${BUDGET_S:-540}
STAGES=${1:-env,tests,llama,kernels,gemini}
START=$(date +%s)
LOG="$OUT/log.txt"
exec > >(tee -a "$LOG") 2>&1

left() { echo $((BUDGET_S - ($(date +%s) - START))); }
# cap NAME MAX MIN: the seconds stage NAME may take (at most MAX), or 0 (skip) when fewer than MIN are left
cap() {
    local remaining
    remaining=$(left)
    if ((remaining < $3)); then
        echo "=== skip $1: ${remaining}s left, needs ${3}s" >&2
        echo 0
    elif ((remaining < $2)); then echo "$remaining"; else echo "$2"; fi
}
wants() { [[ ",$STAGES," == *",$1,"* ]]; }
stage() { echo; echo "=== $1 ($(left)s of ${BUDGET_S}s left) $(date -u +%H:%M:%S)"; }

if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || echo "wheel install failed"
    export PYTHONPATH=/tmp/site
fi
for src in packages/*/src; do PYTHONPATH="$PWD/$src:${PYTHONPATH:-}"; done
export PYTHONPATH PYTHONUNBUFFERED=1
python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" && unset TRITON_INTERPRET

if wants env; then
    stage env
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv
    python3 - <<'EOF'
import importlib, torch, triton
print("torch", torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__, torch.cuda.get_device_name())
for name in ("pydantic", "transformers", "liger_kernel", "deepspeed", "colo.apps", "colo.kernels"):
    try:
        module = importlib.import_module(name)
        print(name, getattr(module, "__version__", "ok"))
    except Exception as error:
        print(name, "NOT importable:", type(error).__name__, error)
EOF
fi

if wants tune; then
    stage tune
    seconds=$(cap tune "${TUNE_CAP:-200}" 60)
    if ((seconds > 0)); then
        timeout -k 5 "$seconds" python3 benchmarks/kernel_tuning.py --out "$OUT/tuning.json" \
            --report "$OUT/tuning_report.json" ${TUNE_ARGS:-}
        echo "tune exit $?"
    fi
    if [[ -s $OUT/tuning.json ]]; then
        export COLO_KERNEL_TUNING=$OUT/tuning.json
        echo "later stages run with COLO_KERNEL_TUNING=$COLO_KERNEL_TUNING"
    fi
fi

if wants tests; then
    # three groups, each under its own cap and junit file, so a hang in one keeps the others' results;
    # pytest-timeout ends a hung test with its stacks
    run_tests() {  # NAME MAX_S PER_TEST_S PATHS...
        local name=$1 max=$2 per_test=$3 seconds
        shift 3
        stage "tests:$name"
        seconds=$(cap "tests:$name" "$max" 20)
        ((seconds > 0)) || return
        timeout -k 5 "$seconds" python3 -m pytest -q -p no:cacheprovider -o addopts="" --timeout "$per_test" \
            --tb=short -rfE --junitxml="$OUT/tests_$name.xml" "$@"
        echo "tests:$name exit $?"
    }
    groups=${TEST_GROUPS:-kernels,comm,gemini}
    [[ ",$groups," == *",kernels,"* ]] && run_tests kernels 120 60 packages/colo-kernels/tests/test_cuda_kernels.py \
        ${TEST_KERNELS_K:+-k "$TEST_KERNELS_K"}
    [[ ",$groups," == *",comm,"* ]] && run_tests comm 40 30 packages/colo-comm/tests/test_cuda.py \
        "packages/colo-tensor/tests/test_checkpoint_async.py::test_background_save_of_cuda_tensors_matches_the_foreground_save"
    [[ ",$groups," == *",gemini,"* ]] && run_tests gemini 60 15 packages/colo-gemini/tests/test_tiers.py packages/colo-gemini/tests/test_budgets.py
fi

if wants suite; then
    # the whole suite as `make test` runs it, on the machine's GPU and torch: junit per test, a summary by file in
    # suite_summary.json (commit it under benchmarks/results/ with the device named); SUITE_CAP bounds it
    stage suite
    seconds=$(cap suite "${SUITE_CAP:-420}" 120)
    if ((seconds > 0)); then
        timeout -k 10 "$seconds" python3 -m pytest -q -p no:cacheprovider -o addopts="--import-mode=importlib" \
            --timeout "${SUITE_PER_TEST_S:-120}" --tb=line -rfE --junitxml="$OUT/tests_suite.xml" ${SUITE_ARGS:-}
        echo "suite exit $?"
        python3 - "$OUT" <<'EOF'
import collections, json, pathlib, sys, torch
import xml.etree.ElementTree as ET
out = pathlib.Path(sys.argv[1])
path = out / "tests_suite.xml"
if path.exists():
    by_file = collections.defaultdict(collections.Counter)
    failures = []
    for case in ET.parse(path).getroot().iter("testcase"):
        name = case.get("classname", "").replace(".", "/") + ".py"
        outcome = next((child.tag for child in case if child.tag in ("failure", "error", "skipped")), "passed")
        by_file[name][outcome] += 1
        if outcome in ("failure", "error"):
            failures.append(f"{case.get('classname')}::{case.get('name')}")
    totals = sum(by_file.values(), collections.Counter())
    summary = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
               "torch": torch.__version__, "totals": dict(totals), "failures": failures,
               "by_file": {name: dict(counts) for name, counts in sorted(by_file.items())}}
    (out / "suite_summary.json").write_text(json.dumps(summary, indent=1))
    print("suite:", dict(totals))
EOF
    fi
fi

if wants llama; then
    stage llama
    seconds=$(cap llama "${LLAMA_CAP:-170}" 60)
    if ((seconds > 0)); then
        timeout -k 5 "$seconds" python3 benchmarks/llama_gpu.py --json "$OUT/llama_gpu.json" --warmup 2 --steps 6 ${LLAMA_ARGS:-}
        echo "llama exit $?"
    fi
fi

if wants kernels; then
    stage kernels
    mkdir -p "$OUT/kernels"
    for op in ${KERNEL_OPS:-rms_norm swiglu flash_attention cross_entropy rotary layer_norm softmax adamw fused_linear_cross_entropy}; do
        per_op=45
        [[ $op == flash_attention ]] && per_op=100
        [[ $op == fused_linear_cross_entropy ]] && per_op=70
        seconds=$(cap "kernels:$op" $per_op 20)
        ((seconds > 0)) || continue
        timeout -k 5 "$seconds" python3 -m colo.kernels.bench --ops "copy,$op" --warmup 3 --repeats 10 ${KERNEL_BENCH_ARGS:-} \
            --json "$OUT/kernels/$op.json"
        echo "kernels:$op exit $?"
    done
    python3 - "$OUT" <<'EOF'
import json, pathlib, sys
from colo.kernels.bench import goals
out = pathlib.Path(sys.argv[1])
reports = [json.loads(p.read_text()) for p in sorted((out / "kernels").glob("*.json"))]
if reports:
    merged = {k: v for k, v in reports[0].items() if k not in ("rows", "skipped", "goals")}
    merged["rows"], merged["skipped"] = [], {}
    for report in reports:
        op = next(row["op"] for row in report["rows"] if row["op"] != "copy") if len(report["rows"]) > 1 else None
        for row in report["rows"]:
            row["run"] = op  # the copy_ row of each op's process is kept, named by the op it ran beside
            merged["rows"].append(row)
        merged["skipped"].update(report["skipped"])
    merged["goals"] = {}
    for report in reports:
        for key, entries in goals(report["rows"]).items():
            merged["goals"].setdefault(key, []).extend(entries)
    (out / "kernels_bench.json").write_text(json.dumps(merged, indent=1))
    print("merged", len(reports), "kernel reports")
EOF
    rm -rf "$OUT/kernels"
fi

if wants gemini; then
    stage gemini
    seconds=$(cap gemini 200 60)
    if ((seconds > 0)); then
        timeout -k 5 "$seconds" python3 benchmarks/gemini_offload.py --device cuda --hidden 2048 --blocks 8 --rows 4096 \
            --rounds 3 --steps 2 --budget-fraction 0.5 --out "$OUT/gemini_offload_cuda.json"
        echo "gemini exit $?"
    fi
fi
if wants train; then
    # the CLI on one GPU at the benchmark's shape: steady-state tokens/s and MFU from its own log (issue 50)
    stage train
    seconds=$(cap train "${TRAIN_CAP:-100}" 50)
    if ((seconds > 0)); then
        rm -rf /tmp/colo-train-1b
        timeout -k 5 "$seconds" python3 -m colo.apps.cli train --preset llama-1b --set plugin.name=zero \
            --set plugin.stage=2 --set data.global_batch_size=8 --set schedule.num_microbatches=1 \
            --set schedule.stop_at_step="${TRAIN_STEPS:-30}" --set checkpoint.enabled=false \
            --set eval.every_steps=100000 --set eval.num_sequences=8 --set logging.every_steps=5 \
            --set logging.tensorboard=false --set logging.progress_bar=false --set data.max_tokens=2000000 \
            --set output_dir=/tmp/colo-train-1b ${TRAIN_ARGS:-}
        echo "train exit $?"
        find /tmp/colo-train-1b -name "*.jsonl" -size -8M | head -1 | xargs -r -I{} cp {} "$OUT/train_metrics.jsonl"
    fi
fi
if wants serve; then
    # colo's ServingEngine vs transformers (SDPA, static cache) on the same requests, bf16, 1b preset (issue 48)
    stage serve
    seconds=$(cap serve "${SERVE_CAP:-150}" 60)
    if ((seconds > 0)); then
        timeout -k 5 "$seconds" python3 benchmarks/serving.py --device cuda --dtype bfloat16 --model 1b --formats fp32 \
            --engines colo hf-static --prompt-len 128 --prompt-len-max 1024 --new-tokens 128 --concurrency 1 4 16 \
            --repeats 2 --out "$OUT/serving_gpu.json" ${SERVE_ARGS:-}
        echo "serve exit $?"
    fi
fi
stage done
