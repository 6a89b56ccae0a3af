"""Replicas start equal: a plugin broadcasts the model's parameters and buffers from one rank before sharding it.

torch seeds every process differently, so a model built without a seed holds other values on every rank. DDP
broadcasts rank 0's parameters and buffers when it wraps the model; the `Zero`, `Gemini` and `HybridParallel`
plugins do the same, with `broadcast_model_state`, before anything is sharded: before chunking (ZeRO-3 and Gemini
keep only a shard of every chunk) and before a plan cuts the model into tensor-parallel shards and pipeline
stages. Nothing carries a layout yet then: every rank holds the whole model, and after the broadcast every shard
and every stage is a piece of rank 0's model (a broadcast per replica group after sharding would leave the
tensor-parallel shards drawn from different ranks' initializations, and tied weights on different stages apart).
Its cost is DDP's: the model's bytes, once, at boost time. A model on the meta device is not broadcast: the plan
materializes it from the plugin's seed (or a pretrained source), the same on every rank.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from colo.comm import Group, broadcast

BUCKET_BYTES = 256 * 2**20
"""Bytes broadcast at once (DDP's broadcast bucket is 250 MB): the buffer each rank holds meanwhile."""
_ALIGNMENT = 16
"""Byte alignment of every tensor in a bucket, so that its bytes view back as its dtype."""


def model_tensors(*modules: nn.Module) -> list[torch.Tensor]:
    """The parameters and buffers of ``modules``, each once (tied weights and shared modules too), in order; tensors
    on the meta device and empty ones are left out (there is nothing to copy)."""
    seen: set[int] = set()
    tensors = []
    for module in modules:
        for tensor in (*module.parameters(), *module.buffers()):
            if id(tensor) in seen or tensor.is_meta or tensor.numel() == 0:
                continue
            seen.add(id(tensor))
            tensors.append(tensor)
    return tensors


def comm_device(group: Group) -> torch.device:
    """Where a small tensor for a collective over ``group`` must live: the current CUDA device under NCCL."""
    return torch.device("cuda", torch.cuda.current_device()) if group.backend == "nccl" else torch.device("cpu")


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGNMENT) * _ALIGNMENT


def _buckets(tensors: list[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
    buckets: list[list[torch.Tensor]] = [[]]
    size = 0
    for tensor in tensors:
        nbytes = _aligned(tensor.numel() * tensor.element_size())
        if buckets[-1] and size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(tensor)
        size += nbytes
    return buckets


@torch.no_grad()
def broadcast_model_state(tensors: Iterable[torch.Tensor], *, group: Group, bucket_bytes: int = BUCKET_BYTES) -> None:
    """Give every tensor of ``tensors`` (`model_tensors`) the values of group rank 0's, in place, as DDP does when
    it wraps a model: the tensors' bytes go in buckets of up to ``bucket_bytes``, one broadcast each, whatever
    their dtypes. Every rank of ``group`` calls it with the same tensors (the same model, built the same way).

    Args:
        tensors: the tensors to make equal (unsharded: each rank holds the same elements).
        group: the ranks that replicate them.
        bucket_bytes: the most bytes broadcast at once. Default: `BUCKET_BYTES`.
    """
    tensors = list(tensors)
    if group.size == 1 or not tensors:
        return
    device = comm_device(group)
    source = group.rank == 0
    for bucket in _buckets(tensors, bucket_bytes):
        sizes = [t.numel() * t.element_size() for t in bucket]
        offsets = [0]
        for nbytes in sizes[:-1]:
            offsets.append(offsets[-1] + _aligned(nbytes))
        flat = torch.empty(offsets[-1] + sizes[-1], dtype=torch.uint8, device=device)
        if source:
            for tensor, offset, nbytes in zip(bucket, offsets, sizes):
                flat[offset : offset + nbytes].copy_(tensor.detach().reshape(-1).view(torch.uint8))
        broadcast(flat, src=0, group=group)
        if not source:
            for tensor, offset, nbytes in zip(bucket, offsets, sizes):
                tensor.copy_(flat[offset : offset + nbytes].view(tensor.dtype).view(tensor.shape))
