"""`OptimizerDriver`: the optimizer half of an `Engine` over a colo chunk optimizer (`colo.zero.ZeroOptimizer`,
`colo.gemini.GeminiOptimizer`, both `colo.zero.ChunkOptimizer` s), shared by every engine that steps one, whatever
runs the microbatches: the Booster's microbatch loop (`Zero`, `Gemini`, `HybridParallel` without a pipeline) or a
pipeline schedule (`HybridParallel` with ``pp > 1``)."""

from __future__ import annotations

import torch


class OptimizerDriver:
    """Backward, clipping, the step, and checkpoint state through the chunk optimizer ``self.optimizer``; mix in
    before `Engine`."""

    optimizer: object
    plugin: object

    def backward(self, loss: torch.Tensor) -> None:
        self.optimizer.backward(loss)

    def no_sync(self):
        return self.optimizer.no_sync()

    def step(self) -> tuple[float | None, bool]:
        """Clip to ``plugin.max_grad_norm`` (or only measure the norm), step; returns ``(grad norm, skipped)``."""
        max_norm = self.plugin.max_grad_norm
        norm = self.optimizer.clip_grad_norm_(max_norm) if max_norm is not None else self.optimizer.grad_norm()
        return norm, self.optimizer.step()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()

    def wait_params(self) -> None:
        wait = getattr(self.optimizer, "wait_params", None)
        if wait is not None:
            wait()

    @property
    def torch_optimizer(self) -> torch.optim.Optimizer:
        return self.optimizer.optimizer

    def state_bytes(self) -> dict[str, int]:
        """Bytes of model state this rank holds, by kind, from the chunk optimizer's own ``memory_report()``:
        `colo.zero.MemoryReport` gives ``params`` (compute copies), ``grads`` (gradient buffers and shards) and
        ``optimizer_states`` (fp32 masters and the optimizer's states); `colo.gemini.GeminiMemoryReport` gives
        ``params`` (compute copies, gathered copies and buckets, every tier) and ``optimizer_states`` (masters,
        gradient shards and states, every tier), plus each tier's use (``tier_<name>``)."""
        report = self.optimizer.memory_report()
        tiers = getattr(report, "tiers", None)
        if tiers is None:  # ZeRO
            return {
                "params": report.params,
                "grads": report.grads,
                "optimizer_states": report.masters + report.optimizer_states,
            }
        return {
            "params": sum(tier.params for tier in tiers.values()),
            "optimizer_states": sum(tier.optimizer for tier in tiers.values()),
            **{f"tier_{name}": tier.used for name, tier in tiers.items()},
        }

    def checkpoint_state(self) -> tuple[dict, dict]:
        return self.optimizer.checkpoint_state()

    def load(self, path: str) -> dict:
        return self.optimizer.load(path)
