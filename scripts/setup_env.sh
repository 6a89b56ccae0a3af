#!/usr/bin/env bash
# Create .venv if missing and install every colo package (editable) plus the dev tools.
#
# torch is pinned through a pip constraint file: torch==2.13.0 (a CPU build on machines without CUDA wheels
# at hand) when the venv has no torch, and the installed version otherwise, so no other package can pull
# in a different torch. Idempotent: the Makefile reruns it only when a pyproject changes.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${VENV:-.venv}"
PYTHON="${PYTHON:-python3}"
TORCH_PIN="${TORCH_PIN:-2.13.0}"

if [ ! -x "$VENV/bin/python" ]; then
    echo "[setup] creating $VENV with $($PYTHON --version)"
    "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"

mkdir -p "$VENV/colo"
CONSTRAINTS="$VENV/colo/constraints.txt"
if installed=$("$PY" -c "import torch; print(torch.__version__.split('+')[0])" 2>/dev/null); then
    echo "[setup] keeping the installed torch $installed"
    echo "torch==$installed" > "$CONSTRAINTS"
else
    echo "[setup] no torch in $VENV: pinning torch==$TORCH_PIN"
    echo "torch==$TORCH_PIN" > "$CONSTRAINTS"
fi

# No wheel cache: the floor venv alone is ~5 GB of CUDA wheels, and CI runs on a clean clone with a bounded disk.
PIP=("$PY" -m pip --disable-pip-version-check --no-cache-dir -q)
pip_install() {
    # pip's output without this machine's noise about missing local index folders; its failure fails setup
    local log status=0
    log=$(mktemp)
    "${PIP[@]}" install "$@" >"$log" 2>&1 || status=$?
    grep -v "^WARNING: Location" "$log" || true
    rm -f "$log"
    return $status
}
pip_install -c "$CONSTRAINTS" "torch" "hatchling>=1.18" "editables"
"$PY" -c "import torch" >/dev/null  # fail loudly if the torch install did not work

PACKAGES=(comm kernels tensor zero gemini pipeline apps)
EDITABLES=()
for name in "${PACKAGES[@]}"; do
    EDITABLES+=(-e "./packages/colo-$name[testing]")
done
# No build isolation: hatchling is already in the venv, which saves a build environment per package.
pip_install -c "$CONSTRAINTS" --no-build-isolation "${EDITABLES[@]}" -e ".[dev]"

# Without CUDA colo's Triton kernels run in Triton's interpreter. The interpreter of Triton 3.6 (torch 2.11's) takes
# int() of one-element arrays, which numpy 2.4 refuses; where a loop over program ids fails that way (checked now
# that the packages brought numpy), hold numpy below 2.4 (compiled kernels on a GPU never use the interpreter).
if ! "$PY" - >/dev/null 2>&1 <<'PYTHON'
import os
os.environ["TRITON_INTERPRET"] = "1"
import torch
try:
    import triton
    import triton.language as tl
except ImportError:
    raise SystemExit(0)
if torch.cuda.is_available():
    raise SystemExit(0)


@triton.jit
def _strided_loop(out_ptr, n):
    for i in range(tl.program_id(0), n, tl.num_programs(0)):
        tl.store(out_ptr + i, i)


_strided_loop[(1,)](torch.zeros(2), 2)
PYTHON
then
    echo "[setup] this Triton's interpreter needs numpy<2.4: constraining it"
    echo "numpy<2.4" >> "$CONSTRAINTS"
    pip_install -c "$CONSTRAINTS" "numpy<2.4"
fi

"$PY" -c "import colo.comm, colo.kernels, colo.tensor, colo.zero, colo.gemini, colo.pipeline, colo.apps"
echo "[setup] ok: $("$PY" -c "import torch; print('torch', torch.__version__)")"
