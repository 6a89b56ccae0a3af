"""The `DDP` plugin: torch's DistributedDataParallel, with autocast for bf16/fp16 and a gradient scaler for fp16."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch.nn.parallel import DistributedDataParallel

from ..plans import find_plan
from ..replicated_state import load_replicated_state, replicated_state
from .base import Engine, Plugin


@dataclass(kw_only=True)
class DDP(Plugin):
    """Data parallelism with torch's `DistributedDataParallel` over every rank.

    Parameters and optimizer state stay fp32 and replicated; ``precision="bf16"``/``"fp16"`` runs the forward
    under `torch.autocast` (fp16 with `torch.amp.GradScaler`). Gradient accumulation uses DDP's ``no_sync`` for
    all but the last microbatch. With one data-parallel rank there is nothing to average: the model is not wrapped
    (DDP's hooks and bucket copies would cost every step for nothing), and the step is otherwise the same.
    """

    bucket_cap_mb: float = 25.0
    """DDP's gradient bucket size."""
    gradient_as_bucket_view: bool = True
    """Let gradients be views of DDP's buckets (saves one copy of the gradients)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.bucket_cap_mb > 0:
            raise ValueError(f"DDP.bucket_cap_mb={self.bucket_cap_mb!r} must be positive")

    def configure(self, model, optimizer, *, criterion=None, param_order=None) -> Engine:
        mesh = self.build_mesh()
        self.maybe_checkpoint_activations(model)
        self.maybe_compile(model)
        return DDPEngine(self, model=model, optimizer=optimizer, mesh=mesh, criterion=criterion)


class DDPEngine(Engine):
    """Runs steps for `DDP`."""

    def __init__(self, plugin: DDP, *, model, optimizer, mesh, criterion) -> None:
        device = next(model.parameters()).device
        self.named_params = dict(model.named_parameters())
        plan = find_plan(model)
        self.checkpoint_names = plan.checkpoint_names(model) if plan is not None else None
        group = mesh.group("dp")
        wrapped = model
        if group.size > 1:
            wrapped = DistributedDataParallel(
                model,
                device_ids=[device] if device.type == "cuda" else None,
                process_group=group.process_group,
                bucket_cap_mb=plugin.bucket_cap_mb,
                gradient_as_bucket_view=plugin.gradient_as_bucket_view,
            )
        super().__init__(
            plugin, model=wrapped, optimizer=optimizer, mesh=mesh, criterion=criterion, sync_every_microbatch=False
        )
        self.device_type = device.type
        self.scaler = torch.amp.GradScaler(device.type) if plugin.precision == "fp16" else None

    def forward(self, micro):
        if self.plugin.precision == "fp32":
            return self.model(**micro)
        with torch.autocast(self.device_type, dtype=self.plugin.compute_dtype):
            return self.model(**micro)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def no_sync(self):
        if isinstance(self.model, DistributedDataParallel):
            return self.model.no_sync()
        return contextlib.nullcontext()  # one rank: gradients accumulate in place, nothing to hold back

    def step(self) -> tuple[float | None, bool]:
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        grads = [p.grad for p in self.named_params.values() if p.grad is not None]
        if self.plugin.max_grad_norm is None:  # report the norm without rescaling every gradient by 1.0
            norm = float(torch.nn.utils.get_total_norm(grads)) if grads else 0.0
        else:
            norm = float(torch.nn.utils.clip_grad_norm_(self.named_params.values(), self.plugin.max_grad_norm))
        if self.scaler is None:
            self.optimizer.step()
            return norm, False
        scale = self.scaler.get_scale()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        return norm, self.scaler.get_scale() < scale

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=not self.plugin.gradient_as_bucket_view)

    def checkpoint_state(self) -> tuple[dict, dict]:
        tensors, metadata = replicated_state(self.named_params, self.optimizer, checkpoint_names=self.checkpoint_names)
        if self.scaler is not None:
            metadata["grad_scaler"] = {k: v for k, v in self.scaler.state_dict().items()}
        return tensors, metadata

    def load(self, path: str) -> dict:
        metadata = load_replicated_state(
            path, self.named_params, self.optimizer, checkpoint_names=self.checkpoint_names
        )
        if self.scaler is not None and "grad_scaler" in metadata:
            self.scaler.load_state_dict(metadata["grad_scaler"])
        return metadata
