"""ZeRO state through the common checkpoint format: a same-layout resume is bit-exact in fp32, and a run saved at
one data-parallel size (and stage, and chunk size) loads at another with every tensor equal.

After a cross-layout load the later losses agree with the run that did not switch within rtol 1e-5: each rank now
averages a different slice of the global batch and the reduction sums in another order, so the last bits differ.
"""

from __future__ import annotations

import pytest
import torch

from colo.comm import Mesh, all_reduce
from colo.comm.testing import load_beside, run_distributed
from colo.tensor.checkpoint import CheckpointError, read_index
from colo.zero import MixedPrecision, ZeroOptimizer

_models = load_beside(__file__, "_models.py", module_name="colo_zero_test_models")
GLOBAL_ROWS = 8
"""Rows of every step's global batch, the same at any data-parallel size."""


def _build(stage, *, seed=0, chunk_numel=48, mixed=False):
    mesh = Mesh(dp=torch.distributed.get_world_size())
    model, _ = _models.make_models(seed=seed)
    zero = ZeroOptimizer(
        model,
        torch.optim.AdamW(_models.param_groups(model), lr=1e-2),
        mesh=mesh,
        stage=stage,
        chunk_numel=chunk_numel,
        mixed_precision=MixedPrecision(param_dtype=torch.bfloat16) if mixed else None,
    )
    return mesh, model, zero


def _train(mesh, model, zero, steps):
    """Run ``steps`` (global step numbers); return the global mean loss of each."""
    n, rank = mesh.size("dp"), mesh.rank("dp")
    rows = GLOBAL_ROWS // n
    losses = []
    for step in steps:
        tokens, targets = _models.batch(step, rows=GLOBAL_ROWS)
        mine = slice(rank * rows, (rank + 1) * rows)
        loss = model(tokens[mine], targets[mine])
        zero.backward(loss)
        zero.step()
        zero.zero_grad()
        total = loss.detach().float().reshape(1)
        all_reduce(total, group=mesh.group("dp"))
        losses.append(total.item() / n)
    return losses


def _resume(stage, path, mixed):
    mesh, model, zero = _build(stage, mixed=mixed)
    _train(mesh, model, zero, range(2))
    zero.save(path, metadata={"step": 2})
    uninterrupted = _train(mesh, model, zero, range(2, 5))
    expected_params, expected_states = zero.full_params(), zero.full_optimizer_states()

    mesh, model, zero = _build(stage, seed=1, mixed=mixed)  # another initialisation: everything must come from disk
    metadata = zero.load(path)
    resumed = _train(mesh, model, zero, range(2, 5))
    params, states = zero.full_params(), zero.full_optimizer_states()
    assert metadata["step"] == 2
    assert resumed == uninterrupted
    assert params.keys() == expected_params.keys() and states.keys() == expected_states.keys()
    assert all(torch.equal(params[name], expected_params[name]) for name in params)
    assert all(torch.equal(states[name], expected_states[name]) for name in states)
    return len(states)


@pytest.mark.parametrize("stage, mixed", [(1, False), (2, False), (3, False), (2, True)])
def test_same_layout_resume_is_bit_exact(stage, mixed, tmp_path):
    num_states = run_distributed(_resume, stage, str(tmp_path / "ckpt"), mixed, world_size=2)[0]
    assert num_states == 2 * 7  # exp_avg and exp_avg_sq of the seven trainable parameters


def _save_and_continue(stage, chunk_numel, path):
    mesh, model, zero = _build(stage, chunk_numel=chunk_numel)
    _train(mesh, model, zero, range(2))
    zero.save(path)
    saved = (zero.full_params(), zero.full_optimizer_states())
    return saved, _train(mesh, model, zero, range(2, 5))


def _load_and_continue(stage, chunk_numel, path):
    mesh, model, zero = _build(stage, seed=1, chunk_numel=chunk_numel)
    zero.load(path)
    loaded = (zero.full_params(), zero.full_optimizer_states())
    return loaded, _train(mesh, model, zero, range(2, 5))


@pytest.mark.parametrize(
    "saved_at, loaded_at",
    [
        ((4, 2, 48), (2, 3, None)),  # dp=4 ZeRO-2 -> dp=2 ZeRO-3 with searched chunks
        ((2, 1, 64), (4, 3, 32)),  # dp=2 ZeRO-1 -> dp=4 ZeRO-3
        ((2, 3, 48), (1, 2, 40)),  # dp=2 ZeRO-3 -> one process
    ],
)
def test_a_checkpoint_loads_at_another_data_parallel_size(saved_at, loaded_at, tmp_path):
    path = str(tmp_path / "ckpt")
    (world, stage, chunk_numel), (new_world, new_stage, new_chunk_numel) = saved_at, loaded_at
    (saved_params, saved_states), uninterrupted = run_distributed(
        _save_and_continue, stage, chunk_numel, path, world_size=world
    )[0]
    (params, states), resumed = run_distributed(
        _load_and_continue, new_stage, new_chunk_numel, path, world_size=new_world
    )[0]
    for saved, loaded in ((saved_params, params), (saved_states, states)):
        assert saved.keys() == loaded.keys()
        for name in saved:
            assert torch.equal(loaded[name], saved[name]), name
    assert resumed == pytest.approx(uninterrupted, rel=1e-5)


def test_the_checkpoint_is_the_common_format_with_flat_pieces(tmp_path):
    path = str(tmp_path / "ckpt")
    run_distributed(_save_and_continue, 2, 48, path, world_size=2)
    index = read_index(path)
    assert index.tensors["up.weight"].shape == (10, 6)
    assert "optim/up.weight/exp_avg" in index.tensors
    assert "frozen.weight" in index.tensors and "optim/frozen.weight/exp_avg" not in index.tensors
    assert "lm_head.weight" not in index.tensors  # tied to embed.weight: saved once, under its first name
    pieces = [piece for entry in index.tensors.values() for piece in entry.pieces]
    assert any(piece.flat_range is not None for piece in pieces)
    assert {piece.file for piece in pieces} == {"rank-00000.safetensors", "rank-00001.safetensors"}
    assert index.metadata["optimizer"]["param_groups"][1]["lr"] == 2e-2


def _load_into_another_model(path):
    mesh = Mesh(dp=torch.distributed.get_world_size())
    model, _ = _models.make_models(frozen=False)  # no ``frozen`` layer
    zero = ZeroOptimizer(model, torch.optim.AdamW(_models.param_groups(model), lr=1e-2), mesh=mesh, stage=2)
    try:
        zero.load(path)
    except CheckpointError as error:
        return str(error)
    return None


def test_loading_into_a_different_model_names_the_mismatch(tmp_path):
    path = str(tmp_path / "ckpt")
    run_distributed(_save_and_continue, 2, 48, path, world_size=2)
    message = run_distributed(_load_into_another_model, path, world_size=2)[0]
    assert message is not None and "does not match the model" in message and "frozen.weight" in message
