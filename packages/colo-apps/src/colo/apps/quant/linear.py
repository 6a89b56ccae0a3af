"""`QuantizedLinear`: a linear layer whose weight is stored in one of colo's weight-only formats (`formats`) and
dequantized on the fly.

The stored state is plain tensors (buffers): ``qweight``, ``scale``, ``zero`` (int4 only) and ``bias`` (if any), so
a state dict of a quantized model is ordinary tensors that safetensors writes without pickle. How a forward
computes is the ``backend``, which changes no stored tensor:

- ``"reference"``: dequantize the whole weight to the input's dtype (in fp32 arithmetic) and ``F.linear``. Any
  device and dtype; the definition the others are checked against.
- ``"torchao"`` (int8): torchao's ``Int8Tensor`` (weight-only, per row) built on the stored codes and scales:
  ``(x @ q.T) * scale`` (the ``quant`` extra; torchao's int4 layouts do not run on CPU, so int4 has no torchao
  backend).
- ``"aten"``: torch's weight-only packed matmuls, ``torch._weight_int8pack_mm`` (int8; the activations' dtype) and
  ``torch._weight_int4pack_mm_for_cpu`` (int4 on CPU, bf16 activations, repacked once into torch's tiled layout
  and cached, not saved). These read the narrow weights directly and are the fast path on CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .formats import (
    QuantConfig,
    dequantize_int4,
    dequantize_int8,
    quantize_int4,
    quantize_int8,
    quantized_weight_bytes,
    unpack_int4,
)

BACKENDS = ("reference", "torchao", "aten")
"""How `QuantizedLinear` computes (see the module docstring)."""


class QuantizedLinear(nn.Module):
    """``y = x W^T + b`` with ``W`` held in colo's int8 or packed int4 format.

    Build one from a float layer with `from_linear`, or empty (zeros) to be filled from a checkpoint.

    Args:
        in_features (int): input width.
        out_features (int): output width.
        config (QuantConfig): the format (mode and int4 group size).
        bias (bool): hold a bias (kept in ``dtype``). Default: ``False``.
        dtype (torch.dtype): the layer's compute dtype, the float weight's dtype (``KVCache.for_model`` and the
            caller's activations use it). Default: ``torch.float32``.
        device (torch.device | str | None): where the buffers live. Default: ``None``.
        backend (str): one of `BACKENDS`. Default: ``"reference"``.

    Raises:
        ValueError: an unknown backend, or an int4 group size that does not divide ``in_features``.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        config: QuantConfig,
        bias: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
        backend: str = "reference",
    ):
        super().__init__()
        config.check_in_features(in_features, name="QuantizedLinear")
        self.in_features, self.out_features, self.config = in_features, out_features, config
        self.dtype = dtype
        self.backend = check_backend(backend, config)
        if config.mode == "int8":
            self.register_buffer("qweight", torch.zeros(out_features, in_features, dtype=torch.int8, device=device))
            self.register_buffer("scale", torch.ones(out_features, dtype=torch.float32, device=device))
            self.zero = None
        else:
            groups = in_features // config.group_size
            self.register_buffer(
                "qweight", torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device)
            )
            self.register_buffer("scale", torch.ones(out_features, groups, dtype=torch.float32, device=device))
            self.register_buffer("zero", torch.zeros(out_features, groups, dtype=torch.float32, device=device))
        self.register_buffer("bias", torch.zeros(out_features, dtype=dtype, device=device) if bias else None)
        self._aten_cache: tuple | None = None

    @classmethod
    @torch.no_grad()
    def from_linear(cls, linear: nn.Linear, config: QuantConfig, *, backend: str = "reference", name: str = "linear"):
        """Quantize ``linear``'s weight (its bias kept as is) into a new `QuantizedLinear`.

        Args:
            linear (nn.Linear): the float layer.
            config (QuantConfig): the format.
            backend (str): the new layer's backend. Default: ``"reference"``.
            name (str): the layer's name in its model, for error messages. Default: ``"linear"``.
        """
        weight = linear.weight
        config.check_in_features(weight.shape[1], name=name)
        layer = cls(
            weight.shape[1],
            weight.shape[0],
            config=config,
            bias=linear.bias is not None,
            dtype=weight.dtype,
            device=weight.device,
            backend=backend,
        )
        if config.mode == "int8":
            layer.qweight, layer.scale = quantize_int8(weight)
        else:
            layer.qweight, layer.scale, layer.zero = quantize_int4(weight, config.group_size)
        if linear.bias is not None:
            layer.bias = linear.bias.detach().clone()
        return layer

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The ``(out, in)`` weight the stored codes stand for, in ``dtype`` (default the layer's)."""
        dtype = dtype or self.dtype
        if self.config.mode == "int8":
            return dequantize_int8(self.qweight, self.scale, dtype)
        return dequantize_int4(self.qweight, self.scale, self.zero, dtype)

    def codes(self) -> torch.Tensor:
        """The integer codes, unpacked: int8 ``(out, in)`` in [-127, 127], or uint8 ``(out, in)`` in [0, 15]."""
        return self.qweight if self.config.mode == "int8" else unpack_int4(self.qweight)

    def storage_bytes(self) -> int:
        """Bytes of the stored weight (codes, scales, zero points; the bias not counted)."""
        return quantized_weight_bytes(self.out_features, self.in_features, self.config)

    def _apply(self, fn, recurse=True):
        """Moves apply to every buffer; a dtype cast (``model.to(torch.bfloat16)``, ``.half()``) changes the compute
        dtype and the bias but leaves the fp32 scales and zero points as they are (the stored format)."""
        self._aten_cache = None  # a move or a reload of the buffers invalidates the repacked int4 weight
        probe = fn(torch.zeros((), dtype=self.dtype, device=self.scale.device))
        if probe.dtype == self.dtype:
            return super()._apply(fn, recurse)
        kept = {name: getattr(self, name) for name in ("scale", "zero") if getattr(self, name) is not None}
        super()._apply(fn, recurse)
        for name, tensor in kept.items():
            setattr(self, name, tensor.to(probe.device))
        self.dtype = probe.dtype
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.backend == "reference":
            return F.linear(x, self.dequantize(x.dtype), self.bias)
        if self.backend == "torchao":
            return F.linear(x, self._torchao_weight(x.dtype), self.bias)
        return self._aten_forward(x)

    def _torchao_weight(self, dtype: torch.dtype):
        from torchao.quantization import Int8Tensor

        return Int8Tensor(self.qweight, self.scale[:, None], [1, self.in_features], dtype)

    def _aten_forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        if self.config.mode == "int8":
            out = torch._weight_int8pack_mm(flat, self.qweight, self.scale.to(x.dtype))
        else:
            if x.device.type != "cpu" or x.dtype != torch.bfloat16:
                raise ValueError(
                    f"backend='aten' int4 runs on CPU with bfloat16 activations (got {x.dtype} on {x.device}); "
                    "convert the model to bfloat16 or use backend='reference'"
                )
            packed, scale_and_zero = self._aten_int4_weight()
            out = torch._weight_int4pack_mm_for_cpu(flat, packed, self.config.group_size, scale_and_zero)
        out = out.reshape(*x.shape[:-1], self.out_features)
        return out + self.bias if self.bias is not None else out

    def _aten_int4_weight(self) -> tuple[torch.Tensor, torch.Tensor]:
        """torch's CPU int4 layout, built once: its kernel computes ``(q - 8) * scale + zero'``, so colo's zero
        point (the value of code 0) becomes ``zero' = zero + 8 * scale``; scales and zeros are bf16 there."""
        if self._aten_cache is None:
            codes = unpack_int4(self.qweight).to(torch.int32)
            packed = torch._convert_weight_to_int4pack_for_cpu(codes, 1)
            scale_and_zero = torch.stack((self.scale, self.zero + 8 * self.scale), dim=-1).transpose(0, 1)
            self._aten_cache = (packed, scale_and_zero.contiguous().to(torch.bfloat16))
        return self._aten_cache

    def extra_repr(self) -> str:
        group = f", group_size={self.config.group_size}" if self.config.mode == "int4" else ""
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, mode={self.config.mode}{group}, "
            f"bias={self.bias is not None}, dtype={self.dtype}, backend={self.backend}"
        )


def check_backend(backend: str, config: QuantConfig) -> str:
    """``backend`` if it can run ``config``; a `ValueError` saying what to use otherwise (torchao imported lazily,
    only when asked for)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is unknown; use one of {BACKENDS}")
    if backend == "torchao":
        if config.mode != "int8":
            raise ValueError(
                "backend='torchao' serves int8 only (torchao's int4 layouts do not run on CPU); for int4 use "
                "backend='aten' (CPU, bfloat16) or 'reference'"
            )
        try:
            import torchao.quantization  # noqa: F401
        except ImportError as error:
            raise ImportError(
                "backend='torchao' needs torchao: pip install 'colo-apps[quant]' (or use backend='reference')"
            ) from error
    return backend
