"""Measured launch configurations (`colo.kernels.tuning`) and plain attention through SDPA: the parts that run
without a GPU (the file format, the matching rules, the env override, SDPA on colo's layout)."""

from __future__ import annotations

import importlib
import json

import pytest
import torch

from colo.kernels import tuning

fa = importlib.import_module("colo.kernels.flash_attention")

ENTRIES = [
    {"kernel": "flash_attention.forward", "capability": [9, 0], "match": {"head_dim": 64}, "config": {"BLOCK_M": 1}},
    {"kernel": "flash_attention.forward", "capability": [9, 0], "match": {}, "config": {"BLOCK_M": 2}},
    {"kernel": "flash_attention.forward", "capability": [8, 0], "match": {}, "config": {"BLOCK_M": 3}},
]


def test_the_first_entry_whose_match_agrees_wins():
    assert tuning.matching_config(ENTRIES, "flash_attention.forward", (9, 0), head_dim=64) == {"BLOCK_M": 1}
    # a property the entry's match leaves out matches any value; one it names must be equal
    assert tuning.matching_config(ENTRIES, "flash_attention.forward", (9, 0), head_dim=128) == {"BLOCK_M": 2}
    assert tuning.matching_config(ENTRIES, "flash_attention.forward", (8, 0), head_dim=64) == {"BLOCK_M": 3}
    assert tuning.matching_config(ENTRIES, "flash_attention.forward", (7, 5)) is None
    assert tuning.matching_config(ENTRIES, "rms_norm.forward", (9, 0)) is None


def test_cpu_tensors_never_get_a_tuned_configuration(tmp_path, monkeypatch):
    path = tmp_path / "tuning.json"
    path.write_text(json.dumps({"entries": ENTRIES}))
    monkeypatch.setenv(tuning.TUNING_ENV, str(path))
    tuning.clear_cache()
    try:
        assert tuning.tuned_config("flash_attention.forward", torch.device("cpu"), head_dim=64) is None
    finally:
        tuning.clear_cache()


def test_a_bad_tuning_file_is_refused_by_name(tmp_path, monkeypatch):
    monkeypatch.setenv(tuning.TUNING_ENV, str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="COLO_KERNEL_TUNING=.*missing.json: no such file"):
        tuning._entries()
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"entries": [{"kernel": "adamw"}]}))
    monkeypatch.setenv(tuning.TUNING_ENV, str(broken))
    with pytest.raises(ValueError, match=r"entries\[0\] needs the fields kernel, capability, config"):
        tuning._entries()
    tuning.clear_cache()


def test_the_packaged_tuning_file_is_valid():
    entries = tuning._load(str(tuning.DEFAULT_TUNING_PATH))
    for entry in entries:
        assert entry["kernel"].split(".")[0] in ("flash_attention", "rms_norm", "adamw"), entry
        if entry["kernel"].startswith("flash_attention.") and entry["kernel"] != "flash_attention.plain":
            assert set(entry["config"]) <= fa._CONFIG_KEYS, entry


@pytest.mark.parametrize("causal", [False, True])
def test_sdpa_on_colos_layout_matches_the_reference(causal):
    """The SDPA path takes colo's (batch, seq, heads, head_dim) layout and grouped-query heads as they are."""
    q = torch.randn(2, 37, 8, 16, requires_grad=True)
    k, v = (torch.randn(2, 37, 2, 16, requires_grad=True) for _ in range(2))
    out = fa._sdpa_attention(q, k, v, causal, 0.25)
    expected = fa.flash_attention_reference(q, k, v, causal=causal, scale=0.25)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    upstream = torch.randn_like(out)
    for got, want in zip(
        torch.autograd.grad(out, (q, k, v), upstream), torch.autograd.grad(expected, (q, k, v), upstream)
    ):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_plain_attention_choice_is_validated_and_cpu_keeps_colos_kernel(monkeypatch):
    monkeypatch.setenv(fa.PLAIN_ATTENTION_ENV, "flash")
    with pytest.raises(ValueError, match="COLO_PLAIN_ATTENTION='flash': use auto, sdpa or triton"):
        fa._plain_attention_implementation(0, "bfloat16", 64, True)
    monkeypatch.setenv(fa.PLAIN_ATTENTION_ENV, "sdpa")
    q = torch.randn(1, 8, 2, 16, dtype=torch.bfloat16)
    assert not fa._plain_attention_runs_sdpa(q, q, True)  # CPU tensors: the choice applies to CUDA only


def test_the_plain_attention_choice_is_marked_constant_as_torch_compiler_marks_it():
    """`flash_attention` marks its tuned choice constant for ``torch.compile`` without importing ``torch._dynamo``;
    the mark must be exactly what ``torch.compiler.assume_constant_result`` sets."""
    flash_attention = importlib.import_module("colo.kernels.flash_attention")  # the package exports the function
    marked = torch.compiler.assume_constant_result(lambda: None)
    marks = dict(vars(marked))
    assert marks, "torch.compiler.assume_constant_result no longer marks the function; colo's mark is stale"
    chosen = flash_attention._plain_attention_implementation
    assert {name: getattr(chosen, name, None) for name in marks} == marks
