#!/bin/bash
# The ZeRO / data-parallel recipe (../shared/BENCHMARKS.md; benchmarks/zero_dp.py's colo rows) at an older revision
# against the working tree, interleaved: the same benchmark script for both, the older packages put first on
# PYTHONPATH (the editable installs are plain path entries, so they come after it).
#
#   benchmarks/zero_before_after.sh REV [REPEATS] [OUT_DIR]
#
# Writes OUT_DIR/{before,after}_R.json (zero_dp.py's JSON) and prints each run's end. Issue 33 used
# REV=727ded2 (the parent of its first commit), 3 repeats: benchmarks/results/zero_issue33_before_after_cpu.json.
set -euo pipefail
REV=${1:?usage: $0 REV [REPEATS] [OUT_DIR]}
REPEATS=${2:-3}
OUT=${3:-/tmp/zero-before-after}
ROOT=$(git rev-parse --show-toplevel)
cd "$ROOT"
TREE=$(mktemp -d /tmp/colo-before-XXXXXX)
trap 'git worktree remove --force "$TREE" >/dev/null 2>&1 || true' EXIT
git worktree add -f -q "$TREE" "$REV"
OLD=$(ls -d "$TREE"/packages/*/src | tr '\n' ':')
mkdir -p "$OUT"
for ((r = 0; r < REPEATS; r++)); do
    if ((r % 2 == 0)); then order="before after"; else order="after before"; fi
    for label in $order; do
        if [ "$label" = before ]; then paths=(PYTHONPATH="$OLD"); else paths=(-u PYTHONPATH); fi
        env "${paths[@]}" OMP_NUM_THREADS=1 .venv/bin/python benchmarks/zero_dp.py \
            --impls colo_zero1 colo_zero2 colo_zero3 --out "$OUT/${label}_$r.json" > "$OUT/${label}_$r.log" 2>&1
        echo "$r $label done $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
    done
done
