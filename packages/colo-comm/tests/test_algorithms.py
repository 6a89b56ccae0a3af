"""The algorithm table picks an implementation per backend and size, and can be forced or loaded."""

from __future__ import annotations

import json

import pytest

from colo.comm import algorithms
from colo.comm.algorithms import choose_algorithm, force_algorithm, load_algorithm_table


@pytest.fixture(autouse=True)
def _fresh_table():
    algorithms._table.clear()
    yield
    algorithms._table.clear()


def test_gloo_switches_forms_at_the_measured_sizes():
    assert choose_algorithm("reduce_scatter", "gloo", (1 << 20) - 1) == "native"
    assert choose_algorithm("reduce_scatter", "gloo", 1 << 20) == "p2p"
    assert choose_algorithm("reduce_scatter", "nccl", 1 << 30) == "native"
    assert choose_algorithm("all_gather", "gloo", (1 << 20) - 1) == "native"
    assert choose_algorithm("all_gather", "gloo", 1 << 20) == "p2p"
    assert choose_algorithm("all_gather", "nccl", 1 << 30) == "native"
    assert choose_algorithm("all_reduce", "gloo", 1 << 30) == "native"


def test_forcing_overrides_the_table_inside_the_block_only():
    with force_algorithm("reduce_scatter", "all_reduce"):
        assert choose_algorithm("reduce_scatter", "nccl", 10) == "all_reduce"
    assert choose_algorithm("reduce_scatter", "nccl", 10) == "native"
    with pytest.raises(ValueError, match="choose from"):
        with force_algorithm("reduce_scatter", "tree"):
            pass


def test_a_calibrated_table_is_loaded_and_validated(tmp_path):
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"table": {"gloo": {"reduce_scatter": [[0, "native"], [4096, "all_reduce"]]}}}))
    load_algorithm_table(path)
    assert choose_algorithm("reduce_scatter", "gloo", 4096) == "all_reduce"
    path.write_text(json.dumps({"table": {"gloo": {"reduce_scatter": [[0, "tree"]]}}}))
    with pytest.raises(ValueError, match="unknown"):
        load_algorithm_table(path)


def test_the_environment_variable_points_at_a_calibrated_table(tmp_path, monkeypatch):
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"table": {"gloo": {"reduce_scatter": [[0, "all_reduce"]]}}}))
    monkeypatch.setenv("COLO_COMM_ALGORITHMS", str(path))
    assert choose_algorithm("reduce_scatter", "gloo", 10) == "all_reduce"
