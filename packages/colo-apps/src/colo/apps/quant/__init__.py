"""colo.apps.quant: weight-only quantization of the native Llama's and Hugging Face Llama's linear layers.

- `QuantConfig`: int8 (symmetric, per output channel) or int4 (asymmetric, group-wise, group 32 / 64 / 128, packed
  two codes a byte); the formats, rounding rule and storage formulas are in `colo.apps.quant.formats`.
- `QuantizedLinear`: stores codes + fp32 scales (+ zero points) as plain tensors and dequantizes on the fly
  (``backend``: ``"reference"``, ``"torchao"`` for int8 through torchao's ``Int8Tensor``, ``"aten"`` for torch's
  packed weight-only matmuls).
- `quantize_model(model, "int4", group_size=32)`: in place, every decoder linear layer (``lm_head`` kept in float).
- `save_quantized` / `load_quantized` / `quantize_checkpoint`: colo safetensors checkpoints, no pickle; the last is
  ``colo convert CKPT OUT --quantize int8|int4 [--group-size N]``.

Example::

    from colo.apps.runs import load_llama

    model, run = load_llama("runs/tiny-llama/checkpoints/step-00000300")
    quantize_model(model, "int4", group_size=32)
    save_quantized(model, "tiny-llama-int4", run=run)
    model, metadata = load_quantized("tiny-llama-int4")
"""

from .checkpoint import QUANT_KEY, is_quantized_checkpoint, load_quantized, quantize_checkpoint, save_quantized
from .formats import (
    GROUP_SIZES,
    MODES,
    QuantConfig,
    dequantize_int4,
    dequantize_int8,
    pack_int4,
    quantize_int4,
    quantize_int8,
    quantized_weight_bytes,
    unpack_int4,
)
from .linear import BACKENDS, QuantizedLinear
from .model import quantize_model, quantize_structure, set_backend, storage_report

__all__ = [
    "BACKENDS",
    "GROUP_SIZES",
    "MODES",
    "QUANT_KEY",
    "QuantConfig",
    "QuantizedLinear",
    "dequantize_int4",
    "dequantize_int8",
    "is_quantized_checkpoint",
    "load_quantized",
    "pack_int4",
    "quantize_checkpoint",
    "quantize_int4",
    "quantize_int8",
    "quantize_model",
    "quantize_structure",
    "quantized_weight_bytes",
    "save_quantized",
    "set_backend",
    "storage_report",
    "unpack_int4",
]
