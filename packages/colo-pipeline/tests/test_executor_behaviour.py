"""What the executor promises besides matching the reference: B/W split, metadata once, the callback, errors."""

from __future__ import annotations

import torch
from torch import nn

from colo.comm import CommTracker, Mesh
from colo.comm.testing import run_distributed
from colo.pipeline import PipelineExecutor, one_f_one_b, zero_bubble_h1


def _tiny_stage(rank):
    torch.manual_seed(rank)
    return nn.Sequential(nn.Linear(4, 4), nn.Tanh())


def _mse(out, target):
    return ((out - target) ** 2).mean()


def _b_then_w():
    """On every rank: a B leaves all .grad unchanged, the matching W changes them."""
    mesh = Mesh(pp=2)
    stage = _tiny_stage(mesh.rank("pp"))
    params = list(stage.parameters())
    snapshot = {"grads": [None for _ in params]}
    seen = []

    def grads_now():
        return [None if p.grad is None else p.grad.clone() for p in params]

    def same(a, b):
        return all(
            (x is None and y is None) or (x is not None and y is not None and torch.equal(x, y)) for x, y in zip(a, b)
        )

    def check(action):
        now = grads_now()
        if action.op == "B":
            seen.append(("B", same(now, snapshot["grads"])))
        elif action.op == "W":
            seen.append(("W", not same(now, snapshot["grads"])))
        snapshot["grads"] = now

    executor = PipelineExecutor(stage, schedule=zero_bubble_h1(2, 4), mesh=mesh, loss_fn=_mse, on_action=check)
    executor.step(torch.randn(8, 4), torch.randn(8, 4))
    return seen


def test_b_leaves_weight_grads_unchanged_and_w_produces_them():
    for seen in run_distributed(_b_then_w, world_size=2):
        assert sorted(op for op, _ in seen) == ["B"] * 4 + ["W"] * 4
        assert all(ok for _, ok in seen), seen


def _metadata_and_callback():
    mesh = Mesh(pp=2)
    stage = _tiny_stage(mesh.rank("pp"))
    calls = []
    executor = PipelineExecutor(
        stage,
        schedule=one_f_one_b(2, 4),
        mesh=mesh,
        loss_fn=_mse,
        on_backward_end=lambda: calls.append(len(executor_actions)),
        on_action=lambda action: executor_actions.append(action),
    )
    executor_actions = []
    metadata_messages, activation_bytes = [], []
    for _ in range(3):
        executor_actions.clear()
        with CommTracker() as tracker:
            executor.step(torch.randn(8, 4), torch.randn(8, 4))
        metadata_messages.append(sum(1 for r in tracker.records if r.dtype == "torch.uint8"))
        activation_bytes.append(tracker.bytes("send", axis="pp") + tracker.bytes("recv", axis="pp"))
    return metadata_messages, activation_bytes, calls, len(executor.schedule.actions[mesh.rank("pp")])


def test_metadata_travels_once_and_the_callback_runs_after_the_last_action():
    for metadata_messages, activation_bytes, calls, num_actions in run_distributed(
        _metadata_and_callback, world_size=2
    ):
        assert metadata_messages == [1, 0, 0]  # one boundary: sent (rank 0) or received (rank 1) once
        # every step moves 4 activations and 4 gradients of shape (2, 4) float32 through this rank
        assert activation_bytes[1:] == [2 * 4 * 2 * 4 * 4] * 2
        assert calls == [num_actions] * 3


def _bad_inputs():
    mesh = Mesh(pp=2)
    errors = {}
    for name, build in {
        "mesh": lambda: PipelineExecutor(_tiny_stage(0), schedule=one_f_one_b(4, 4), mesh=mesh, loss_fn=_mse),
        "chunks": lambda: PipelineExecutor([_tiny_stage(0)] * 2, schedule=one_f_one_b(2, 4), mesh=mesh, loss_fn=_mse),
        "loss": lambda: PipelineExecutor(_tiny_stage(0), schedule=one_f_one_b(2, 4), mesh=mesh),
        "axis": lambda: PipelineExecutor(_tiny_stage(0), schedule=one_f_one_b(2, 4), mesh=mesh, axis="dp"),
    }.items():
        try:
            build()
        except ValueError as error:
            errors[name] = str(error)
    executor = PipelineExecutor(_tiny_stage(0), schedule=one_f_one_b(2, 4), mesh=mesh, loss_fn=_mse)
    try:
        executor.step(torch.randn(6, 4), torch.randn(6, 4))  # every rank gets the batch, so every rank checks
    except ValueError as error:
        errors["batch"] = str(error)
    return errors


def test_bad_configuration_fails_on_every_rank_before_communicating():
    for errors in run_distributed(_bad_inputs, world_size=2):
        assert "build the schedule with num_ranks=2" in errors["mesh"]
        assert "pass one module per chunk" in errors["chunks"]
        assert "batch size 6 is not divisible by num_microbatches=4" in errors["batch"]
        assert "axis='dp' is not an axis of the mesh" in errors["axis"]
        assert "loss_fn is required" in errors["loss"]
