"""Activation checkpointing applied from outside the model, to colo's native models and Hugging Face models alike.

`apply_activation_checkpointing` changes how each block of a model keeps what its backward needs, without touching
the model file (as torchtitan's ``apply_ac`` does):

- ``"full"``: a block keeps only its inputs and recomputes its whole forward in backward (Chen et al., 2016,
  "Training Deep Nets with Sublinear Memory Cost"), on `torch.utils.checkpoint` (non-reentrant).
- ``"selective"``: a block keeps the outputs of its matmuls and of its attention (SDPA's, or colo.kernels'
  ``torch.ops.colo.flash_attention``), and recomputes the cheap element-wise ops (norms, activations, rotary,
  residual adds) around them (Korthikanti et al., 2022, "Reducing Activation Recomputation in Large Transformer
  Models"), with torch's selective-checkpoint policy API.
- ``"offload"``: nothing is recomputed; the activations a block saves for backward are kept in host memory
  (`torch.autograd.graph.save_on_cpu`, pinned when CUDA is available) and copied back in backward; the weights
  its matmuls save stay where they are.

``every=k`` applies the mode to every k-th block only (blocks ``k-1, 2k-1, ...``), trading memory for compute
between no checkpointing and every block.

The blocks' ``forward`` is replaced on the instance, so module and parameter names, the state dict, optimizers,
plans and checkpoints are unchanged, and hooks registered on a block still run once per forward (outside the
checkpointed region). Apply it after parallelization and before ``torch.compile``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
from torch import nn
from torch.autograd.graph import save_on_cpu
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from colo.kernels.library import operators

MODES = ("full", "selective", "offload")
"""The checkpointing modes `apply_activation_checkpointing` accepts."""

_MARK = "_colo_activation_checkpointing"

_aten = torch.ops.aten
_MATMUL_OPS = {_aten.mm.default, _aten.addmm.default}
"""Linear layers' matmuls (``F.linear`` dispatches to these): outputs kept by ``"selective"``."""
_BATCHED_MATMUL_OPS = {_aten.bmm.default, _aten.baddbmm.default}
"""Batched matmuls (an explicit attention's ``q k^T`` and ``p v``): kept unless larger than their inputs."""
_ATTENTION_OPS = {
    getattr(_aten, name).default
    for name in (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_flash_attention_forward",
        "_efficient_attention_forward",
    )
    if hasattr(_aten, name)
}
"""Fused attention kernels (``F.scaled_dot_product_attention``): output and logsumexp kept by ``"selective"``."""
_COLO_KEPT_OPS = {operators()[name] for name in ("flash_attention", "fused_linear_cross_entropy")}
"""colo.kernels operators (`colo.kernels.library`) kept by ``"selective"``: attention (its output and logsumexp) and
the fused output projection + loss (its loss and the gradients it computes in the forward). The others (``rms_norm``,
``rotary``, ``swiglu``, ...) are element-wise and recomputed."""


def selective_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    """The ``"selective"`` policy: which op outputs a checkpointed block keeps (for
    `torch.utils.checkpoint.create_selective_checkpoint_contexts`).

    Kept: linear-layer matmuls (``mm``, ``addmm``), fused attention (``scaled_dot_product_attention``'s kernels
    and ``torch.ops.colo.flash_attention``, on either kernel backend), ``torch.ops.colo.fused_linear_cross_entropy``,
    and batched matmuls whose output is no larger than their larger input, i.e. an explicit attention's ``p v``
    but not its ``(seq, seq)`` scores when ``seq > head_dim``. Everything else (element-wise ops, colo's norms,
    rotary and SwiGLU, softmax, copies, collectives) is recomputed in backward. Work that is not a registered
    operator (a Triton kernel launched from a plain autograd function) is invisible to the policy and always
    recomputed.

    Args:
        ctx: the `torch.utils.checkpoint.SelectiveCheckpointContext` (unused).
        op: the aten op that ran.
        *args: its positional arguments.
        **kwargs: its keyword arguments.

    Returns:
        CheckpointPolicy: ``MUST_SAVE`` for the ops above, ``PREFER_RECOMPUTE`` otherwise.
    """
    if op in _MATMUL_OPS or op in _ATTENTION_OPS or op in _COLO_KEPT_OPS:
        return CheckpointPolicy.MUST_SAVE
    if op in _BATCHED_MATMUL_OPS:
        left, right = args[-2], args[-1]  # bmm(a, b) and baddbmm(input, a, b)
        output_numel = left.shape[0] * left.shape[1] * right.shape[2]
        if output_numel <= max(left.numel(), right.numel()):
            return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts():
    return create_selective_checkpoint_contexts(selective_policy)


def _is_parameter(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a parameter or a view of one (a matmul saves ``weight.t()``)."""
    return isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter)


class _OffloadToHost(save_on_cpu):
    """`save_on_cpu` (pinned when CUDA is available) that leaves parameters where they are: they stay alive for
    the optimizer anyway, so copying the weights a matmul saves would only double the host traffic."""

    def __init__(self) -> None:
        super().__init__(pin_memory=torch.cuda.is_available())
        to_host, from_host = self.pack_hook, self.unpack_hook

        def pack(tensor: torch.Tensor):
            return (tensor, None) if _is_parameter(tensor) else (None, to_host(tensor))

        def unpack(packed) -> torch.Tensor:
            kept, on_host = packed
            return kept if on_host is None else from_host(on_host)

        self.pack_hook, self.unpack_hook = pack, unpack


_HF_CACHE_ARGUMENTS = ("cache", "past_key_value", "past_key_values", "layer_past")
"""The keyword arguments through which Hugging Face blocks read and write their KV cache."""


def _without_kv_cache(kwargs: dict, *, keep_cache: bool) -> dict:
    """A recomputed block's keyword arguments without a KV cache to write: the recomputation in backward would
    write it a second time (keys and values appended twice) and, under ``"selective"``, run other ops than the
    forward did (attention over the longer cache), which torch refuses. As transformers' own gradient checkpointing
    does, ``use_cache`` becomes ``False`` and a Hugging Face cache ``None`` (unless the block only reads its cache:
    ``_can_checkpoint_with_cache``); in training the cache would only hold this forward's keys and values, which
    the block computes anyway. colo's ``kv_cache`` (decoding) is refused: decode under ``torch.no_grad()``."""
    if kwargs.get("kv_cache") is not None:
        raise ValueError(
            "apply_activation_checkpointing: a checkpointed block got a kv_cache while gradients are recorded; its "
            "recomputation in backward would write the cache twice. Decode under torch.no_grad() (checkpointed "
            "blocks then run as they are)"
        )
    kwargs = dict(kwargs)
    if kwargs.get("use_cache"):
        kwargs["use_cache"] = False
    if not keep_cache:
        for name in _HF_CACHE_ARGUMENTS:
            if kwargs.get(name) is not None:
                kwargs[name] = None
    return kwargs


class _CheckpointedForward:
    """A block's ``forward`` run under one checkpointing mode; installed as the block's instance attribute."""

    def __init__(self, forward: Callable, mode: str, *, keep_cache: bool = False) -> None:
        self.forward = forward
        self.mode = mode
        self.keep_cache = keep_cache

    def __call__(self, *args, **kwargs):
        if not torch.is_grad_enabled():  # evaluation: nothing is saved for backward
            return self.forward(*args, **kwargs)
        if self.mode == "offload":
            with _OffloadToHost():
                return self.forward(*args, **kwargs)
        kwargs = _without_kv_cache(kwargs, keep_cache=self.keep_cache)  # the block's forward runs twice
        if self.mode == "selective":
            return checkpoint(self.forward, *args, use_reentrant=False, context_fn=_selective_contexts, **kwargs)
        return checkpoint(self.forward, *args, use_reentrant=False, **kwargs)


def find_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The repeated blocks of ``model``, in order, with their qualified names.

    The blocks are the children of every `nn.ModuleList` / `nn.ModuleDict` whose children all have the same type
    and own parameters, outermost such containers only: ``layers`` of colo's Llama, ``model.layers`` of Hugging
    Face's ``LlamaForCausalLM``, ``transformer.h`` of GPT-2, both ``encoder.block`` and ``decoder.block`` of T5.

    Args:
        model (nn.Module): the model.

    Returns:
        list[tuple[str, nn.Module]]: ``(qualified name, block)`` pairs; empty when the model has no such container.
    """
    found: list[tuple[str, nn.Module]] = []
    containers: list[str] = []
    for name, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            continue
        if any(name.startswith(f"{outer}.") for outer in containers):
            continue  # nested inside a block stack already found (experts of an MoE layer, say)
        children = list(module.named_children())
        if not children or len({type(child) for _, child in children}) != 1:
            continue
        if not all(any(True for _ in child.parameters()) for _, child in children):
            continue
        containers.append(name)
        found.extend((f"{name}.{child_name}" if name else child_name, child) for child_name, child in children)
    return found


def _resolve_blocks(
    model: nn.Module, blocks: Sequence[str] | Callable[[nn.Module], Iterable[nn.Module]] | None
) -> list[tuple[str, nn.Module]]:
    """``(name, block)`` pairs from the ``blocks`` argument of `apply_activation_checkpointing`."""
    model_type = type(model).__name__
    if blocks is None:
        found = find_blocks(model)
        if not found:
            raise ValueError(
                f"apply_activation_checkpointing: found no stack of blocks in {model_type} (an nn.ModuleList or "
                "nn.ModuleDict of same-typed modules with parameters, like Llama's `layers`); pass blocks=[names] "
                "or blocks=callable(model) -> modules"
            )
        return found
    modules = dict(model.named_modules())
    if callable(blocks):
        names = {id(module): name for name, module in modules.items()}
        picked = list(blocks(model))
        foreign = [type(module).__name__ for module in picked if id(module) not in names]
        if foreign:
            raise ValueError(
                f"apply_activation_checkpointing: blocks(model) returned modules that are not in {model_type}: "
                f"{foreign}"
            )
        return [(names[id(module)], module) for module in picked]
    if isinstance(blocks, str) or not all(isinstance(name, str) for name in blocks):
        raise TypeError(
            f"apply_activation_checkpointing: blocks must be a list of module names or a callable, not {blocks!r}"
        )
    resolved = []
    for name in blocks:
        if name not in modules:
            raise ValueError(f"apply_activation_checkpointing: {model_type} has no module named {name!r}")
        module = modules[name]
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):  # a container stands for its children
            resolved.extend((f"{name}.{child}" if name else child, block) for child, block in module.named_children())
        else:
            resolved.append((name, module))
    return resolved


def apply_activation_checkpointing(
    model: nn.Module,
    *,
    mode: str = "full",
    every: int = 1,
    blocks: Sequence[str] | Callable[[nn.Module], Iterable[nn.Module]] | None = None,
) -> list[str]:
    """Checkpoint the activations of ``model``'s blocks, in place.

    Each chosen block's ``forward`` is replaced (on the instance) by one that runs the original under ``mode``;
    names, parameters and the state dict do not change. Gradients are those of the unmodified model: ``"full"``
    and ``"selective"`` recompute the same ops on the same inputs (with the RNG state restored, so dropout draws
    the same masks), ``"offload"`` recomputes nothing. In evaluation (``torch.no_grad``) the blocks run as before.
    While gradients are recorded, ``"full"`` and ``"selective"`` blocks write no KV cache (a Hugging Face model's
    ``use_cache=True``, its config default, is turned off for them and their cache argument dropped, as
    transformers' own gradient checkpointing does): the recomputation would write it a second time.

    Args:
        model (nn.Module): the model, after parallelization and before ``torch.compile``.
        mode (str): ``"full"`` (keep each block's inputs, recompute the block), ``"selective"`` (keep matmul and
            attention outputs too, recompute the element-wise ops; see `selective_policy`) or ``"offload"`` (keep
            the activations the block saves in host memory, its parameters in place). Default: ``"full"``.
        every (int): apply ``mode`` to every ``every``-th block (the blocks at positions ``every - 1``,
            ``2 * every - 1``, ...); ``1``: all of them. Default: ``1``.
        blocks (Sequence[str] | Callable | None): which modules are the blocks: qualified module names (the name
            of an ``nn.ModuleList`` / ``nn.ModuleDict`` stands for its children), or a callable taking the model
            and returning the block modules in order; ``None``: `find_blocks`. Default: ``None``.

    Returns:
        list[str]: the qualified names of the blocks now checkpointed.

    Raises:
        ValueError: for an unknown ``mode``, ``every < 1``, no blocks found, or a block already checkpointed (apply
            it once: a second application would nest checkpoints).

    Example::

        model = Llama(get_preset("tiny"))
        apply_activation_checkpointing(model, mode="selective", every=2)
        model(ids, labels=ids).loss.backward()
    """
    if mode not in MODES:
        raise ValueError(f"apply_activation_checkpointing: mode={mode!r} is unknown; use one of {MODES}")
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"apply_activation_checkpointing: every={every!r} must be a positive integer (1: every block)")
    chosen = [pair for index, pair in enumerate(_resolve_blocks(model, blocks)) if (index + 1) % every == 0]
    for name, block in chosen:
        applied = getattr(block, _MARK, None)
        if applied is not None:
            raise ValueError(
                f"apply_activation_checkpointing: block {name!r} of {type(model).__name__} is already checkpointed "
                f"(mode={applied!r}); apply activation checkpointing once (the Booster applies it when the plugin "
                "sets activation_checkpointing)"
            )
    for _, block in chosen:
        keep_cache = bool(getattr(block, "_can_checkpoint_with_cache", False))  # transformers' read-only caches
        block.forward = _CheckpointedForward(block.forward, mode, keep_cache=keep_cache)
        setattr(block, _MARK, mode)
    return [name for name, _ in chosen]
