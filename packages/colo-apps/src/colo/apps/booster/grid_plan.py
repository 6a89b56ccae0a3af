"""2D / 2.5D / 3D tensor parallelism for colo's native `Llama`: a `colo.tensor.parallelize` plan of the grid styles
(`colo.tensor.grid_styles`) and the loss on 2D logits.

Layouts (`colo.tensor.tp2d`): the embedding takes the full ``(batch, seq)`` ids and leaves each rank its batch
rows (over ``tp_row``, and ``tp_dep`` in 2.5D) and hidden block (over ``tp_col``); every projection is a SUMMA
`Linear2D` (the fused q/k/v one a `QKVLinear2D`, by heads), so attention runs on the rank's batch rows and
``num_heads / q`` query heads (q must divide ``num_key_value_heads``); the RMSNorms all-reduce their statistics
over the grid row; ``lm_head`` leaves the vocabulary over ``tp_col`` and the loss is `cross_entropy_2d`. The
rotary tables are replicated. 3D (`parallelize_llama_3d`, `colo.tensor.tp3d`): the same modules on the cube,
layouts A and B alternating at each linear, keys and values gathered over ``tp_dep`` in the attention core.
Pipelines, sequence parallelism, document masks and a tied embedding are not supported here.
"""

from __future__ import annotations

from colo.comm import Mesh
from colo.tensor import parallelize
from colo.tensor.grid_styles import (
    AttentionCore3DStyle,
    Embedding2DStyle,
    Embedding3DStyle,
    Linear2DStyle,
    Linear3DStyle,
    Norm2D,
    Norm3D,
    QKV2DStyle,
    QKV3DStyle,
    RotaryRows3D,
)
from colo.tensor.tp2d import cross_entropy_2d, shard_batch
from colo.tensor.tp3d import cross_entropy_3d, shard_3d
from colo.tensor.tp_grid import Grid, check_tp_size

from ..models.llama import Llama
from ..models.llama.config import LlamaConfig
from ..models.llama.loss import IGNORE_INDEX, CausalLMObjective
from .llama_plan import LlamaPlan, materialize_fn_of
from .parallel_dims import LayoutError, UnsupportedLayout
from .plans import materialize_device


class GridCausalLMObjective(CausalLMObjective):
    """The next-token loss of a 2D / 2.5D ``lm_head`` (`cross_entropy_2d` of this rank's logit block against its
    batch rows of the shifted labels) or, with ``cube``, of a 3D one (`cross_entropy_3d`, layout B). The labels
    arrive whole, like the ids."""

    def __init__(self, *, mesh: Mesh, ignore_index: int = IGNORE_INDEX, cube: bool = False):
        super().__init__(ignore_index=ignore_index, fused=False)
        self.mesh, self.cube = mesh, cube

    def forward(self, hidden, lm_head, labels=None, *, return_logits: bool = False):
        """As `CausalLMObjective.forward`, for the loss only; logits stay split and are not returned."""
        if labels is None or return_logits:
            raise ValueError(
                "the 2D / 2.5D Llama plan computes the loss only (its logits are split over batch and vocabulary); "
                "pass labels and return_logits=False, or use tp_mode='1d' for logits"
            )
        local_logits = lm_head(hidden).float()
        if self.cube:
            targets = shard_3d(self.targets(labels), self.mesh, "B")
            return cross_entropy_3d(local_logits, targets, mesh=self.mesh, ignore_index=self.ignore_index), None
        targets = shard_batch(self.targets(labels), self.mesh)
        return cross_entropy_2d(local_logits, targets, mesh=self.mesh, ignore_index=self.ignore_index), None


def check_grid_llama(config: LlamaConfig, q: int, *, batch_ranks: int, vocab_parallel: bool = False) -> None:
    """Raise a `ValueError` naming the config field when a grid of side ``q`` (``batch_ranks`` ranks along the
    batch: q, or d q in 2.5D) cannot shard this model. No communication."""
    fields = ["hidden_size", "intermediate_size", "vocab_size", "num_attention_heads", "num_key_value_heads"]
    for field in fields:
        extent = getattr(config, field)
        if extent % q:
            raise ValueError(
                f"the 2D grid side q={q} does not divide {field}={extent}; choose q in "
                f"{[d for d in range(1, extent + 1) if extent % d == 0]} (tp = q^2, or d q^2 for 2.5D) or change "
                f"{field}"
            )
    if vocab_parallel and config.vocab_size % batch_ranks:
        raise ValueError(f"vocab_size={config.vocab_size} does not divide by the {batch_ranks} ranks of the batch axes")
    if config.tie_word_embeddings:
        raise ValueError("the 2D / 2.5D Llama plan does not tie embeddings; set tie_word_embeddings=False")


def llama_grid_plan(*, vocab_parallel: bool = False) -> dict:
    """The 2D / 2.5D plan of `Llama` (module-name pattern -> style)."""
    return {
        "embed_tokens": Embedding2DStyle(vocab_parallel=vocab_parallel),
        "layers.*.input_layernorm": Norm2D(),
        "layers.*.self_attn.qkv_proj": QKV2DStyle(),
        "layers.*.self_attn.o_proj": Linear2DStyle(),
        "layers.*.post_attention_layernorm": Norm2D(),
        "layers.*.mlp.gate_proj": Linear2DStyle(),
        "layers.*.mlp.up_proj": Linear2DStyle(),
        "layers.*.mlp.down_proj": Linear2DStyle(),
        "norm": Norm2D(),
        "lm_head": Linear2DStyle(),
    }


def parallelize_llama_2d(model: Llama, *, mesh: Mesh, vocab_parallel: bool = False) -> Llama:
    """Shard an eager `Llama` over the 2D / 2.5D grid of ``mesh`` (`colo.tensor.grid_mesh`), in place.

    Args:
        model: the unsharded `Llama`, the same on every rank.
        mesh: a mesh with ``tp_row`` / ``tp_col`` (and ``tp_dep``) axes; outer axes (``dp``) are left alone.
        vocab_parallel: split the embedding's vocabulary over the batch axes (`VocabParallelEmbedding2D`; the batch
            must divide by them) instead of its hidden dim only. Default ``False``.

    Returns:
        ``model``: its forward takes the full ``(batch, seq)`` ids and labels and returns the loss.

    Raises:
        ValueError: a size does not divide by the grid (the field and valid sides named), before any collective.
    """
    if not isinstance(model, Llama):
        raise TypeError(f"parallelize_llama_2d: model must be a Llama, not {type(model).__name__}")
    grid = Grid.of(mesh, "parallelize_llama_2d")
    check_grid_llama(model.config, grid.q, batch_ranks=grid.depth * grid.q, vocab_parallel=vocab_parallel)
    if any(p.is_meta for p in model.parameters()):
        raise ValueError("parallelize_llama_2d: materialize the model first (model.to_empty(...); init_weights)")
    parallelize(model, mesh, llama_grid_plan(vocab_parallel=vocab_parallel), axis="tp_col")
    model.objective = GridCausalLMObjective(mesh=mesh, ignore_index=model.objective.ignore_index)
    return model


def llama_cube_plan() -> dict:
    """The 3D plan of `Llama` (`colo.tensor.tp3d`): layout A around the norms and the residual stream, layout B
    for q/k/v and the MLP's inner activation; the attention core gathers keys and values over ``tp_dep`` and the
    rotary tables are cut to each rank's query rows."""
    return {
        "embed_tokens": Embedding3DStyle(),
        "layers.*.input_layernorm": Norm3D(),
        "layers.*.self_attn": RotaryRows3D(),
        "layers.*.self_attn.qkv_proj": QKV3DStyle(),
        "layers.*.self_attn.core": AttentionCore3DStyle(),
        "layers.*.self_attn.o_proj": Linear3DStyle(in_axis="tp_row"),
        "layers.*.post_attention_layernorm": Norm3D(),
        "layers.*.mlp.gate_proj": Linear3DStyle(),
        "layers.*.mlp.up_proj": Linear3DStyle(),
        "layers.*.mlp.down_proj": Linear3DStyle(in_axis="tp_row"),
        "norm": Norm3D(),
        "lm_head": Linear3DStyle(),
    }


def parallelize_llama_3d(model: Llama, *, mesh: Mesh) -> Llama:
    """Shard an eager `Llama` over the q x q x q cube of ``mesh`` (`colo.tensor.grid_mesh("3d", tp)`), in place.

    The forward takes the full ``(batch, seq)`` ids and labels (the sequence divisible by q) and returns the loss.
    q must divide ``hidden_size``, the head counts and (with ``head_dim``) q^2 the projections' widths, and
    ``intermediate_size`` and ``vocab_size`` by q^2.

    Raises:
        ValueError: a size does not divide (the field named), before any collective.
    """
    if not isinstance(model, Llama):
        raise TypeError(f"parallelize_llama_3d: model must be a Llama, not {type(model).__name__}")
    q = mesh.size("tp_col")
    check_grid_llama(model.config, q, batch_ranks=q)
    for field in ("intermediate_size", "vocab_size"):
        extent = getattr(model.config, field)
        if extent % (q * q):
            raise ValueError(f"3D with q={q} needs {field}={extent} to divide by q^2={q * q}; change {field} or tp")
    parallelize(model, mesh, llama_cube_plan(), axis="tp_col")
    model.objective = GridCausalLMObjective(mesh=mesh, ignore_index=model.objective.ignore_index, cube=True)
    return model


class GridLlamaPlan(LlamaPlan):
    """`HybridParallel`'s plan for `Llama` with ``tp_mode="2d"``, ``"2.5d"`` (`parallelize_llama_2d`) or ``"3d"``
    (`parallelize_llama_3d`) on the grid axes of the plugin's mesh. Each data-parallel rank's batch goes whole to
    its grid (the model takes its pieces); checkpoints use `LlamaPlan`'s unfused names (``q_proj.weight`` ...), so
    they load in any other layout."""

    def check(self, model: Llama, plugin) -> None:
        sizes = check_tp_size(plugin.tp_mode, plugin.tp, plugin.tp_depth)
        q, depth = sizes["tp_col"], sizes.get("tp_dep", 1) if plugin.tp_mode == "2.5d" else 1
        try:
            check_grid_llama(model.config, q, batch_ranks=depth * q)
        except ValueError as error:
            raise LayoutError(
                f"HybridParallel(tp={plugin.tp}, tp_mode={plugin.tp_mode!r}): {error}", field="tp"
            ) from None
        if materialize_fn_of(model) is not None:
            raise UnsupportedLayout(
                "HybridParallel: a materialize function (pretrained weights) is not supported with a grid tp_mode; "
                "load the weights into the model before boosting it",
                field="tp_mode",
            )

    def apply(self, model: Llama, *, mesh: Mesh, plugin) -> Llama:
        if any(p.is_meta for p in model.parameters()):  # every rank builds the full model, then keeps its blocks
            model.to_empty(device=materialize_device())
            model.init_weights(plugin.seed)
        if plugin.tp_mode == "3d":
            return parallelize_llama_3d(model, mesh=mesh)
        return parallelize_llama_2d(model, mesh=mesh)

    def prepare_batch(self, batch, *, mesh: Mesh, plugin):
        return batch, 1.0

    def pipeline(self, model, *, mesh: Mesh, plugin, stage_ids):
        raise UnsupportedLayout("HybridParallel: a grid tp_mode has no pipeline stages; use pp=1", field="pp")


def grid_plan_for(plan, plugin):
    """The grid version of a model plan (colo's native Llama only), or an `UnsupportedLayout` naming ``tp_mode``."""
    if type(plan) is LlamaPlan:
        return GridLlamaPlan()
    raise UnsupportedLayout(
        f"HybridParallel: tp_mode={plugin.tp_mode!r} has a plan for colo's native Llama only, not for "
        f"{type(plan).__name__}; use tp_mode='1d'",
        field="tp_mode",
    )
