"""`HybridAdam`: each chunk's Adam step runs where its optimizer state lives.

Per trainable chunk this rank holds an fp32 master shard, the two Adam moments, a step count and an fp32
gradient shard, all on the chunk's optimizer tier:

- ``device``: the buffers are arena blocks; the step is torch's fused Adam(W) on the device;
- ``host``: host buffers (pinned with CUDA); the step is torch's fused CPU Adam(W) (the CPU-Adam of ZeRO-Offload);
- ``disk``: master and moments are files; the step streams them through two host staging buffers (reading the
  next chunk while stepping this one, writing back in the background) and runs the fused CPU step. The gradient
  shard stays in host memory.

Hyperparameters (``lr``, ``betas``, ``eps``, ``weight_decay``) are read from the user's torch optimizer's param
groups at every step, so LR schedulers built on it keep working. After the step the new fp32 master is cast to
the compute dtype and handed to the `ChunkManager`, which writes the chunk's home and device copy.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.optim.adam import adam
from torch.optim.adamw import adamw

from colo.zero import Chunk

from .tiers import DeviceArena, DiskTier, HostTier
from .tracer import MemoryTracer

STATE_NAMES = ("exp_avg", "exp_avg_sq")
"""Adam's moment buffers, saved in checkpoints as ``optim/<param name>/<state>``."""


def check_optimizer(optimizer: torch.optim.Optimizer) -> str:
    """The update rule of ``optimizer`` (``"adamw"`` or ``"adam"``); raises for anything it cannot step."""
    fused_adamw = type(optimizer).__name__ == "FusedAdamW" and type(optimizer).__module__.startswith("colo.kernels")
    if isinstance(optimizer, torch.optim.AdamW) or fused_adamw:  # colo.kernels is imported only if it is in use
        kind = "adamw"
    elif isinstance(optimizer, torch.optim.Adam):
        kind = "adamw" if optimizer.defaults.get("decoupled_weight_decay", False) else "adam"
    else:
        raise TypeError(
            f"GeminiOptimizer steps Adam where each chunk's state lives, so the optimizer must be torch.optim.AdamW, "
            f"torch.optim.Adam or colo.kernels.FusedAdamW, not {type(optimizer).__name__}"
        )
    for index, group in enumerate(optimizer.param_groups):
        for flag in ("amsgrad", "maximize", "differentiable", "capturable"):
            if group.get(flag, False):
                raise ValueError(f"param group {index} sets {flag}=True, which GeminiOptimizer does not support")
    return kind


@dataclass
class _AdamState:
    """One chunk's optimizer state on its tier."""

    tier: str
    master: torch.Tensor | None
    """On the device or host; ``None`` on disk (the file ``<key>-master``)."""
    exp_avg: torch.Tensor | None
    exp_avg_sq: torch.Tensor | None
    grad: torch.Tensor
    """The fp32 gradient shard (device or host; host for disk-resident state)."""
    step: torch.Tensor
    disk_key: str | None = None


class HybridAdam:
    """Adam(W) over chunk shards on the device, host and disk; see the module docstring.

    Args:
        optimizer: the user's torch optimizer (source of hyperparameters, one param group per chunk group).
        arena: the device tier.
        host: the host tier.
        disk: the disk tier, or ``None``.
        tracer: the memory tracer.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        arena: DeviceArena,
        host: HostTier,
        disk: DiskTier | None,
        tracer: MemoryTracer,
    ) -> None:
        self.optimizer = optimizer
        self.kind = check_optimizer(optimizer)
        self.arena = arena
        self.host = host
        self.disk = disk
        self.tracer = tracer
        self.device = arena.device
        self.states: dict[int, _AdamState] = {}
        self.chunks: dict[int, Chunk] = {}
        self._staging: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self.num_steps = 0

    # --- buffers ----------------------------------------------------------------------------------------------

    def _allocate(self, tier: str, numel: int, what: str) -> torch.Tensor:
        if tier == "device":
            return self.arena.allocate(numel, torch.float32, what=what)
        return self.host.allocate(numel, torch.float32, what=what)

    def _free(self, tier: str, tensor: torch.Tensor) -> None:
        (self.arena if tier == "device" else self.host).free(tensor)

    def _step_device(self, tier: str) -> torch.device:
        return self.device if tier == "device" else torch.device("cpu")

    @torch.no_grad()
    def initialize(self, chunk: Chunk, master: torch.Tensor, tier: str) -> None:
        """Create the chunk's state on ``tier`` from its initial fp32 master shard (moments zero, step 0)."""
        numel = chunk.shard_numel
        what = f"chunk {chunk.index}'s optimizer state"
        grad_tier = "host" if tier == "disk" else tier
        state = _AdamState(
            tier=tier,
            master=None,
            exp_avg=None,
            exp_avg_sq=None,
            grad=self._allocate(grad_tier, numel, f"chunk {chunk.index}'s gradient shard").zero_(),
            step=torch.zeros((), dtype=torch.float32, device=self._step_device(tier)),
        )
        if tier == "disk":
            state.disk_key = f"chunk{chunk.index:05d}-optim"
            host_master = master.detach().to("cpu", torch.float32, copy=True).contiguous()
            for name in ("master", *STATE_NAMES):
                self.disk.create(f"{state.disk_key}-{name}", numel * 4, what=what)
            self.disk.write(f"{state.disk_key}-master", host_master)
            zeros = torch.zeros(numel, dtype=torch.float32)
            for name in STATE_NAMES:
                self.disk.write(f"{state.disk_key}-{name}", zeros)
            self._ensure_staging(numel)
        else:
            state.master = self._allocate(tier, numel, what)
            state.master.copy_(master)
            state.exp_avg = self._allocate(tier, numel, what).zero_()
            state.exp_avg_sq = self._allocate(tier, numel, what).zero_()
        self.states[chunk.index] = state
        self.chunks[chunk.index] = chunk
        self._register(chunk)

    def _ensure_staging(self, numel: int) -> None:
        if self._staging and self._staging[0][0].numel() >= numel:
            return
        for buffers in self._staging:
            for tensor in buffers:
                self.host.free(tensor)
        self._staging = [
            tuple(self.host.allocate(numel, torch.float32, what="disk streaming buffers") for _ in range(3))
            for _ in range(2)
        ]

    def _register(self, chunk: Chunk) -> None:
        state = self.states[chunk.index]
        placeholder = torch.empty(chunk.shard_numel, dtype=torch.float32, device="meta")
        chunk.set_buffer("master", state.master if state.master is not None else placeholder, tier=state.tier)
        for name in STATE_NAMES:
            tensor = getattr(state, name)
            chunk.set_buffer(f"optim/{name}", tensor if tensor is not None else placeholder, tier=state.tier)
        chunk.set_buffer("grad_shard", state.grad, tier="host" if state.tier == "disk" else state.tier)

    @torch.no_grad()
    def move(self, chunk: Chunk, tier: str) -> None:
        """Move the chunk's state (master, moments, gradient shard, step) to ``tier`` (device or host)."""
        state = self.states[chunk.index]
        if state.tier == tier:
            return
        if tier == "disk":
            raise ValueError("HybridAdam.move: moving optimizer state onto disk is not supported")
        values = self.read(chunk)
        grad = self._allocate(tier, chunk.shard_numel, f"chunk {chunk.index}'s gradient shard")
        grad.copy_(state.grad)
        self._release_buffers(state)
        state.tier, state.grad, state.disk_key = tier, grad, None
        state.step = state.step.to(self._step_device(tier))
        for name in ("master", *STATE_NAMES):
            tensor = self._allocate(tier, chunk.shard_numel, f"chunk {chunk.index}'s optimizer state")
            tensor.copy_(values[name])
            setattr(state, name, tensor)
        self._register(chunk)

    def relocatables(self) -> list:
        """``(device buffer, rebind)`` for every buffer of device-resident state (for arena compaction)."""
        result = []
        for index, state in self.states.items():
            if state.tier != "device":
                continue
            for name in ("master", *STATE_NAMES, "grad"):
                result.append((getattr(state, name), functools.partial(self._rebind, index, name)))
        return result

    def _rebind(self, index: int, name: str, moved: torch.Tensor) -> None:
        setattr(self.states[index], name, moved)
        self._register(self.chunks[index])

    def _release_buffers(self, state: _AdamState) -> None:
        self._free("host" if state.tier == "disk" else state.tier, state.grad)
        if state.tier == "disk":
            for name in ("master", *STATE_NAMES):
                self.disk.remove(f"{state.disk_key}-{name}")
            return
        for name in ("master", *STATE_NAMES):
            self._free(state.tier, getattr(state, name))

    # --- gradients --------------------------------------------------------------------------------------------

    @torch.no_grad()
    def accumulate_grad(self, chunk: Chunk, piece: torch.Tensor, *, scale: float, source: str = "device") -> None:
        """Add ``scale * piece`` (this rank's reduced gradient shard, on the device) into the gradient shard."""
        state = self.states[chunk.index]
        if state.tier != "device":
            self.tracer.moved(f"{source}->host", piece.numel() * piece.element_size())
            piece = piece.to("cpu")
        state.grad.add_(piece, alpha=scale)

    def grad_shards(self) -> list[torch.Tensor]:
        """Every gradient shard of this rank."""
        return [state.grad for state in self.states.values()]

    def zero_grad(self) -> None:
        """Zero every gradient shard."""
        for state in self.states.values():
            state.grad.zero_()

    # --- the step ---------------------------------------------------------------------------------------------

    def _hyper(self, chunk: Chunk) -> dict:
        group = self.optimizer.param_groups[chunk.group_index]
        beta1, beta2 = group["betas"]
        return {
            "lr": float(group["lr"]),
            "beta1": float(beta1),
            "beta2": float(beta2),
            "eps": float(group["eps"]),
            "weight_decay": float(group["weight_decay"]),
        }

    def _update(self, masters, grads, exp_avgs, exp_avg_sqs, steps, hyper: dict) -> None:
        rule = adamw if self.kind == "adamw" else adam
        rule(
            masters, grads, exp_avgs, exp_avg_sqs, [], steps,
            fused=True, amsgrad=False, maximize=False, **hyper,
        )  # fmt: skip

    @torch.no_grad()
    def step(self, write_params: Callable[[Chunk, torch.Tensor, str], None], compute_dtype: Callable) -> None:
        """One Adam step of every chunk where its state lives, then ``write_params(chunk, values, source tier)``.

        Args:
            write_params: stores a chunk's new compute shard (the `ChunkManager`'s ``write_params``).
            compute_dtype: ``compute_dtype(chunk)``, the dtype of the chunk's compute copy.
        """
        batches: dict[tuple[str, int], list[int]] = {}
        disk_chunks = []
        for index, state in self.states.items():
            if state.tier == "disk":
                disk_chunks.append(index)
            else:
                batches.setdefault((state.tier, self.chunks[index].group_index), []).append(index)
        for (tier, _), indices in batches.items():
            states = [self.states[i] for i in indices]
            self._update(
                [s.master for s in states],
                [s.grad for s in states],
                [s.exp_avg for s in states],
                [s.exp_avg_sq for s in states],
                [s.step for s in states],
                self._hyper(self.chunks[indices[0]]),
            )
            for index, state in zip(indices, states):
                chunk = self.chunks[index]
                write_params(chunk, state.master.to(compute_dtype(chunk)), tier)
        if disk_chunks:
            self._step_disk(disk_chunks, write_params, compute_dtype)
        self.num_steps += 1

    def _stage_read(self, index: int, slot: int) -> list:
        state, numel = self.states[index], self.chunks[index].shard_numel
        futures = []
        for name, buffer in zip(("master", *STATE_NAMES), self._staging[slot]):
            futures.append(self.disk.read(f"{state.disk_key}-{name}", buffer[:numel]))
            self.tracer.moved("disk->host", numel * 4)
        return futures

    def _step_disk(self, indices: list[int], write_params, compute_dtype) -> None:
        reads = self._stage_read(indices[0], 0)
        writes: list[list] = [[], []]
        for i, index in enumerate(indices):
            slot = i % 2
            for future in reads:
                future.result()
            if i + 1 < len(indices):  # read the next chunk into the other buffers once their writes are done
                for future in writes[1 - slot]:
                    future.result()
                reads = self._stage_read(indices[i + 1], 1 - slot)
            state, chunk = self.states[index], self.chunks[index]
            numel = chunk.shard_numel
            master, exp_avg, exp_avg_sq = (buffer[:numel] for buffer in self._staging[slot])
            self._update([master], [state.grad], [exp_avg], [exp_avg_sq], [state.step], self._hyper(chunk))
            write_params(chunk, master.to(compute_dtype(chunk), copy=True), "host")
            writes[slot] = [
                self.disk.write(f"{state.disk_key}-{name}", tensor)
                for name, tensor in zip(("master", *STATE_NAMES), (master, exp_avg, exp_avg_sq))
            ]
            self.tracer.moved("host->disk", 3 * numel * 4)
        for futures in writes:
            for future in futures:
                future.result()

    # --- reading and loading ----------------------------------------------------------------------------------

    @torch.no_grad()
    def read(self, chunk: Chunk) -> dict[str, torch.Tensor]:
        """The chunk's master and moments (CPU copies for disk-resident state, else the buffers themselves)."""
        state = self.states[chunk.index]
        if state.tier != "disk":
            return {"master": state.master, "exp_avg": state.exp_avg, "exp_avg_sq": state.exp_avg_sq}
        result = {}
        futures = []
        for name in ("master", *STATE_NAMES):
            result[name] = torch.empty(chunk.shard_numel, dtype=torch.float32)
            futures.append(self.disk.read(f"{state.disk_key}-{name}", result[name]))
        for future in futures:
            future.result()
        return result

    @torch.no_grad()
    def load(self, chunk: Chunk, values: dict[str, torch.Tensor], *, step: int) -> None:
        """Overwrite the chunk's master and moments with ``values`` and its step count with ``step``."""
        state = self.states[chunk.index]
        state.step.fill_(float(step))
        if state.tier != "disk":
            for name in ("master", *STATE_NAMES):
                getattr(state, name).copy_(values[name])
            return
        futures = [
            self.disk.write(f"{state.disk_key}-{name}", values[name].to("cpu", torch.float32, copy=True).contiguous())
            for name in ("master", *STATE_NAMES)
        ]
        for future in futures:
            future.result()

    def bytes_by_tier(self) -> dict[str, int]:
        """Optimizer bytes per tier (arena blocks rounded as the arena rounds them; staging on the host)."""
        result = {"device": 0, "host": 0, "disk": 0}
        block = DeviceArena.block_bytes
        for index, state in self.states.items():
            numel = self.chunks[index].shard_numel
            if state.tier == "device":
                result["device"] += 4 * block(numel, torch.float32)
            elif state.tier == "host":
                result["host"] += 4 * numel * 4
            else:
                result["disk"] += 3 * numel * 4
                result["host"] += numel * 4
        result["host"] += sum(t.numel() * 4 for buffers in self._staging for t in buffers)
        return result
