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

import functools
import os
import uuid

import torch

from colo.comm import Mesh, all_gather, all_reduce, reduce_scatter
from colo.zero import Chunk, DynamicLossScaler, plan_chunks
from colo.zero.clip import clip_coefficient, global_grad_norm
from colo.zero.optimizer_setup import OptimizerLike, param_group_index, resolve_optimizer

from .config import GeminiConfig
from .hooks import GeminiGatherer
from .manager import ChunkManager
from .optimizer import HybridAdam, check_optimizer
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


class GeminiOptimizer:
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

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: OptimizerLike = None,
        *,
        mesh: Mesh,
        config: GeminiConfig | None = None,
        loss_scaler: DynamicLossScaler | None = None,
        checkpoint_names=None,
        **config_fields,
    ) -> None:
        if config is not None and config_fields:
            raise ValueError(f"pass either config= or its fields ({sorted(config_fields)}), not both")
        self.config = config if config is not None else GeminiConfig(**config_fields)
        self.model = model
        self.mesh = mesh
        self.checkpoint_names = checkpoint_names
        unknown = [axis for axis in self.config.data_axes if axis not in mesh.axis_names]
        if unknown:
            raise ValueError(
                f"GeminiConfig.data_axes names {unknown}, not axes of the mesh {mesh.axis_names}; pick from those"
            )
        params = dict(model.named_parameters())
        if not params:
            raise ValueError("the model has no parameters for GeminiOptimizer to place")
        devices = {p.device for p in params.values()}
        if len(devices) > 1:
            raise ValueError(
                f"the model's parameters are on several devices {sorted(map(str, devices))}; move it to one "
                "device (model.to('cpu')) before GeminiOptimizer"
            )
        self.device = self.config.resolved_device()
        self.optimizer = resolve_optimizer(
            optimizer, list(params.values()), default=torch.optim.AdamW, owner="GeminiOptimizer"
        )
        check_optimizer(self.optimizer)
        group_of = param_group_index(self.optimizer, params, owner="GeminiOptimizer")
        mp = self.config.mixed_precision
        self.param_dtype = mp.param_dtype if mp is not None else None
        self.reduce_dtype = mp.reduce_dtype if mp is not None else None
        self.num_shards = mesh.size(*self.config.data_axes)
        shard_rank = mesh.rank(*self.config.data_axes)

        entries = [(name, p, group_of.get(id(p), -1)) for name, p in params.items()]
        plans = plan_chunks(
            entries,
            num_shards=self.num_shards,
            chunk_numel=self.config.chunk_numel,
            max_chunk_numel=self.config.max_chunk_numel,
        )
        self.chunks = [
            Chunk(i, plan, num_shards=self.num_shards, shard_rank=shard_rank) for i, plan in enumerate(plans)
        ]
        self.chunk_of: dict[int, Chunk] = {id(slot.param): c for c in self.chunks for slot in c.slots}
        self.sizes = [chunk_sizes(c, compute_dtype=self.param_dtype or c.dtype) for c in self.chunks]
        module_chunks = self._module_chunks(model)
        self.placement, capacities, self.working_set = self._plan(module_chunks)

        # the configuration is valid and the model fits: build the tiers and move the model into them
        self.group = mesh.group(*self.config.data_axes)
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

        self.loss_scaler = loss_scaler
        if loss_scaler is None and self.param_dtype == torch.float16:
            self.loss_scaler = DynamicLossScaler(group=self.group)
        self._received: dict[int, set[str]] = {chunk.index: set() for chunk in self.chunks}
        """Per chunk, the names of the parameters whose gradient is in the chunk's bucket."""
        self._grads_prepared = False
        self.last_grad_norm: float | None = None
        self.last_step_skipped = False
        self.warmed_up = self.config.placement != "auto"
        self._warmup_hook = None
        self._end_of_backward_queued = False
        if not self.warmed_up:  # the warm-up's non-model memory is counted from the start of the first forward
            self._warmup_hook = model.register_forward_pre_hook(lambda module, args: self.non_model.start())
        self.gatherer = GeminiGatherer(self.chunks, manager=self.manager)
        self.gatherer.install(model, self.chunk_of)
        self._hooks = []
        for chunk in self.trainable_chunks:
            for slot in chunk.slots:
                hook = functools.partial(self._on_grad_ready, chunk, slot)
                self._hooks.append(slot.param.register_post_accumulate_grad_hook(hook))
        self.tracer.end_setup()
        self.zero_grad()

    # --- construction -----------------------------------------------------------------------------------------

    def _module_chunks(self, model: torch.nn.Module) -> list[list[int]]:
        result = []
        for module in model.modules():
            owned = []
            for param in module.parameters(recurse=False):
                chunk = self.chunk_of.get(id(param))
                if chunk is not None and chunk.index not in owned:
                    owned.append(chunk.index)
            if owned:
                result.append(owned)
        return result

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

    @property
    def trainable_chunks(self) -> list[Chunk]:
        """Chunks of trainable parameters (the ones with masters, gradients and optimizer state)."""
        return [chunk for chunk in self.chunks if chunk.trainable]

    # --- gradients --------------------------------------------------------------------------------------------

    def _on_grad_ready(self, chunk: Chunk, slot, param: torch.Tensor) -> None:
        """Copy a parameter's gradient into its chunk's bucket; reduce the bucket once the chunk is complete."""
        if self.non_model.active and not self._end_of_backward_queued:
            self._end_of_backward_queued = True  # count the warm-up's non-model memory until backward ends only
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        bucket = self.manager.grad_bucket(chunk)
        received = self._received[chunk.index]
        region = chunk.slot_view(bucket, slot)
        if slot.name in received:  # a second gradient in the same bucket (accumulation over micro-steps)
            region.add_(param.grad)
        else:
            region.copy_(param.grad)
            received.add(slot.name)
        param.grad = None
        if len(received) == len(chunk.slots):
            self._reduce_grads(chunk)

    def _end_of_backward(self) -> None:
        self._end_of_backward_queued = False
        self.policy.on_pause(non_model=self.non_model.sample())
        self.non_model.pause()

    @torch.no_grad()
    def _reduce_grads(self, chunk: Chunk) -> None:
        """Reduce-scatter the bucket into this rank's gradient shard, on the tier of the chunk's optimizer state."""
        with self.non_model.suspended():
            bucket = self.manager.grad_bucket(chunk)
            received = self._received[chunk.index]
            for slot in chunk.slots:  # parameters that got no gradient (unused this step) contribute zeros
                if slot.name not in received:
                    chunk.slot_view(bucket, slot).zero_()
            received.clear()
            if self.num_shards > 1:
                if self.reduce_dtype is not None and bucket.dtype != self.reduce_dtype:
                    bucket = bucket.to(self.reduce_dtype)
                piece = reduce_scatter(bucket, "sum", group=self.group)
            else:
                piece = bucket
            self.hybrid.accumulate_grad(chunk, piece, scale=1.0 / self.num_shards)
            self.manager.free_bucket(chunk)
            self.gatherer.release(chunk)

    def _prepare_grads(self) -> bool:
        """Reduce what is not reduced yet, check for overflow and unscale, once per step; returns whether to skip."""
        if self._grads_prepared:
            return self.last_step_skipped
        for chunk in self.trainable_chunks:  # chunks with unused parameters never completed in backward
            if self._received[chunk.index]:
                self._reduce_grads(chunk)
        self.last_step_skipped = False
        shards = self.hybrid.grad_shards()
        if self.loss_scaler is not None:
            probe = [torch.zeros(0, device=self.device)]  # the scaler's flag lives on the first tensor's device
            self.last_step_skipped = self.loss_scaler.found_inf(probe + shards)
            if not self.last_step_skipped:
                for shard in shards:
                    shard.div_(self.loss_scaler.scale)
        self._grads_prepared = True
        return self.last_step_skipped

    # --- the training-loop API --------------------------------------------------------------------------------

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``, scaled by the loss scaler when there is one."""
        if self.loss_scaler is not None:
            loss = self.loss_scaler.scale_loss(loss)
        loss.backward()

    def reduce_gradients(self) -> bool:
        """Reduce this step's gradients now (``step()`` does it otherwise); returns whether the step is skipped."""
        return self._prepare_grads()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> float:
        """Clip gradients by their global norm over all shards and tiers, like ``torch.nn.utils.clip_grad_norm_``.

        Returns:
            The total norm before clipping (``inf`` when the step overflowed and will be skipped).
        """
        if self._prepare_grads():
            return float("inf")
        shards = self.hybrid.grad_shards()
        total = global_grad_norm(shards, group=self.group, norm_type=norm_type)
        coefficient = clip_coefficient(total, max_norm)
        if coefficient < 1.0:
            for shard in shards:
                shard.mul_(coefficient)
        self.last_grad_norm = total
        return total

    def step(self) -> bool:
        """Reduce gradients, step every chunk where its optimizer state lives, refresh the compute copies.

        The first step under ``placement="auto"`` ends the warm-up: the recorded access order and non-model
        memory are turned into the plan the later steps follow.

        Returns:
            Whether the step was skipped (an fp16 overflow).
        """
        skipped = self._prepare_grads()
        if self.loss_scaler is not None:
            self.loss_scaler.update(skipped)
        self.manager.release_all()
        if not self.warmed_up:
            self._finish_warmup()
        if not skipped:
            self.hybrid.step(self.manager.write_params, self.manager.dtype_of)
        self._grads_prepared = False
        self.policy.end_step()
        self.tracer.end_step()
        return skipped

    def zero_grad(self) -> None:
        """Zero the gradient shards and drop any ``.grad`` left on the parameters."""
        self.hybrid.zero_grad()
        for chunk in self.trainable_chunks:
            for slot in chunk.slots:
                slot.param.grad = None
        self._grads_prepared = False

    def release_params(self) -> None:
        """Release every gathered chunk (after an evaluation forward under ``torch.no_grad``, say)."""
        self.manager.release_all()

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

    # --- inspection -------------------------------------------------------------------------------------------

    def _gather_named(self, shards: dict[int, torch.Tensor]) -> dict[str, torch.Tensor]:
        result = {}
        for chunk in self.trainable_chunks:
            shard = shards[chunk.index].to(self.device).contiguous()
            full = all_gather(shard, group=self.group) if self.num_shards > 1 else shard
            for slot in chunk.slots:
                result[slot.name] = chunk.slot_view(full, slot).detach().to("cpu", copy=True)
        return result

    def full_params(self) -> dict[str, torch.Tensor]:
        """The fp32 masters of every trainable parameter, gathered on CPU (a collective)."""
        return self._gather_named({c.index: self.hybrid.read(c)["master"] for c in self.trainable_chunks})

    def full_grads(self) -> dict[str, torch.Tensor]:
        """The reduced fp32 gradients of every trainable parameter, gathered on CPU (a collective; after backward)."""
        self._prepare_grads()
        return self._gather_named({c.index: self.hybrid.states[c.index].grad for c in self.trainable_chunks})

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

    def save(self, path: str | os.PathLike, *, metadata: dict | None = None, expected_names=None) -> None:
        """Save masters, Adam moments and frozen weights to the new checkpoint directory ``path`` (every rank calls
        it), in colo's sharded format with colo.zero's metadata; see `colo.gemini.checkpoint.save_gemini`."""
        from .checkpoint import save_gemini

        save_gemini(self, path, metadata=metadata, expected_names=expected_names)

    def load(self, path: str | os.PathLike) -> dict:
        """Load a Gemini or ZeRO checkpoint saved at any data-parallel size and placement; returns its metadata.

        See `colo.gemini.checkpoint.load_gemini`.
        """
        from .checkpoint import load_gemini

        return load_gemini(self, path)

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
