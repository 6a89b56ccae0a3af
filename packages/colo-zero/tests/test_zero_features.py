"""ZeRO against torch DDP step by step, stage 0, ``no_sync``, optimizer offload, backward prefetch, execution-order
packing and gradient clipping over a tensor-parallel axis.

Tolerances (fp32): rtol = atol = 1e-5 against DDP or a single process, for the reduction-order reasons given in
test_zero_stages.py. Offloading changes where tensors live, not the arithmetic, so it is compared bit for bit.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from colo.comm import CommTracker, Mesh
from colo.comm.testing import load_beside, run_distributed
from colo.zero import ZeroOptimizer, execution_order

_models = load_beside(__file__, "_models.py", module_name="colo_zero_test_models")
ROWS_PER_RANK = 4
FP32 = {"rtol": 1e-5, "atol": 1e-5}


def _zero(model, mesh, stage, **fields):
    optimizer = torch.optim.AdamW(_models.param_groups(model), lr=1e-2)
    return ZeroOptimizer(model, optimizer, mesh=mesh, stage=stage, chunk_numel=48, **fields)


def _local_batch(step, mesh):
    rank = mesh.rank("dp")
    tokens, targets = _models.batch(step, rows=mesh.size("dp") * ROWS_PER_RANK)
    mine = slice(rank * ROWS_PER_RANK, (rank + 1) * ROWS_PER_RANK)
    return tokens[mine], targets[mine]


# --- against torch DDP -------------------------------------------------------------------------------------------


def _against_ddp(stage):
    mesh = Mesh(dp=torch.distributed.get_world_size())
    model, reference = _models.make_models()
    zero = _zero(model, mesh, stage)
    ddp = nn.parallel.DistributedDataParallel(reference)
    ddp_optimizer = torch.optim.AdamW(_models.param_groups(reference), lr=1e-2)
    for step in range(5):
        tokens, targets = _local_batch(step, mesh)
        loss, ddp_loss = model(tokens, targets), ddp(tokens, targets)
        torch.testing.assert_close(loss, ddp_loss, **FP32)
        zero.backward(loss)
        ddp_loss.backward()
        grads = zero.full_grads()
        for name, p in reference.named_parameters():
            if p.requires_grad:
                torch.testing.assert_close(grads[name], p.grad, **FP32, msg=f"grad {name} step {step}")
        zero.step()
        zero.zero_grad()
        ddp_optimizer.step()
        ddp_optimizer.zero_grad()
    params = zero.full_params()
    for name, p in reference.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(params[name], p.detach(), **FP32, msg=name)


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_every_stage_matches_torch_ddp_step_by_step(stage):
    run_distributed(_against_ddp, stage, world_size=2)


# --- no_sync ------------------------------------------------------------------------------------------------------


def _no_sync_accumulation(stage):
    mesh = Mesh(dp=torch.distributed.get_world_size())
    model, reference = _models.make_models()
    zero = _zero(model, mesh, stage)
    reference_optimizer = torch.optim.AdamW(_models.param_groups(reference), lr=1e-2)
    tokens, targets = _models.batch(0, rows=mesh.size("dp") * ROWS_PER_RANK)
    reference(tokens, targets).backward()
    reference_optimizer.step()
    micro = list(zip(*(t.chunk(4) for t in _local_batch(0, mesh))))
    with CommTracker() as silent:
        with zero.no_sync():
            for micro_tokens, micro_targets in micro[:3]:
                zero.backward(model(micro_tokens, micro_targets) / 4)
    with CommTracker() as last:
        zero.backward(model(*micro[3]) / 4)
        zero.step()
    params = zero.full_params()
    for name, p in reference.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(params[name], p.detach(), **FP32, msg=name)
    return (
        silent.bytes("reduce_scatter") + silent.bytes("all_reduce"),
        last.calls("reduce_scatter"),
        len(zero.trainable_chunks),
    )


@pytest.mark.parametrize("stage", [2, 3])
def test_no_sync_accumulates_without_reducing_and_equals_the_big_batch(stage):
    for silent_bytes, last_calls, num_chunks in run_distributed(_no_sync_accumulation, stage, world_size=2):
        assert silent_bytes == 0
        assert last_calls == num_chunks  # one reduce-scatter per chunk, for the whole accumulation window


# --- offload -------------------------------------------------------------------------------------------------------


def _offload_equals_device(stage):
    mesh = Mesh(dp=torch.distributed.get_world_size())
    runs = []
    for offload in (False, True):
        model, _ = _models.make_models()
        zero = _zero(model, mesh, stage, offload_optimizer=offload)
        for step in range(3):
            zero.backward(model(*_local_batch(step, mesh)))
            zero.clip_grad_norm_(0.5)
            zero.step()
            zero.zero_grad()
        runs.append((zero.full_params(), zero))
    (device_params, _), (offloaded_params, zero) = runs
    for name in device_params:
        assert torch.equal(offloaded_params[name], device_params[name]), name
    chunk = zero.trainable_chunks[0]
    tiers = {name: buffer.tier for name, buffer in chunk.buffers.items()}
    grad_shard_bytes = sum(c.buffer("grad_shard").numel() * 4 for c in zero.trainable_chunks)
    return tiers, zero.memory_report(), grad_shard_bytes


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offloaded_optimizer_gives_the_same_parameters(stage):
    for tiers, report, grad_shard_bytes in run_distributed(_offload_equals_device, stage, world_size=2):
        assert tiers["master"] == tiers["grad_shard"] == tiers["optim/exp_avg"] == "host"
        assert tiers["param_shard" if stage == 3 else "param"] == "device"
        assert report.host == report.masters + report.optimizer_states + grad_shard_bytes > 0


# --- stage 3 backward prefetch and execution-order packing --------------------------------------------------------


class Reversed(nn.Module):
    """Layers registered in the reverse of the order forward calls them."""

    def __init__(self) -> None:
        super().__init__()
        self.third = nn.Linear(8, 8)
        self.second = nn.Linear(8, 8)
        self.first = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.third(torch.tanh(self.second(torch.tanh(self.first(x))))).square().mean()


def _prefetch(order):
    mesh = Mesh(dp=torch.distributed.get_world_size())
    torch.manual_seed(0)
    model = Reversed()
    reference = Reversed()
    reference.load_state_dict(model.state_dict())
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(mesh.rank("dp")))
    param_order = execution_order(model, x) if order == "execution" else None
    zero = ZeroOptimizer(
        model, torch.optim.AdamW(model.parameters()), mesh=mesh, stage=3, chunk_numel=72, param_order=param_order
    )
    with CommTracker() as tracker:
        zero.backward(model(x))
        grads = zero.full_grads()
    everyone = torch.cat([torch.randn(4, 8, generator=torch.Generator().manual_seed(r)) for r in range(2)])
    reference(everyone).backward()  # the mean of per-rank means equals the mean over both ranks' rows
    for name, p in reference.named_parameters():
        torch.testing.assert_close(grads[name], p.grad, **FP32)
    chunk_names = [[slot.name for slot in chunk.slots] for chunk in zero.chunks]
    gatherer = zero.gatherer
    return chunk_names, gatherer.num_gathers, gatherer.num_prefetch_hits, tracker.calls("all_gather")


def test_execution_order_packing_makes_every_gather_after_the_first_a_prefetch_hit():
    chunk_names, gathers, hits, all_gathers = run_distributed(_prefetch, "execution", world_size=2)[0]
    assert chunk_names == [[f"{layer}.weight", f"{layer}.bias"] for layer in ("first", "second", "third")]
    assert gathers == 6  # three chunks gathered in forward, three again in backward
    assert hits == 4  # all but the first gather of forward and the first of backward were prefetched
    assert all_gathers == 6 + 3  # and full_grads() gathers the three chunks' gradient shards


def test_registration_order_packing_still_trains_correctly_but_misses_prefetches():
    chunk_names, gathers, hits, _ = run_distributed(_prefetch, "registration", world_size=2)[0]
    assert chunk_names[0] == ["third.weight", "third.bias"]
    assert gathers == 6 and hits < 4


# --- clipping over a tensor-parallel axis ---------------------------------------------------------------------------


class TensorParallelMLP(nn.Module):
    """embed -> up (column-parallel) -> gelu -> down (row-parallel) -> head: a replicated embedding, head and down
    bias, and sharded up weight/bias and down weight."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 8)
        self.up = nn.Linear(8, 16)
        self.down = nn.Linear(16, 8)
        self.head = nn.Linear(8, 11)

    def forward(self, tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.down(F.gelu(self.up(self.embed(tokens)))))
        return F.cross_entropy(logits.reshape(-1, 11), targets.reshape(-1))


def _clip_over_tensor_parallel_axis(path=None):
    from colo.tensor import Colwise, Rowwise, parallelize

    mesh = Mesh(dp=1, tp=torch.distributed.get_world_size())
    torch.manual_seed(0)
    model = TensorParallelMLP()
    reference = TensorParallelMLP()
    reference.load_state_dict(model.state_dict())
    parallelize(model, mesh, {"up": Colwise(axis="tp"), "down": Rowwise(axis="tp")})
    zero = ZeroOptimizer(
        model, torch.optim.AdamW(model.parameters(), lr=1e-2), mesh=mesh, stage=2, tensor_parallel_axes=("tp",)
    )
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    norms = []
    for step in range(3):
        tokens, targets = _models.batch(step, rows=4)
        zero.backward(model(tokens, targets))
        reference(tokens, targets).backward()
        norm = zero.clip_grad_norm_(0.1)
        reference_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1)
        norms.append((norm, reference_norm.item()))
        zero.step()
        zero.zero_grad()
        reference_optimizer.step()
        reference_optimizer.zero_grad()
    params = zero.full_params()
    rank = mesh.rank("tp")
    for name in ("embed.weight", "head.weight", "down.bias"):  # replicated: equal to the reference
        torch.testing.assert_close(params[name], dict(reference.named_parameters())[name].detach(), **FP32)
    torch.testing.assert_close(params["up.weight"], reference.up.weight.detach().chunk(2, dim=0)[rank], **FP32)
    torch.testing.assert_close(params["down.weight"], reference.down.weight.detach().chunk(2, dim=1)[rank], **FP32)
    if path is not None:
        zero.save(path)
    return norms, params, zero.full_optimizer_states()


def _load_tensor_parallel_checkpoint_in_one_process(path):
    mesh = Mesh(dp=1)
    model = TensorParallelMLP()
    zero = ZeroOptimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-2), mesh=mesh, stage=1)
    zero.load(path)
    return zero.full_params(), zero.full_optimizer_states()


def test_clipping_counts_sharded_parameters_on_every_rank_and_replicated_ones_once():
    for norms, _, _ in run_distributed(_clip_over_tensor_parallel_axis, world_size=2):
        for norm, reference_norm in norms:
            assert norm == pytest.approx(reference_norm, rel=1e-5)
            assert norm > 0.1  # so the clipping itself was exercised


def test_a_tensor_parallel_zero_checkpoint_loads_unsharded_in_one_process(tmp_path):
    path = str(tmp_path / "ckpt")
    ranks = run_distributed(_clip_over_tensor_parallel_axis, path, world_size=2)
    params, states = run_distributed(_load_tensor_parallel_checkpoint_in_one_process, path, world_size=1)[0]
    dims = {"up.weight": 0, "up.bias": 0, "down.weight": 1}  # the column- and row-parallel shards
    for saved, loaded in ((ranks[0][1], params), (ranks[0][2], states)):
        for name, value in loaded.items():
            parameter = name.split("/")[0]
            if parameter in dims:
                expected = torch.cat([rank[1 if saved is ranks[0][1] else 2][name] for rank in ranks], dims[parameter])
            else:
                expected = saved[name]  # replicated: written once, by tensor-parallel rank 0
            assert torch.equal(value, expected), name


def _bad_config():
    mesh = Mesh(dp=torch.distributed.get_world_size())
    model, _ = _models.make_models()
    errors = []
    for fields in ({"tensor_parallel_axes": ("dp",)}, {"tensor_parallel_axes": ("tp",)}):
        try:
            _zero(model, mesh, 2, **fields)
        except ValueError as error:
            errors.append(str(error))
    try:
        ZeroOptimizer(model, mesh=mesh, param_order=["nope"])
    except ValueError as error:
        errors.append(str(error))
    return errors


def test_bad_axes_and_order_get_clear_errors():
    errors = run_distributed(_bad_config, world_size=2)[0]
    assert "both as data axes and as model-parallel axes" in errors[0]
    assert "not axes of the mesh" in errors[1]
    assert "param_order names ['nope']" in errors[2]


def _overlapped_param_gather(stage):
    mesh = Mesh(dp=torch.distributed.get_world_size())
    runs = []
    for overlap in (True, False):
        model, _ = _models.make_models()
        zero = _zero(model, mesh, stage, overlap_param_gather=overlap)
        losses, in_flight = [], []
        for step in range(3):
            loss = model(*_local_batch(step, mesh))  # with overlap, waits for each chunk's gather in its pre-hook
            in_flight.append(len(zero.param_sync.in_flight))
            zero.backward(loss)
            zero.step()
            zero.zero_grad()
            losses.append(loss.item())
        in_flight.append(len(zero.param_sync.in_flight))
        runs.append((losses, in_flight, zero.full_params()))
    return runs


@pytest.mark.parametrize("stage", [1, 2])
def test_the_parameter_gather_overlaps_the_next_forward_and_changes_nothing(stage):
    for (losses, in_flight, params), (sync_losses, sync_in_flight, sync_params) in run_distributed(
        _overlapped_param_gather, stage, world_size=2
    ):
        assert losses == sync_losses
        assert all(torch.equal(params[name], sync_params[name]) for name in params)
        assert in_flight[-1] > 0 and in_flight[1:-1] == [0, 0]  # left in flight by step, all waited for by forward
        assert sync_in_flight == [0, 0, 0, 0]
