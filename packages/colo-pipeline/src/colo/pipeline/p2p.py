"""Activations between stages: flattening tensors, tuples and dicts, and their shape metadata.

A stage's output (a tensor, or a tuple, list or dict of tensors) is flattened into a list of tensors plus a
`StageMeta` describing the structure, shapes, dtypes and which tensors carry gradients. The first time a
stage boundary is crossed, the sender ships the `StageMeta` (JSON in a fixed-size byte tensor, so it travels
in the same kind of batched p2p as the data); the receiver caches it and allocates buffers from it for
every later microbatch and step. The sender checks each later output against the cached metadata, so a
change of shape fails with a clear message instead of corrupting a receive.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

META_BYTES = 8192
"""Size of the byte buffer that carries one boundary's metadata."""


@dataclass(frozen=True)
class TensorMeta:
    """Shape, dtype and gradient flag of one tensor crossing a stage boundary."""

    shape: tuple[int, ...]
    dtype: str
    requires_grad: bool

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype as a ``torch.dtype``."""
        return getattr(torch, self.dtype.removeprefix("torch."))


@dataclass(frozen=True)
class StageMeta:
    """The structure of what crosses a stage boundary.

    Attributes:
        kind: ``"tensor"``, ``"tuple"``, ``"list"`` or ``"dict"``.
        keys: the dict's keys, in order (empty otherwise).
        tensors: one `TensorMeta` per flattened tensor.
    """

    kind: str
    keys: tuple[str, ...]
    tensors: tuple[TensorMeta, ...]

    def to_bytes(self) -> torch.Tensor:
        """The metadata as a ``uint8`` tensor of `META_BYTES` bytes (length-prefixed JSON)."""
        tensors = [[list(t.shape), t.dtype, t.requires_grad] for t in self.tensors]
        payload = json.dumps({"kind": self.kind, "keys": list(self.keys), "tensors": tensors}).encode()
        if len(payload) + 4 > META_BYTES:
            raise ValueError(
                f"stage output metadata takes {len(payload)} bytes, more than the {META_BYTES - 4} allowed; "
                f"return fewer tensors from a stage (pack them into one)"
            )
        buffer = torch.zeros(META_BYTES, dtype=torch.uint8)
        buffer[:4] = torch.tensor(list(len(payload).to_bytes(4, "little")), dtype=torch.uint8)
        buffer[4 : 4 + len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        return buffer

    @classmethod
    def from_bytes(cls, buffer: torch.Tensor) -> StageMeta:
        """Decode `to_bytes`'s output."""
        raw = bytes(buffer.tolist())
        length = int.from_bytes(raw[:4], "little")
        data = json.loads(raw[4 : 4 + length].decode())
        tensors = tuple(TensorMeta(tuple(shape), dtype, bool(grad)) for shape, dtype, grad in data["tensors"])
        return cls(data["kind"], tuple(data["keys"]), tensors)


def flatten(value: Any, *, what: str = "stage output") -> tuple[list[torch.Tensor], StageMeta]:
    """Split a tensor, or a tuple / list / dict of tensors, into its tensors and a `StageMeta`."""
    if isinstance(value, torch.Tensor):
        kind, keys, tensors = "tensor", (), [value]
    elif isinstance(value, (tuple, list)):
        kind, keys, tensors = type(value).__name__, (), list(value)
    elif isinstance(value, dict):
        kind, keys, tensors = "dict", tuple(str(k) for k in value), list(value.values())
        if any(not isinstance(k, str) for k in value):
            raise TypeError(f"{what}: dict keys must be strings, got {list(value)}")
    else:
        raise TypeError(f"{what} must be a tensor or a tuple, list or dict of tensors, not {type(value).__name__}")
    for index, tensor in enumerate(tensors):
        if not isinstance(tensor, torch.Tensor):
            where = keys[index] if keys else index
            raise TypeError(
                f"{what}: item {where!r} is a {type(tensor).__name__}; only tensors cross stage boundaries "
                f"(make it a tensor, or compute it inside the stage that needs it)"
            )
    meta = StageMeta(
        kind,
        keys,
        tuple(TensorMeta(tuple(t.shape), str(t.dtype), bool(t.requires_grad)) for t in tensors),
    )
    return tensors, meta


def unflatten(tensors: Sequence[torch.Tensor], meta: StageMeta) -> Any:
    """Rebuild the structure `flatten` took apart."""
    if meta.kind == "tensor":
        return tensors[0]
    if meta.kind == "dict":
        return dict(zip(meta.keys, tensors))
    if meta.kind == "list":
        return list(tensors)
    return tuple(tensors)


def empty_like_meta(meta: StageMeta, *, device: torch.device) -> list[torch.Tensor]:
    """Receive buffers for one crossing of a boundary described by ``meta``."""
    return [torch.empty(t.shape, dtype=t.torch_dtype, device=device) for t in meta.tensors]


def call_stage(module: torch.nn.Module, value: Any) -> Any:
    """Call a stage module on what crossed the boundary: ``m(x)``, ``m(*tuple)`` or ``m(**dict)``."""
    if isinstance(value, dict):
        return module(**value)
    if isinstance(value, (tuple, list)):
        return module(*value)
    return module(value)


def split_microbatches(value: Any, num_microbatches: int, *, name: str) -> list[Any]:
    """Split a batch (tensor, tuple, list or dict of tensors) into ``num_microbatches`` along dim 0."""
    tensors, meta = flatten(value, what=name)
    pieces = []
    for tensor in tensors:
        if tensor.dim() == 0:
            raise ValueError(f"{name}: a scalar cannot be split into microbatches; give every tensor a batch dim 0")
        if tensor.shape[0] % num_microbatches:
            raise ValueError(
                f"{name}: batch size {tensor.shape[0]} is not divisible by num_microbatches={num_microbatches}; "
                f"use a batch size that is a multiple of {num_microbatches}, or another num_microbatches"
            )
        pieces.append(tensor.chunk(num_microbatches, dim=0))
    return [unflatten([p[i] for p in pieces], meta) for i in range(num_microbatches)]
