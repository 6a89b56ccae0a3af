"""Packed rows in the GRPO update under sequence parallelism (``grpo.pack_rows`` with Ulysses and ring attention).

Each rollout microbatch's rows are packed as without sp (`colo.apps.rlhf.packing`: each row's segment a document of
its own, positions from 0), into rows of twice the batch's width rounded up to the layout's chunks (Ulysses: sp; ring:
2 sp zigzag chunks), and each packed row is split over sp like any row: each rank runs its piece (its tokens and
positions; the whole rows' document ids, which every attention core cuts as it cuts the sequence, as the pretraining
path passes them), scores the response tokens its piece predicts, and the values are gathered over sp and scattered
back to the ``(R, T)`` rollout rows (`colo.apps.rlhf.sequence_logps.split_selected_token_logps`).

1. The update, on the hand-made batch of `test_rlhf_grpo_pack` (prompts of 2-6 tokens left-padded to 6, responses of
   0-9 tokens right-padded to 9: 8 rows of 15), under sp2 (Ulysses: 2 packed rows of 30; ring: 2 packed rows of 32,
   segments across the 8-token zigzag chunks): the log-probs and entropies, the GRPO loss (clipped ratio, k3 KL,
   seq-mean-token-mean) and every parameter gradient (the per-rank gradients averaged over sp, as the data-parallel
   reduction over ``("dp", "sp")`` does) equal the padded single-process update's (log-probs atol 1e-5; loss and
   gradients rtol 1e-5, atol 1e-6; fp32: attention runs on pieces, ring's blockwise online softmax, so not
   bit-identical). The forward's only all-gather over sp is the ``2 x rows x packed width`` per-token values.
2. The trainer: ``data.task: grpo`` with ``grpo.pack_rows: true`` under ``plugin.name: hybrid, sp: 2`` (ring; the
   policy's update, its old log-probs and the frozen reference's forward packed) logs the padded single-process DDP
   run's losses, gradient norms, KL and entropy (rtol 1e-5), a log-prob mismatch below 1e-5, and the share of padded
   positions it did not compute.
"""

from __future__ import annotations

import pytest
import torch

from colo.comm.testing import load_beside, run_distributed


def _pack_test():
    """The packed-rows helpers of the single-process test (its model, batch, criterion and padded update)."""
    return load_beside(__file__, "test_rlhf_grpo_pack.py", module_name="colo_apps_test_rlhf_grpo_pack")


def _sp_model(sp_mode: str):
    """The packed-rows policy laid out by colo's Llama plan under ``HybridParallel(sp=2)``."""
    from colo.apps import HybridParallel
    from colo.apps.booster.llama_plan import LlamaPlan

    plugin = HybridParallel(sp=2, sp_mode=sp_mode)
    mesh = plugin.build_mesh()
    model = _pack_test()._model(pack_rows=True)
    LlamaPlan().apply(model, mesh=mesh, plugin=plugin)
    return model, mesh


def _update_case(sp_mode: str) -> dict:
    from colo.apps.rlhf import GRPOCriterion, global_counts
    from colo.comm import CommTracker, all_reduce

    helpers = _pack_test()
    padded, padded_loss, padded_grads, _ = helpers._loss_and_grads(pack_rows=False)  # one process, padded rows
    model, mesh = _sp_model(sp_mode)
    group = mesh.group("sp")
    batch = helpers._batch()
    inputs = {key: batch[key] for key in helpers._INPUTS}
    criterion = GRPOCriterion(loss_aggregation="seq-mean-token-mean", beta=0.1, eps_low=0.2, eps_high=0.28)
    counts = global_counts(batch["response_mask"], max_new_tokens=helpers.RESPONSE)
    criterion.prepare(counts, num_microbatches=1, num_data_ranks=1)
    with CommTracker() as tracker:
        output = model(**inputs)
    loss = criterion(output, batch)
    loss.backward()
    mismatches = []
    mask = batch["response_mask"].float()
    for key in ("logps", "entropy"):
        try:
            torch.testing.assert_close(output[key], padded[key] * mask, rtol=1e-5, atol=1e-5)
        except AssertionError as error:
            mismatches.append(f"{key}: {error}")
    if float(loss) != pytest.approx(float(padded_loss), rel=1e-5, abs=1e-6):
        mismatches.append(f"loss {float(loss)} vs {float(padded_loss)}")
    for name, param in model.named_parameters():
        grad = param.grad.clone()
        all_reduce(grad, "sum", group=group)  # the data-parallel mean over ("dp", "sp") of the per-rank gradients
        try:
            torch.testing.assert_close(grad / group.size, padded_grads[name], rtol=1e-5, atol=1e-6)
        except AssertionError as error:
            mismatches.append(f"grad {name}: {error}")
    return {
        "mismatches": mismatches,
        "num_grads": len(padded_grads),
        "pack_tokens": list(model.pack_tokens),
        "all_gathers": tracker.calls("all_gather", axis="sp"),
        "all_gather_bytes": tracker.bytes("all_gather", axis="sp"),
        "loss": float(loss),
    }


@pytest.mark.parametrize("sp_mode,width", [("ulysses", 30), ("ring", 32)])
def test_packed_update_under_sp2_equals_the_padded_single_process_update(sp_mode, width):
    results = run_distributed(_update_case, sp_mode, world_size=2, timeout=120)
    for result in results:
        assert result["num_grads"] > 0 and not result["mismatches"], result["mismatches"][:4]
        assert abs(result["loss"]) > 1e-3
        # 8 rows of 15 positions; the 56 positions the segments need in 2 packed rows of 2 x 15 (ring: rounded up to
        # its 4 zigzag chunks, 32)
        assert result["pack_tokens"] == [120, 2 * width]
        # one all-gather over sp of (log-prob, entropy) per packed position: (n - 1) / n of 2 x 2 x width floats
        assert result["all_gathers"] == 1 and result["all_gather_bytes"] == 2 * 2 * width * 4 // 2, result
    assert results[0]["loss"] == results[1]["loss"]


# --- 2. the trainer ------------------------------------------------------------------------------------------------


def varied_reward(prompts, completions, **_) -> list[float]:
    """A reward that varies within a group: the share of digits in the completion."""
    return [sum(c.isdigit() for c in text) / max(len(text), 1) for text in completions]


def _sp_test():
    return load_beside(__file__, "test_rlhf_grpo_sp.py", module_name="colo_apps_test_rlhf_grpo_sp")


def _trainer_config(output_dir: str, **changes) -> dict:
    # test_rlhf_grpo_sp's short run (2 SFT + 2 GRPO steps), scored by this module's reward
    return _sp_test()._trainer_config(output_dir, **{"grpo.reward_functions": f"[{__name__}:varied_reward]", **changes})


def test_grpo_run_with_packed_rows_under_hybrid_sp2_ring_matches_the_padded_run(tmp_path):
    padded_dir, packed_dir, sp = tmp_path / "padded", tmp_path / "packed", _sp_test()
    padded = run_distributed(sp._train, _trainer_config(str(padded_dir)), world_size=1, timeout=180)[0]["losses"]
    hybrid = {"plugin.name": "hybrid", "plugin.sp": 2, "plugin.sp_mode": "ring", "grpo.pack_rows": "true"}
    packed = run_distributed(sp._train, _trainer_config(str(packed_dir), **hybrid), world_size=2, timeout=180)
    assert packed[0]["losses"] == packed[1]["losses"]
    assert sorted(padded) == sorted(packed[0]["losses"]) == [1, 2, 3, 4]
    expected, actual = sp._metrics(padded_dir), sp._metrics(packed_dir)
    for step in (1, 2, 3, 4):  # 2 SFT steps, then 2 GRPO steps (the update, old log-probs and reference packed)
        assert packed[0]["losses"][step] == pytest.approx(padded[step], rel=1e-5, abs=1e-7), step
        names = ["grad_norm"] + (["grpo/entropy", "grpo/kl", "grpo/reward_mean"] if step > 2 else [])
        for name in names:
            assert actual[step][name] == pytest.approx(expected[step][name], rel=1e-5, abs=1e-7), (step, name)
    for step in (3, 4):
        assert actual[step]["grad_norm"] > 0.1 and actual[step]["grpo/reward_std"] > 0
        assert actual[step]["grpo/logprob_mismatch_max"] < 1e-5  # rollout log-probs == the packed sp recompute
        assert "grpo/pack_padding_saved" not in expected[step]
        # reported; here nothing is saved: every completion runs to the 4-token budget and the prompts differ by a
        # token or two, so two segments fill each packed row of twice the width as two padded rows did; with rows of
        # 11 the packed rows are rounded up to ring's 4 chunks (24), 96 positions where the padded rows hold 88 (the
        # padded sp forward computes 96 too: each row of 11 padded to 12)
        assert actual[step]["grpo/pack_padding_saved"] in (pytest.approx(0.0), pytest.approx(1 - 96 / 88))
