"""`python -m colo.kernels.bench --quick` runs end to end on CPU (reference and Triton interpreter) and writes a
JSON report with the device, the versions and one timed row per op, implementation and pass."""

import json
import os
import subprocess
import sys

import pytest

from colo.kernels import bench


def test_quick_cpu_run_writes_the_report(tmp_path, capsys):
    path = tmp_path / "bench.json"
    assert bench.main(["--device", "cpu", "--quick", "--ops", "rms_norm,swiglu,adamw", "--json", str(path)]) == 0
    report = json.loads(path.read_text())

    assert report["device"] == "cpu" and report["quick"] is True and report["dtype"] == "float32"
    for key in ("torch", "triton", "cuda", "peak_bandwidth_gb_per_s", "rows", "skipped"):
        assert key in report
    runs = {(row["op"], row["impl"], row["mode"]) for row in report["rows"]}
    for op in ("rms_norm", "swiglu"):
        for impl in ("colo-triton", "torch"):
            assert {(op, impl, "forward"), (op, impl, "forward+backward")} <= runs
    assert {("adamw", "colo-triton", "step"), ("adamw", "torch", "step")} <= runs
    for row in report["rows"]:
        assert "error" not in row, row
        assert row["median_ms"] > 0 and row["gb_per_s"] > 0
        if row["mode"] == "forward":
            assert row["max_abs_diff_vs_torch"] < 1e-5  # the fp32 Triton output agrees with the reference
    assert "colo-triton" in capsys.readouterr().out  # the printed table


def test_module_entry_point_runs_its_triton_rows_without_triton_interpret_set(tmp_path):
    # the README's command, as a user types it: nobody has set TRITON_INTERPRET, and on a machine without CUDA the
    # Triton rows must still run (through the interpreter) rather than fail with "0 active drivers"
    path = tmp_path / "bench.json"
    environment = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-m", "colo.kernels.bench", "--quick", "--ops", "softmax", "--json", str(path)],
        capture_output=True, text=True, env=environment, timeout=180,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "softmax" in result.stdout and "colo-triton" in result.stdout
    triton_rows = [row for row in json.loads(path.read_text())["rows"] if row["impl"] == "colo-triton"]
    assert {row["mode"] for row in triton_rows} == {"forward", "forward+backward"}
    for row in triton_rows:
        assert "error" not in row, row
        assert row["median_ms"] > 0


def test_unknown_op_is_a_usage_error():
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--device", "cpu", "--quick", "--ops", "rms_norm,matmul"])
    assert exit_info.value.code == 2


@pytest.mark.parametrize(
    ("name", "bandwidth"),
    [("NVIDIA H100 80GB HBM3", 3350.0), ("NVIDIA H200", 4800.0), ("NVIDIA H100 PCIe", 2000.0), ("Tesla T4", None)],
)
def test_peak_bandwidth_comes_from_the_device_name(name, bandwidth):
    assert bench.device_peaks(name)[0] == bandwidth
