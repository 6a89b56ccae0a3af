"""`GeminiOptimizer`: train a model larger than the device by keeping each chunk on the tier where it is cheapest
and moving it just in time (settings: `colo.gemini.config.GeminiConfig`).

The model's parameters are packed into colo.zero chunks and sharded over the data axes as in ZeRO-3 (Gemini with
everything on the device is ZeRO-3). Each chunk's compute shard is homed on the device, host or disk, its
optimizer state lives on one of them and is stepped there (`colo.gemini.optimizer`), and a `ChunkManager` brings
parameters to the device arena before the modules that use them and evicts what the policy says when room is
needed (`colo.gemini.placement`). The training loop is ZeroOptimizer's: ``backward``, ``clip_grad_norm_``,
``step``, ``zero_grad``.

Colossal-AI's Gemini is the model (Fang et al., "Parallel Training of Pre-Trained Models via Chunk-Based Dynamic
Memory Management", 2022), with ZeRO-Infinity's NVMe tier (Rajbhandari et al., 2021).
"""

from __future__ import annotations

import os
import uuid

import torch

from colo.comm import all_reduce
from colo.zero import Chunk
from colo.zero.core import ChunkOptimizer
from colo.zero.grad_sync import BucketGradSync, LocalResult, reduce_scatter_async

from .config import GeminiConfig
from .hooks import GeminiGatherer
from .manager import ChunkManager
from .optimizer import STATE_NAMES, HybridAdam, check_optimizer
from .placement import (
    AutoPolicy,
    Placement,
    StaticPolicy,
    auto_initial_placement,
    check_capacities,
    chunk_sizes,
    static_placement,
    tier_demand,
    working_set,
)
from .tiers import DeviceArena, DiskTier, GeminiMemoryError, HostTier, format_bytes
from .tracer import GeminiMemoryReport, MemoryTracer, NonModelMemory, TierReport


class GeminiGradSync(BucketGradSync):
    """colo.zero's bucket strategy with Gemini's buckets: each in the device arena (`ChunkManager.grad_bucket`),
    reduced as soon as it is complete and landed at once on the tier of the chunk's optimizer state
    (`HybridAdam.accumulate_grad`), outside the non-model memory count."""

    def __init__(self, chunks, *, group, reduce_dtype, manager: ChunkManager, hybrid: HybridAdam, on_reduced, on_grad):
        reduce = reduce_scatter_async(group, donate=False) if group.size > 1 else LocalResult
        super().__init__(chunks, group=group, reduce=reduce, reduce_dtype=reduce_dtype, on_reduced=on_reduced)
        self.manager = manager
        self.hybrid = hybrid
        self.on_grad = on_grad

    def _take_bucket(self, chunk, dtype: torch.dtype) -> torch.Tensor:
        return self.manager.grad_bucket(chunk)

    def _give_bucket(self, chunk, bucket: torch.Tensor) -> None:
        self.manager.free_bucket(chunk)

    def _bucket_of(self, chunk) -> torch.Tensor:
        return self.manager.grad_bucket(chunk)  # the arena may have moved it (`ChunkManager.compact`)

    def _land(self, chunk, reduced: torch.Tensor, *, first: bool) -> None:
        self.hybrid.accumulate_grad(chunk, reduced, scale=1.0 / self.group.size)  # the shards are zeroed in discard

    def _clear(self, chunk) -> None:
        """Nothing: `discard` zeroed the shard."""

    def on_grad_ready(self, chunk, slot, param: torch.Tensor) -> None:
        self.on_grad()
        super().on_grad_ready(chunk, slot, param)

    @torch.no_grad()
    def reduce_chunk(self, chunk) -> None:
        with self.manager.non_model.suspended():
            super().reduce_chunk(chunk)

    def discard(self) -> None:
        super().discard()
        self.hybrid.zero_grad()


class GeminiOptimizer(ChunkOptimizer):
    """Trains ``model`` with its chunks placed over device, host and disk tiers; see the module docstring.

    Build every replica with the same seed: each rank keeps its shard of its own copy. Everything that can be
    wrong with the configuration (fields, fractions, a model that does not fit the tiers) raises a `ValueError`
    from the constructor, before any collective and before training starts.

    Args:
        model: the model (on CPU or the compute device); its parameters become views into device chunk buffers
            while the modules that own them run, and empty tensors otherwise.
        optimizer: a fresh ``torch.optim.AdamW`` / ``Adam`` (or colo.kernels ``FusedAdamW``) over the model's
            parameters, whose param groups carry lr / betas / eps / weight decay; a callable building one from a
            parameter list; or ``None`` for AdamW with torch's defaults.
        mesh: the mesh holding ``config.data_axes``.
        config: a `GeminiConfig`; or pass its fields as keyword arguments (``placement="auto"``).
        loss_scaler: a `colo.zero.DynamicLossScaler`; created over the data group when computing in fp16.
        param_order: parameter names in packing order (`colo.zero.execution_order`, which prefetch follows);
            default registration order.
        checkpoint_names: ``fn(name, parameter) -> [(checkpoint name, first row, rows), ...] | None`` giving the
            names checkpoints use for a parameter, as `colo.zero.ZeroOptimizer` takes it (a fused q/k/v weight
            saved as q, k and v, so checkpoints are interchangeable with ZeRO's); ``None``: parameter names.

    Example::

        gemini = GeminiOptimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), mesh=Mesh(dp=2),
                                 placement="auto", device_capacity="8GiB", host_capacity="64GiB")
        gemini.backward(model(batch).loss)
        gemini.clip_grad_norm_(1.0)
        gemini.step()
        gemini.zero_grad()
    """

    config_type = GeminiConfig

    def _compute_device(self, model_device: torch.device) -> torch.device:
        return self.config.resolved_device()

    def _build(self, group_of: dict[int, int]) -> None:
        model = self.model
        check_optimizer(self.optimizer)
        self._plan_chunks(group_of, num_shards=self.group.size, shard_rank=self.group.rank)
        self.norm_group = self.group
        self.sizes = [chunk_sizes(c, compute_dtype=self.param_dtype or c.dtype) for c in self.chunks]
        module_chunks = self._module_chunks(model)
        self.placement, capacities, self.working_set = self._plan(module_chunks)

        # the configuration is valid and the model fits: build the tiers and move the model into them
        self.tracer = MemoryTracer()
        pin = self.config.pin_memory if self.config.pin_memory is not None else torch.cuda.is_available()
        self.arena = DeviceArena(capacities["device"], device=self.device)
        self.host = HostTier(self.config.host_capacity, pin_memory=pin)
        self.disk = None
        if self.config.disk_dir is not None:
            name = f"rank{torch.distributed.get_rank():05d}-{uuid.uuid4().hex[:8]}"  # one directory per instance
            directory = os.path.join(os.fspath(self.config.disk_dir), name)
            self.disk = DiskTier(directory, self.config.disk_capacity, num_threads=self.config.disk_threads)
        for tier in (self.arena, self.host, self.disk):
            if tier is not None:
                tier.observers.append(self.tracer.on_tier_change)
        if self.config.placement == "auto":
            self.policy = AutoPolicy(capacity=self.arena.capacity, prefetch=self.config.prefetch)
        else:
            self.policy = StaticPolicy(len(self.chunks), capacity=self.arena.capacity, prefetch=self.config.prefetch)
        self.non_model = NonModelMemory(self.device, is_model=self._is_chunk_data, model_bytes=lambda: self.arena.used)
        self.manager = ChunkManager(
            self.chunks,
            group=self.group,
            arena=self.arena,
            host=self.host,
            disk=self.disk,
            policy=self.policy,
            compute_dtype=self.param_dtype,
            tracer=self.tracer,
            non_model=self.non_model,
        )
        self.hybrid = HybridAdam(self.optimizer, arena=self.arena, host=self.host, disk=self.disk, tracer=self.tracer)
        self.manager.relocatables = self.hybrid.relocatables
        self._move_model_into_chunks(model)

        self.warmed_up = self.config.placement != "auto"
        self._warmup_hook = None
        self._end_of_backward_queued = False
        if not self.warmed_up:  # the warm-up's non-model memory is counted from the start of the first forward
            self._warmup_hook = model.register_forward_pre_hook(lambda module, args: self.non_model.start())
        self.gatherer = GeminiGatherer(self.chunks, manager=self.manager)
        self.gatherer.install(model, self.chunk_of)
        self.grad_sync = GeminiGradSync(
            self.trainable_chunks,
            group=self.group,
            reduce_dtype=self.reduce_dtype,
            manager=self.manager,
            hybrid=self.hybrid,
            on_reduced=self.gatherer.release,
            on_grad=self._on_grad,
        )
        self._hooks += self.grad_sync.install()
        self.tracer.end_setup()

    # --- construction -----------------------------------------------------------------------------------------

    def _module_chunks(self, model: torch.nn.Module) -> list[list[int]]:
        """The chunks of every module that owns parameters, modules in the order the hooks gather them: by the
        packing position of the first parameter each module is the first owner of (registration order by default,
        the forward's order with ``param_order=execution_order(...)``); a module whose parameters all belong to an
        earlier module too (a tied ``lm_head``) keeps its place after the module registered before it."""
        position = {id(param): index for index, (_, param) in enumerate(self._named_params)}
        claimed: set[int] = set()
        result, key = [], -1.0
        for module in model.modules():
            owned, fresh = [], []
            for param in module.parameters(recurse=False):
                chunk = self.chunk_of.get(id(param))
                if chunk is None:
                    continue
                if chunk.index not in owned:
                    owned.append(chunk.index)
                if id(param) not in claimed:
                    claimed.add(id(param))
                    fresh.append(position[id(param)])
            if not owned:
                continue
            key = min(fresh) if fresh else key + 1e-6  # right after the previous module
            result.append((key, owned))
        return [owned for _, owned in sorted(result, key=lambda entry: entry[0])]

    def _plan(self, module_chunks: list[list[int]]) -> tuple[Placement, dict[str, float], int]:
        """Placement and tier capacities; raises `ValueError` when the model does not fit (no collective yet)."""
        config = self.config
        inf = float("inf")
        has_disk = config.disk_dir is not None
        disk_capacity = config.disk_capacity if config.disk_capacity is not None else (inf if has_disk else 0.0)
        host_capacity = config.host_capacity if config.host_capacity is not None else inf
        device_capacity = config.device_capacity if config.device_capacity is not None else inf
        if config.placement == "auto" and config.device_capacity is None:
            if self.device.type != "cuda":
                raise ValueError(
                    "GeminiConfig.device_capacity is required with placement='auto' on a machine without CUDA: "
                    "the auto policy plans against a device budget (e.g. device_capacity='256MiB')"
                )
            device_capacity = torch.cuda.mem_get_info(self.device)[0]  # the free memory of the GPU now
        capacities = {"device": device_capacity, "host": host_capacity, "disk": disk_capacity}
        if config.placement == "static":
            placement = static_placement(
                self.sizes, param_fractions=config.param_fractions, optim_fractions=config.optim_fractions
            )
        else:
            everything_off = {s.index: "host" for s in self.sizes}
            floor = working_set(self.sizes, module_chunks, everything_off)
            placement = auto_initial_placement(self.sizes, capacities, working=floor, has_disk=has_disk)
        working = working_set(self.sizes, module_chunks, placement.param_home)
        demand = tier_demand(self.sizes, placement, working=working)
        check_capacities(demand, capacities, policy=config.placement)
        if config.device_capacity is None:  # static: what the fractions put there (auto requires a budget)
            capacities["device"] = max(sum(demand["device"].values()), 1)
        return placement, capacities, working

    def _is_chunk_data(self, tensor: torch.Tensor) -> bool:
        return self.arena.holds(tensor) or self.host.holds(tensor)

    @torch.no_grad()
    def _move_model_into_chunks(self, model: torch.nn.Module) -> None:
        for chunk in self.chunks:
            compute_dtype = self.param_dtype or chunk.dtype
            source = chunk.slots[0].param.device
            full = chunk.pack(compute_dtype, source)
            self.manager.initialize(chunk, chunk.shard_of(full), self.placement.param_home[chunk.index])
            if chunk.trainable:
                fp32 = full if full.dtype == torch.float32 else chunk.pack(torch.float32, source)
                self.hybrid.initialize(chunk, chunk.shard_of(fp32), self.placement.optim_tier[chunk.index])
            for slot in chunk.slots:  # the parameters' own storage is freed; they are views only while in use
                slot.param.data = torch.empty(0, dtype=compute_dtype, device=self.device)
        for module in model.modules():  # non-parameter buffers (norm statistics, rotary tables) go to the device
            for name, buffer in module._buffers.items():
                if buffer is not None and buffer.device != self.device:
                    module._buffers[name] = buffer.to(self.device)

    # --- the core's steps -------------------------------------------------------------------------------------

    def _on_grad(self) -> None:
        """A gradient arrived: during the warm-up, count non-model memory until this backward ends, no longer."""
        if self.non_model.active and not self._end_of_backward_queued:
            self._end_of_backward_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._end_of_backward_queued = False
        self.policy.on_pause(non_model=self.non_model.sample())
        self.non_model.pause()

    def _finish_grad_sync(self) -> list[torch.Tensor]:
        self.grad_sync.finish()
        return [self.hybrid.states[chunk.index].grad for chunk in self.trainable_chunks]

    def _counted_grads(self) -> list[torch.Tensor]:
        return self._grad_shards

    def _update(self, skipped: bool) -> None:
        """Step every chunk where its optimizer state lives and refresh the compute copies. The first step under
        ``placement="auto"`` ends the warm-up: the recorded access order and non-model memory are turned into the
        plan the later steps follow."""
        self.gatherer.release_all()
        if not self.warmed_up:
            self._finish_warmup()
        if not skipped:
            self.hybrid.step(self.manager.write_params, self.manager.dtype_of)
        self.policy.end_step()
        self.tracer.end_step()

    def _discard_grads(self) -> None:
        self.grad_sync.discard()

    def release_params(self) -> None:
        """Release every gathered chunk (after an evaluation forward under ``torch.no_grad``, say)."""
        self.gatherer.release_all()

    # --- auto placement ---------------------------------------------------------------------------------------

    def _finish_warmup(self) -> None:
        """Turn the warm-up's record into the plan: resident parameters and device optimizer state if they fit."""
        self.warmed_up = True
        if self._warmup_hook is not None:
            self._warmup_hook.remove()
        self.policy.finish_recording(non_model=self.non_model.sample())
        self.non_model.stop()
        # every rank takes the same decision (and raises together): plan with the largest figures of the group
        peaks = torch.tensor([self.policy.non_model_peak, self.manager.transient_peak], dtype=torch.float64)
        all_reduce(peaks, op="max", group=self.group)
        non_model, transient = int(peaks[0]), int(peaks[1])
        capacity = self.arena.capacity
        if capacity - non_model < self.working_set:
            raise GeminiMemoryError(
                f"the warm-up step measured {format_bytes(non_model)} of non-model memory (activations, "
                f"temporaries) at its peak; GeminiConfig.device_capacity={format_bytes(capacity)} then leaves "
                f"{format_bytes(capacity - non_model)} for chunks, less than the {format_bytes(self.working_set)} "
                "the modules need at once. Raise device_capacity, or lower the activation memory (smaller "
                "micro-batches, activation checkpointing)"
            )
        reserve = non_model + transient
        params = sum(s.param for s in self.sizes)
        on_device = [index for index, state in self.hybrid.states.items() if state.tier == "device"]
        device_optim = sum(self.sizes[index].optimizer for index in on_device)
        if params + device_optim + reserve > capacity:
            return  # the device stays a cache, driven by the recorded order
        for chunk in self.chunks:
            self.manager.make_resident(chunk)
        spare = capacity - params - device_optim - reserve
        for chunk in self.trainable_chunks:
            state = self.hybrid.states[chunk.index]
            size = self.sizes[chunk.index].optimizer
            if state.tier != "device" and size <= spare:
                self.hybrid.move(chunk, "device")
                spare -= size

    # --- inspection and checkpoint state ----------------------------------------------------------------------

    @property
    def gathered_device(self) -> torch.device:
        """`full_params` / `full_grads` return CPU tensors: the model may not fit the device."""
        return torch.device("cpu")

    def shard_tensors(self, chunk: Chunk) -> dict[str, torch.Tensor]:
        """The chunk's master and Adam moments, wherever they live (on CPU); a frozen chunk's compute shard."""
        if not chunk.trainable:
            return {"master": self.manager.read_params(chunk)}
        return {name: tensor.detach().to("cpu") for name, tensor in self.hybrid.read(chunk).items()}

    def shard_scalars(self, chunk: Chunk) -> dict[str, list]:
        return {"step": [float(self.hybrid.states[chunk.index].step.item()), "float32"]}

    def load_targets(self, chunk: Chunk, state_names: list[str]) -> dict[str, torch.Tensor]:
        """Staging tensors on CPU (moments absent from the checkpoint load as zeros)."""
        if not chunk.trainable:
            return {"master": torch.zeros(chunk.shard_numel, dtype=self.manager.dtype_of(chunk))}
        return {name: torch.zeros(chunk.shard_numel, dtype=torch.float32) for name in ("master", *STATE_NAMES)}

    @torch.no_grad()
    def finish_load(self, loaded: dict[int, dict[str, torch.Tensor]], scalars: dict[int, dict[str, list]]) -> None:
        self.gatherer.release_all()
        for chunk in self.chunks:
            buffers = loaded[chunk.index]
            if chunk.trainable:
                step = (scalars.get(chunk.index) or {}).get("step", [0.0, None])[0]
                self.hybrid.load(chunk, buffers, step=int(step))
            self.manager.write_params(chunk, buffers["master"].to(self.manager.dtype_of(chunk)), "host")

    def memory_report(self) -> GeminiMemoryReport:
        """Per-tier capacity, use and high-water mark, and per step the bytes moved and the prefetch outcomes."""
        params = self.manager.bytes_by_tier()
        optimizer = self.hybrid.bytes_by_tier()
        tiers = {}
        for tier in (self.arena, self.host, self.disk):
            if tier is None:
                continue
            tiers[tier.name] = TierReport(
                tier.name, tier.capacity, tier.used, tier.high_water, params[tier.name], optimizer[tier.name]
            )
        return GeminiMemoryReport(
            tiers=tiers,
            setup=self.tracer.setup,
            steps=list(self.tracer.steps),
            current=self.tracer.current,
            non_model_peak=self.policy.non_model_peak if isinstance(self.policy, AutoPolicy) else None,
            tracer_device_peak=self.tracer.peak.get("device", 0),
        )

    # --- checkpoints ------------------------------------------------------------------------------------------

    checkpoint_key = "gemini"

    def save(self, path: str | os.PathLike, *, metadata: dict | None = None, expected_names=None) -> None:
        """Save masters, Adam moments and frozen weights to the new checkpoint directory ``path`` (every rank of the
        data group calls it), in colo's sharded format, interchangeable with colo.zero's (`colo.zero.state`)."""
        super().save(path, metadata=metadata, group=self.group, expected_names=expected_names)

    def load(self, path: str | os.PathLike) -> dict:
        """Load a Gemini or ZeRO checkpoint saved at any data-parallel size and placement; returns its metadata.
        A checkpoint written before the first optimizer step, without moments, loads them as zeros."""
        return super().load(path)

    def close(self) -> None:
        """Remove the hooks, finish transfers and delete the disk tier's files."""
        self.gatherer.remove()
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        self.non_model.stop()
        self.manager.close()
        if self.disk is not None:
            self.disk.close()
