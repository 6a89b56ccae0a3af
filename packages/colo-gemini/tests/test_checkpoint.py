"""Checkpoints through colo's common format: a same-layout resume is bit-exact in fp32; a checkpoint saved on two
ranks with one placement loads on one rank with another (every tensor equal, later losses within rtol 1e-5: the
gradient is then reduced in another order); ZeRO checkpoints load into Gemini and back."""

from __future__ import annotations

import pytest
import torch

from colo.comm import Mesh
from colo.comm.testing import load_beside, run_distributed

h = load_beside(__file__, "_helpers.py", module_name="colo_gemini_test_helpers")


def _checkpoint_resume(path, budget):
    model, gemini, n, rank = h.build(budget)
    h.train_steps(model, gemini, range(3), num_shares=n, share=rank)
    gemini.save(path, metadata={"data_step": 3})
    saved = gemini.full_params()
    uninterrupted = h.train_steps(model, gemini, range(3, 5), num_shares=n, share=rank)
    gemini.close()
    model, resumed, n, rank = h.build(budget, seed=1)  # other initial values: all must come from the checkpoint
    metadata = resumed.load(path)
    loaded = resumed.full_params()
    losses = h.train_steps(model, resumed, range(3, 5), num_shares=n, share=rank)
    resumed.close()
    same = all(torch.equal(loaded[name], saved[name]) for name in saved)
    adam_step = metadata["optimizer"]["scalars"]["embed.weight"]["step"][0]
    return uninterrupted, losses, same, metadata["data_step"], adam_step


def test_checkpoint_resume_is_bit_exact_on_the_same_layout(tmp_path):
    path = str(tmp_path / "step-3")
    for uninterrupted, resumed, same, data_step, adam_step in run_distributed(
        _checkpoint_resume, path, "disk", world_size=2
    ):
        assert same and (data_step, adam_step) == (3, 3)
        assert resumed == uninterrupted  # fp32, same layout, same placement: bit for bit


def _save_then_continue(path):
    model, gemini, n, rank = h.build("host_offload")
    h.train_steps(model, gemini, range(3), num_shares=n, share=rank)
    gemini.save(path)
    saved = gemini.full_params()
    later = h.train_steps(model, gemini, range(3, 5), num_shares=n, share=rank)
    gemini.close()
    return saved, later


def _load_on_one_rank(path):
    model, gemini, _, _ = h.build("auto_small_device", seed=1)
    gemini.load(path)
    loaded = gemini.full_params()
    losses = h.train_steps(model, gemini, range(3, 5), num_shares=1, share=0)  # the whole global batch on one rank
    gemini.close()
    return loaded, losses


def test_checkpoint_saved_on_two_ranks_loads_on_one_with_another_placement(tmp_path):
    path = str(tmp_path / "step-3")
    results = run_distributed(_save_then_continue, path, world_size=2)
    saved = results[0][0]
    loaded, losses = run_distributed(_load_on_one_rank, path, world_size=1)[0]
    assert saved.keys() == loaded.keys()
    for name in saved:  # the loaded masters are the saved ones, exactly
        assert torch.equal(loaded[name], saved[name]), name
    # the next losses agree with the 2-rank run's (mean of its ranks): the gradient is reduced in another order
    two_rank = [sum(values) / 2 for values in zip(*[later for _, later in results])]
    assert losses == pytest.approx(two_rank, rel=1e-5)


# --- interchange with colo.zero ---------------------------------------------------------------------------------


def _zero_save(path):
    from colo.zero import ZeroOptimizer

    mesh = Mesh(dp=torch.distributed.get_world_size())
    n, rank = mesh.size("dp"), mesh.rank("dp")
    model, _ = h.make_models()
    zero = ZeroOptimizer(model, torch.optim.AdamW(h.param_groups(model)), mesh=mesh, stage=3, chunk_numel=1000)
    for step in range(2):
        tokens, targets = h.batch(step, rows=n * h.ROWS_PER_RANK)
        mine = slice(rank * h.ROWS_PER_RANK, (rank + 1) * h.ROWS_PER_RANK)
        zero.backward(model(tokens[mine], targets[mine]))
        zero.step()
        zero.zero_grad()
    zero.save(path)
    return zero.full_params(), zero.full_optimizer_states()


def _gemini_load_then_save(path, path_back):
    model, gemini, _, _ = h.build("disk")
    gemini.load(path)
    params = gemini.full_params()
    states = {}
    for chunk in gemini.trainable_chunks:  # one rank: the shards are the whole chunks
        values = gemini.hybrid.read(chunk)
        for slot in chunk.slots:
            for name in ("exp_avg", "exp_avg_sq"):
                states[f"{slot.name}/{name}"] = chunk.slot_view(values[name], slot).detach().clone()
    gemini.save(path_back)
    gemini.close()
    return params, states


def _zero_load(path):
    from colo.zero import ZeroOptimizer

    mesh = Mesh(dp=torch.distributed.get_world_size())
    model, _ = h.make_models(seed=1)
    zero = ZeroOptimizer(model, torch.optim.AdamW(h.param_groups(model)), mesh=mesh, stage=2)
    zero.load(path)
    return zero.full_params()


def test_zero_checkpoints_load_into_gemini_and_back(tmp_path):
    zero_path, back_path = str(tmp_path / "zero"), str(tmp_path / "gemini")
    zero_params, zero_states = run_distributed(_zero_save, zero_path, world_size=2)[0]
    params, states = run_distributed(_gemini_load_then_save, zero_path, back_path, world_size=1)[0]
    for name in zero_params:  # ZeRO-3 on 2 ranks -> Gemini on 1 rank with a disk tier: every tensor equal
        assert torch.equal(params[name], zero_params[name]), name
    for name in zero_states:
        assert torch.equal(states[name], zero_states[name]), name
    for name, value in run_distributed(_zero_load, back_path, world_size=2)[0].items():
        assert torch.equal(value, zero_params[name]), name
