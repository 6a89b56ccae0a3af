"""colo.kernels: Triton kernels with torch reference implementations and a dispatcher.

Each op has a torch reference (``<op>_reference``) and a Triton implementation, both autograd-aware, behind one
public function; `resolve_backend` picks Triton on CUDA and the reference elsewhere, ``COLO_KERNELS=triton|torch|auto``
or `use_backend` forces it. Kernels load, compute in fp32 and store in the tensor's dtype. Every op is a torch
operator, ``torch.ops.colo.<name>`` (`colo.kernels.library`), for either backend: ``torch.compile`` compiles models
using them without graph breaks, ``torch.export`` keeps them, and checkpointing policies can name them.
"""

from .adamw import FusedAdamW, adamw_reference, fused_adamw
from .cross_entropy import cross_entropy, cross_entropy_reference
from .dispatch import UnsupportedKernelInput, resolve_backend, triton_available, use_backend
from .document_mask import DocumentMask, build_document_mask, count_attention_blocks, document_ids_from_position_ids
from .flash_attention import (
    attention_block_backward,
    attention_block_forward,
    flash_attention,
    flash_attention_reference,
)
from .fused_linear_cross_entropy import fused_linear_cross_entropy, fused_linear_cross_entropy_reference
from .layer_norm import layer_norm, layer_norm_reference
from .rms_norm import rms_norm, rms_norm_reference
from .rotary import rotary, rotary_cos_sin, rotary_reference
from .softmax import softmax, softmax_reference
from .swiglu import swiglu, swiglu_reference

__version__ = "0.1.0"

__all__ = [
    "DocumentMask",
    "FusedAdamW",
    "UnsupportedKernelInput",
    "__version__",
    "adamw_reference",
    "attention_block_backward",
    "attention_block_forward",
    "build_document_mask",
    "count_attention_blocks",
    "cross_entropy",
    "cross_entropy_reference",
    "document_ids_from_position_ids",
    "flash_attention",
    "flash_attention_reference",
    "fused_adamw",
    "fused_linear_cross_entropy",
    "fused_linear_cross_entropy_reference",
    "layer_norm",
    "layer_norm_reference",
    "resolve_backend",
    "rms_norm",
    "rms_norm_reference",
    "rotary",
    "rotary_cos_sin",
    "rotary_reference",
    "softmax",
    "softmax_reference",
    "swiglu",
    "swiglu_reference",
    "triton_available",
    "use_backend",
]
