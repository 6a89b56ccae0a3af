"""Memory accounting: what a `ZeroOptimizer` holds on this rank, and the ZeRO paper's per-stage estimates."""

from __future__ import annotations

from dataclasses import dataclass

import torch

PRECISIONS = ("mixed", "fp32")


@dataclass(frozen=True)
class MemoryReport:
    """Bytes held on this rank, by kind (each storage counted once)."""

    params: int
    """Compute copies of the parameters (full at stages 1/2, this rank's shard at stage 3; padding included)."""
    grads: int
    """Gradient buffers: full buffers at stage 1 and in-flight buckets, plus the fp32 gradient shards."""
    masters: int
    """fp32 master shards that are not views of the compute copy."""
    optimizer_states: int
    """The optimizer's state tensors for the masters."""
    padding: int
    """Bytes, among the above, that hold chunk padding rather than parameters."""
    host: int = 0
    """Bytes, among the above, on the host tier (ZeRO-Offload: masters, gradient shards, optimizer state)."""
    workspace: int = 0
    """Bytes of free full-chunk buffers kept for reuse (`BufferPool`: stage 3's gathers, gradient buckets): at most
    the most that were in use at once. Not model state, so not in `total` (as the ZeRO formulas count it)."""
    peak_gathered_params: int = 0
    """Stage 3: the most bytes of gathered full parameter chunks held at once (in use, prefetched or kept for
    backward) since the optimizer was built or `ChunkGatherer.reset_peak`; 0 at stages 0/1/2."""

    @property
    def total(self) -> int:
        """Everything above (padding is already part of the other fields)."""
        return self.params + self.grads + self.masters + self.optimizer_states

    @property
    def peak_params(self) -> int:
        """The most parameter memory held at once: the compute copies (this rank's shards at stage 3) plus the
        stage-3 full chunks gathered at the peak. Call it with no chunk gathered (after a step) so that `params`
        holds the shards only."""
        return self.params + self.peak_gathered_params


def memory_report(zero) -> MemoryReport:
    """Count the chunk buffers and optimizer state of ``zero`` (a `ZeroOptimizer`) on this rank."""
    seen: set[int] = set()
    totals = {"params": 0, "grads": 0, "masters": 0, "optimizer_states": 0}
    padding = host = 0
    kind_of = {"param": "params", "param_shard": "params", "grad": "grads", "grad_shard": "grads", "master": "masters"}

    def count(kind: str, tensor: torch.Tensor) -> int:
        storage = tensor.untyped_storage()
        if storage.data_ptr() in seen:
            return 0
        seen.add(storage.data_ptr())
        totals[kind] += storage.nbytes()
        return storage.nbytes()

    for chunk in zero.chunks:
        for name, buffer in chunk.buffers.items():
            if buffer.aliases is not None:
                continue
            kind = "optimizer_states" if name.startswith("optim/") else kind_of[name]
            nbytes = count(kind, buffer.tensor)
            host += nbytes if buffer.tier == "host" else 0
            if nbytes:
                full = name in ("param", "grad")
                pad_elements = chunk.padding_numel if full else _shard_padding(chunk)
                padding += pad_elements * buffer.tensor.element_size()
    for state in zero.optimizer.state.values():  # scalars such as ``step`` that are not chunk buffers
        for value in state.values():
            if isinstance(value, torch.Tensor):
                nbytes = count("optimizer_states", value)
                host += nbytes if zero.offload else 0  # they live beside the masters
    gatherer = getattr(zero, "gatherer", None)
    peak_gathered = gatherer.peak_gathered_bytes if gatherer is not None else 0
    return MemoryReport(
        padding=padding, host=host, workspace=zero.pool.nbytes, peak_gathered_params=peak_gathered, **totals
    )


def _shard_padding(chunk) -> int:
    """Padding elements inside this rank's shard (padding sits at the end of the chunk)."""
    start, end = chunk.shard_offset, chunk.shard_offset + chunk.shard_numel
    return max(0, end - max(start, chunk.used_numel))


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-rank bytes the ZeRO formulas predict, split by where they live."""

    device: float
    host: float


def estimate_memory(
    num_params: int, *, stage: int, dp: int, precision: str = "mixed", offload: bool = False
) -> MemoryEstimate:
    """Per-rank model-state memory of ZeRO, from the paper's formulas (activations and padding excluded).

    Mixed precision (Adam, Ψ parameters, N = ``dp``): 2Ψ compute params + 2Ψ grads + 12Ψ fp32 master, momentum
    and variance; stage 0: 16Ψ, stage 1: 4Ψ + 12Ψ/N, stage 2: 2Ψ + 14Ψ/N, stage 3: 16Ψ/N. fp32 (masters alias
    the parameters): 4Ψ + 4Ψ + 8Ψ, sharded the same way. ``offload`` moves the optimizer part (12Ψ/N or 8Ψ/N)
    to the host (ZeRO-Offload).

    Args:
        num_params: Ψ, the number of parameters.
        stage: 0, 1, 2 or 3.
        dp: N, the data-parallel size.
        precision: ``"mixed"`` (bf16/fp16 compute, fp32 masters) or ``"fp32"``.
        offload: whether optimizer state and masters live on the host.
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage={stage!r} is not a ZeRO stage; use 0, 1, 2 or 3")
    if dp < 1:
        raise ValueError(f"dp={dp} must be at least 1")
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not supported; use one of {PRECISIONS}")
    params_bytes, grad_bytes, optim_bytes = (2, 2, 12) if precision == "mixed" else (4, 4, 8)
    psi = float(num_params)
    params = params_bytes * psi / (dp if stage >= 3 else 1)
    grads = grad_bytes * psi / (dp if stage >= 2 else 1)
    optim = optim_bytes * psi / (dp if stage >= 1 else 1)
    if offload:
        return MemoryEstimate(device=params + grads, host=optim)
    return MemoryEstimate(device=params + grads + optim, host=0.0)
