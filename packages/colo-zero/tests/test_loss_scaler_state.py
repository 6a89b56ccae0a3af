"""`DynamicLossScaler.state_dict` / `load_state_dict`: what checkpoints save of the scaler, and nothing else."""

from __future__ import annotations

import json

import pytest

from colo.zero import DynamicLossScaler


def test_the_scaler_state_round_trips_through_json_and_continues_identically():
    scaler = DynamicLossScaler(init_scale=2.0**10, growth_interval=3)
    for found_inf in (False, True, False, False):
        scaler.update(found_inf)
    restored = DynamicLossScaler(init_scale=2.0**10, growth_interval=3)
    restored.load_state_dict(json.loads(json.dumps(scaler.state_dict())))
    assert restored.state_dict() == scaler.state_dict() == {"scale": 512.0, "clean_steps": 2, "num_skipped": 1}
    for found_inf in (False, False, True):  # both grow at the same step, then back off together
        scaler.update(found_inf)
        restored.update(found_inf)
        assert restored.state_dict() == scaler.state_dict()


def test_an_unknown_key_is_refused_by_name():
    with pytest.raises(ValueError, match=r"unknown keys \['growth'\]"):
        DynamicLossScaler().load_state_dict({"scale": 1.0, "growth": 2})
