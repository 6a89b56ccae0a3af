"""`parallelize_dit_sequence`: Ulysses sequence parallelism over the `DiffusionTransformer`'s image (or video)
tokens, applied from outside (DeepSpeed-Ulysses, Jacobs et al., 2023; the way Open-Sora splits long video token
sequences):

- after the patch embedding (tokens plus their global sin-cos positions) every rank keeps its contiguous
  ``tokens / sp`` slice of the sequence (`colo.tensor.shard_sequence`, no communication);
- every block's self-attention core is wrapped by colo.tensor's `UlyssesAttention`: an all-to-all gives each rank
  the whole sequence with ``num_heads / sp`` heads, attention runs unchanged, a second all-to-all gives the slice
  back;
- the cross-attention needs nothing: its queries are this rank's tokens and its keys and values the whole caption,
  the same on every rank (so is its document mask, built from the caption mask per forward);
- the adaLN modulation, norms, MLPs and ``proj_out`` run on the slice; after ``proj_out`` the slices are
  all-gathered (`colo.tensor.all_gather_reduce_scatter`) so the unpatchify and the loss see the whole latent.

Gradients: every rank computes the whole loss from the gathered prediction. The gather's backward reduce-scatters
the prediction's gradient (the sum of ``sp`` equal copies) onto the slices, and the split's backward puts the
slice's gradient at its positions, so each rank's weight gradients are ``sp`` times its tokens' share of the
whole gradient; averaging them over the ``sp`` axis (as DDP and ZeRO do over the fused ``("dp", "sp")`` axes)
gives exactly the one-process gradient. Weights stay replicated over ``sp`` (no layouts attached).
"""

from __future__ import annotations

from torch import nn

from colo.comm import Mesh
from colo.tensor import ParallelStyle, UlyssesAttention, all_gather_reduce_scatter, parallelize, shard_sequence

from .config import DiTConfig


def dit_ulysses_plan() -> dict[str, ParallelStyle]:
    """The Ulysses plan of `DiffusionTransformer`: every block's self-attention core (``attn1.core``)."""
    return {"transformer_blocks.*.attn1.core": UlyssesAttention(layout="contiguous")}


def check_dit_sp_size(config: DiTConfig, sp: int) -> None:
    """Raise a `ValueError` naming the config field when ``sp`` ranks cannot split the heads (Ulysses gives each
    rank ``num_attention_heads / sp`` of them)."""
    heads = config.num_attention_heads
    if sp < 1 or heads % sp:
        valid = [size for size in range(1, heads + 1) if heads % size == 0]
        raise ValueError(
            f"sp={sp} does not divide DiTConfig.num_attention_heads={heads} (Ulysses gives each rank "
            f"num_attention_heads / sp heads); choose sp in {valid}"
        )


def parallelize_dit_sequence(model: nn.Module, *, mesh: Mesh, sp_axis: str = "sp") -> nn.Module:
    """Split a `DiffusionTransformer`'s tokens over ``sp_axis`` with Ulysses attention (module docstring), in
    place. Every rank of the axis must pass the same latents, timesteps and caption.

    Args:
        model (nn.Module): the model, the same on every rank.
        mesh (Mesh): the mesh; must have ``sp_axis``.
        sp_axis (str): the sequence-parallel mesh axis. Default: ``"sp"``.

    Returns:
        nn.Module: ``model``; its forward returns the whole prediction on every rank. A latent whose token count
        (``frames x height / patch x width / patch``) does not divide by the axis size raises a `ValueError` in
        the forward, before any communication.

    Raises:
        TypeError: ``model`` has no `DiTConfig`.
        ValueError: ``sp_axis`` is not on the mesh or its size does not divide the heads.
    """
    config = getattr(model, "config", None)
    if not isinstance(config, DiTConfig):
        raise TypeError(f"parallelize_dit_sequence: model must be a DiffusionTransformer, not {type(model).__name__}")
    if sp_axis not in mesh.axis_names:
        raise ValueError(
            f"parallelize_dit_sequence: the mesh has axes {mesh.axis_names} and no {sp_axis!r}; build it with "
            f"Mesh(..., {sp_axis}=N) or pass sp_axis="
        )
    group = mesh.group(sp_axis)
    check_dit_sp_size(config, group.size)
    parallelize(model, mesh, dit_ulysses_plan(), axis=sp_axis, replicate_layouts=False)

    def shard_tokens(module, args, tokens):
        if tokens.shape[1] % group.size:
            raise ValueError(
                f"parallelize_dit_sequence: the latent has {tokens.shape[1]} tokens (frames x height / patch x "
                f"width / patch), which sp={group.size} does not divide; choose a latent size (or patch_size) "
                "whose token count is a multiple of sp"
            )
        return shard_sequence(tokens, num_shards=group.size, rank=group.rank, layout="contiguous")

    def gather_tokens(module, args, tokens):
        return all_gather_reduce_scatter(tokens, group=group, dim=1)

    model.pos_embed.register_forward_hook(shard_tokens)
    model.proj_out.register_forward_hook(gather_tokens)
    return model
