"""`HybridParallel` plans for Hugging Face ``transformers`` models, written against their public module structure.

- `HFLlamaPlan` (``LlamaForCausalLM``): tensor parallelism over ``tp`` — ``model.embed_tokens`` vocabulary-parallel,
  ``q_proj`` / ``k_proj`` / ``v_proj`` / ``gate_proj`` / ``up_proj`` column-parallel (by heads: transformers 5's
  attention reshapes with ``-1`` heads of ``head_dim``, so the local projections need no attribute rewritten;
  ``num_key_value_groups`` stays the same because tp divides both head counts), ``o_proj`` / ``down_proj``
  row-parallel, ``lm_head`` column-parallel with its logits all-gathered (Hugging Face's own loss then runs on full
  logits); and a pipeline of contiguous decoder layers (`colo.apps.hf.pipeline`).
- `HFGPT2Plan` (``GPT2LMHeadModel``): GPT-2 keeps its projections in ``Conv1D`` modules (an ``addmm`` with the
  weight stored ``(in, out)``, the transpose of ``nn.Linear``'s). The plan converts each one to an ``nn.Linear``
  holding the transposed weight (same values, same bias parameter) and then shards ordinary linears: ``c_attn``
  (q, k, v fused) by heads with `colo.tensor.FusedQKV`, the attention's ``split_size`` / ``num_heads`` /
  ``embed_dim`` rewritten to this rank's, ``c_proj`` row-parallel, ``mlp.c_fc`` column-parallel, ``mlp.c_proj``
  row-parallel, ``wte`` vocabulary-parallel and ``lm_head`` gathered. No pipeline yet.

Packed rows (``position_ids`` restarting per document): transformers 5 masks attention between the documents of a
row from ``position_ids`` when the forward builds no KV cache, so the plans run such batches with
``use_cache=False``; tensor parallelism leaves the mask alone (each rank attends over the whole sequence with its
heads). A pipeline's stages see token ids only, so a pipeline batch of packed rows is refused.

Tied embeddings stay tied: both modules hold the same vocabulary rows on a rank and share that shard. Norms,
GPT-2's position embedding and every bias of a row-parallel layer are replicated. `HFLlamaPlan` offers sequence
parallelism without a pipeline (`colo.apps.hf.sequence`): Megatron-SP over ``tp``, Ulysses and ring attention over
``sp`` through transformers' ``AttentionInterface``; GPT-2's plan rejects ``sp`` / ``sp_mode``. Before anything
changes, `check` walks the model: every module holding parameters must be one the plan knows, of the type it expects,
or a `ValueError` names its path and type.

`colo.apps.booster.plans.BUILTIN_PLANS` names these plans for the transformers classes by module and class name,
so importing ``colo.apps`` imports neither this module nor transformers (about 4 s); a model object that exists has
imported transformers already. `transformers_class` gives the same by-name match to users' `register_plan`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch
from torch import nn

from colo.comm import Mesh
from colo.kernels import document_ids_from_position_ids
from colo.tensor import (
    Colwise,
    FusedQKV,
    ParallelStyle,
    Rowwise,
    VocabParallel,
    layout_of,
    parallelize,
    shard_positions,
    shard_sequence,
)
from colo.tensor.ulysses import check_ulysses_heads

from ..booster.parallel_dims import LayoutError, UnsupportedLayout
from ..booster.plans import ModelPlan, PipelinePart, reject_packed_rows
from ..models.llama.loss import IGNORE_INDEX, causal_lm_loss, shift_labels
from .pipeline import hf_llama_pipeline_stages
from .sequence import (
    DOCUMENT_IDS_KEY,
    check_attention_implementation,
    hf_llama_sequence_parallel_plan,
    use_sequence_parallel_attention,
)


def _layer_names(model: nn.Module) -> list[str]:
    """The decoder layers' indices, in order (``model.layers`` of the whole model or of a stage)."""
    return [name for name, _ in model.model.layers.named_children()]


class _ClassByName(type):
    """Metaclass of `transformers_class`: ``isinstance`` by the class name and module, without importing it."""

    def __instancecheck__(cls, obj) -> bool:
        return cls.__subclasscheck__(type(obj))

    def __subclasscheck__(cls, subclass) -> bool:
        return any(k.__name__ == cls.__name__ and k.__module__.startswith(cls.module_prefix) for k in subclass.__mro__)


def transformers_class(name: str, module: str) -> type:
    """A stand-in for ``transformers`` class ``name`` of ``module`` for `register_plan`: an instance of the real
    class or of a subclass is an instance of it; nothing is imported.

    Args:
        name (str): the class name, e.g. ``"LlamaForCausalLM"``.
        module (str): the module (or its prefix) defining it, e.g. ``"transformers.models.llama"``.
    """
    return _ClassByName(name, (), {"module_prefix": module})


def _pattern(glob: str) -> re.Pattern:
    return re.compile("^" + re.escape(glob).replace(r"\*", r"[^.]+") + "$")


class _HFPlan(ModelPlan):
    """What the Hugging Face plans share: the structure check, tied-embedding handling and the plugin checks."""

    model_name = ""
    known: dict[str, str] = {}
    """module-name glob -> expected class name (any module of the class, or of a subclass)."""
    required: tuple[str, ...] = ()
    """globs that must match at least one module (with its expected class)."""

    def check_structure(self, model: nn.Module) -> None:
        """Raise a `ValueError` naming the first module the plan does not know (path and type), or a known path
        holding a module of another type; names are checked before any module changes."""
        known = [(glob, _pattern(glob), cls) for glob, cls in self.known.items()]
        seen: set[str] = set()
        for name, module in model.named_modules():
            matched = [(glob, cls) for glob, pattern, cls in known if pattern.match(name)]
            holds_parameters = next(module.parameters(recurse=False), None) is not None
            if not matched:
                if holds_parameters:
                    raise ValueError(
                        f"{type(self).__name__}: module {name!r} ({type(module).__name__}) is not part of the "
                        f"{self.model_name} plan, which knows {sorted(self.known)}; train this model with the DDP "
                        "or Zero plugins, or register a plan for it (colo.apps.booster.register_plan)"
                    )
                continue
            glob, expected = matched[0]
            if not any(k.__name__ == expected for k in type(module).__mro__):
                raise ValueError(
                    f"{type(self).__name__}: module {name!r} is a {type(module).__name__}, but the {self.model_name} "
                    f"plan expects a {expected} there; train this model with the DDP or Zero plugins, or register a "
                    "plan for it (colo.apps.booster.register_plan)"
                )
            seen.add(glob)
        missing = [glob for glob in self.required if glob not in seen]
        if missing:
            raise ValueError(f"{type(self).__name__}: the model has no module {missing[0]!r} of the {self.model_name}")

    def check_plugin(self, model: nn.Module, plugin, sizes: Mapping[str, int]) -> None:
        """Check sequence parallelism (`check_sequence_parallel`), reject meta-device models; check that ``tp``
        divides every size in ``sizes``."""
        self.check_sequence_parallel(model, plugin)
        if any(p.is_meta for p in model.parameters()):
            raise ValueError(
                f"{type(self).__name__}: the model has parameters on the meta device; build or load it eagerly "
                "(e.g. from_pretrained or from_config), the same on every rank"
            )
        for field, extent in sizes.items():
            if extent % plugin.tp:
                raise LayoutError(
                    f"HybridParallel.tp={plugin.tp} does not divide config.{field}={extent} of the {self.model_name}; "
                    f"choose tp in {[d for d in range(1, extent + 1) if extent % d == 0 and d <= 64]}",
                    field="tp",
                )

    def check_sequence_parallel(self, model: nn.Module, plugin) -> None:
        """Reject sequence parallelism (a plan that offers it overrides this)."""
        if plugin.sp > 1 or plugin.sp_mode is not None:
            raise UnsupportedLayout(
                f"HybridParallel: sp={plugin.sp}, sp_mode={plugin.sp_mode!r} is not supported for Hugging Face "
                f"models ({type(self).__name__}); use tp, pp and dp",
                field="sp" if plugin.sp > 1 else "sp_mode",
            )

    def shard(self, model: nn.Module, *, mesh: Mesh, plan: dict[str, ParallelStyle], embed: str) -> None:
        """`colo.tensor.parallelize` ``plan`` over ``tp``, keeping a tied ``lm_head`` tied to ``embed``'s shard."""
        names = dict(model.named_modules())
        embedding, lm_head = names.get(embed), names.get("lm_head")
        if embedding is None:
            plan.pop(embed)
        if lm_head is None:
            plan.pop("lm_head")
        tied = embedding is not None and lm_head is not None and lm_head.weight is embedding.weight
        if tied:
            lm_head.weight = nn.Parameter(embedding.weight.detach(), requires_grad=embedding.weight.requires_grad)
        parallelize(model, mesh, plan, axis="tp")
        if tied:
            model.lm_head.weight = model.get_submodule(embed).weight

    def pipeline_batch(self, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        if "input_ids" not in batch or "labels" not in batch:
            raise ValueError(f"a {self.model_name} pipeline batch needs 'input_ids' and 'labels'; got {sorted(batch)}")
        reject_packed_rows(batch, f"HybridParallel(pp > 1) with a {self.model_name}")
        return batch["input_ids"], batch["labels"]

    def prepare_batch(self, batch, *, mesh: Mesh, plugin):
        """Packed rows: transformers 5 masks the documents of a row from ``position_ids`` only when the forward
        builds no KV cache, so a batch with ``position_ids`` is run with ``use_cache=False`` (nothing is lost:
        training needs no cache)."""
        if "position_ids" in batch and "use_cache" not in batch:
            batch = {**batch, "use_cache": False}
        return batch, 1.0


class HFLlamaPlan(_HFPlan):
    """Tensor parallelism and a layer-range pipeline for ``transformers.LlamaForCausalLM`` (see the module)."""

    model_name = "LlamaForCausalLM"
    known = {
        "model.embed_tokens": "Embedding",
        "model.rotary_emb": "LlamaRotaryEmbedding",
        "model.layers.*": "LlamaDecoderLayer",
        "model.layers.*.self_attn": "LlamaAttention",
        **{f"model.layers.*.self_attn.{p}_proj": "Linear" for p in "qkvo"},
        "model.layers.*.mlp": "LlamaMLP",
        **{f"model.layers.*.mlp.{p}_proj": "Linear" for p in ("gate", "up", "down")},
        "model.layers.*.input_layernorm": "LlamaRMSNorm",
        "model.layers.*.post_attention_layernorm": "LlamaRMSNorm",
        "model.norm": "LlamaRMSNorm",
        "lm_head": "Linear",
    }
    required = ("model.embed_tokens", "model.layers.*.self_attn", "model.norm", "lm_head")

    def check(self, model: nn.Module, plugin) -> None:
        self.check_structure(model)
        config = model.config
        self.check_plugin(
            model,
            plugin,
            {
                "num_attention_heads": config.num_attention_heads,
                "num_key_value_heads": getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
                "intermediate_size": config.intermediate_size,
                "vocab_size": config.vocab_size,
            },
        )
        num_stages, num_layers = plugin.pp * plugin.num_model_chunks, len(model.model.layers)
        if num_stages > num_layers:
            raise LayoutError(
                f"HybridParallel: pp={plugin.pp} x num_model_chunks={plugin.num_model_chunks} = {num_stages} stages "
                f"but the LlamaForCausalLM has {num_layers} decoder layers; use at most that many stages",
                field="pp",
            )

    def check_sequence_parallel(self, model: nn.Module, plugin) -> None:
        """Megatron-SP (over tp), Ulysses or ring attention (over sp), without a pipeline; Ulysses needs the heads
        of a tensor-parallel rank to split over sp; Ulysses and ring need the model's attention to be one
        `colo.apps.hf.sequence.SUPPORTED_ATTENTION` names."""
        if plugin.sp_mode is None:
            return
        if plugin.pp > 1:
            raise UnsupportedLayout(
                f"HybridParallel: sp_mode={plugin.sp_mode!r} with pp={plugin.pp} is not supported for the "
                "LlamaForCausalLM yet (its pipeline stages rebuild the mask and positions from whole sequences); use "
                "pp=1, or colo's native Llama",
                field="sp_mode",
            )
        if plugin.sp_mode in ("ulysses", "ring"):
            try:
                check_attention_implementation(model, plugin.sp_mode)
            except ValueError as error:
                raise LayoutError(str(error), field="sp_mode") from None
        if plugin.sp_mode == "ulysses":
            config = model.config
            kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
            heads, kv_heads = config.num_attention_heads // plugin.tp, max(1, kv_heads // plugin.tp)
            try:
                check_ulysses_heads(
                    plugin.sp, heads, kv_heads, f"HybridParallel.sp={plugin.sp} (Ulysses, tp={plugin.tp})"
                )
            except ValueError as error:
                raise LayoutError(str(error), field="sp") from None

    @staticmethod
    def sequence_layout(plugin) -> str:
        """Ring attention splits the sequence zigzag (equal causal work per rank); Ulysses contiguously."""
        return "zigzag" if plugin.sp_mode == "ring" else "contiguous"

    @staticmethod
    def tp_plan() -> dict[str, ParallelStyle]:
        """Module-name pattern -> style (the logits are gathered: the loss runs on full logits)."""
        plan: dict[str, ParallelStyle] = {"model.embed_tokens": VocabParallel()}
        plan.update({f"model.layers.*.self_attn.{p}_proj": Colwise() for p in "qkv"})
        plan["model.layers.*.self_attn.o_proj"] = Rowwise()
        plan.update({"model.layers.*.mlp.gate_proj": Colwise(), "model.layers.*.mlp.up_proj": Colwise()})
        plan["model.layers.*.mlp.down_proj"] = Rowwise()
        plan["lm_head"] = Colwise(gather_output=True)
        return plan

    def apply(self, model: nn.Module, *, mesh: Mesh, plugin) -> nn.Module:
        if plugin.sp > 1:
            use_sequence_parallel_attention(
                model, mesh=mesh, mode=plugin.sp_mode, layout=self.sequence_layout(plugin), axis="sp"
            )
        if plugin.tp == 1:
            return model
        if plugin.sp_mode == "megatron":
            plan = hf_llama_sequence_parallel_plan(first_layer=next(iter(_layer_names(model)), None))
        else:
            plan = self.tp_plan()
        self.shard(model, mesh=mesh, plan=plan, embed="model.embed_tokens")
        for name, module in model.named_modules():
            if name.endswith(".self_attn"):  # head counts some transformers 4.x versions keep on the module
                for attr in ("num_heads", "num_key_value_heads", "hidden_size"):
                    if isinstance(getattr(module, attr, None), int):
                        setattr(module, attr, getattr(module, attr) // plugin.tp)
        return model

    def prepare_batch(self, batch, *, mesh: Mesh, plugin):
        """As `_HFPlan.prepare_batch`; under Megatron-SP the sequence length must divide by tp. Under Ulysses or
        ring attention this rank gets its piece of every sequence (zigzag for ring), its tokens' global
        ``position_ids`` and its targets pre-shifted over the whole sequence (``shift_labels``, so Hugging Face's
        loss does not shift the shard again), weighted like colo's Llama plan: ``sp * its labelled targets / all``,
        so that the mean over the sp ranks is the loss of the whole sequence. Packed rows (``position_ids``
        restarting within a row): each rank gets its tokens' positions and the whole sequence's document ids
        (``colo_document_ids``, which transformers hands on to the attention function)."""
        if plugin.sp_mode is None:
            return super().prepare_batch(batch, mesh=mesh, plugin=plugin)
        if "input_ids" not in batch or "labels" not in batch:
            raise ValueError(
                f"a sequence-parallel LlamaForCausalLM batch needs 'input_ids' and 'labels'; got {sorted(batch)}"
            )
        ids, labels = batch["input_ids"], batch["labels"]
        seq_len = ids.shape[1]
        if plugin.sp_mode == "megatron":
            if seq_len % plugin.tp:
                raise ValueError(
                    f"sequence length {seq_len} does not divide by tp={plugin.tp}, which Megatron sequence "
                    "parallelism splits it over; pad the sequences to a multiple of tp"
                )
            return super().prepare_batch(batch, mesh=mesh, plugin=plugin)
        layout, num_shards = self.sequence_layout(plugin), plugin.sp
        chunks = num_shards * (2 if layout == "zigzag" else 1)
        if seq_len % chunks:
            raise ValueError(
                f"sequence length {seq_len} does not divide into {chunks} chunks (sp={num_shards}, {layout} layout); "
                f"use a multiple of {chunks}"
            )
        if batch.get("attention_mask") is not None and not bool(batch["attention_mask"].all()):
            raise ValueError(
                "HybridParallel(sp_mode='ulysses' or 'ring') with a LlamaForCausalLM attends causally over whole "
                "rows: an attention_mask with padding is not supported; label padding -100 and drop the mask"
            )
        rank = mesh.rank("sp")
        targets = shift_labels(labels, IGNORE_INDEX)
        local_targets = shard_sequence(targets, num_shards=num_shards, rank=rank, layout=layout)
        local_count = int((local_targets != IGNORE_INDEX).sum())
        positions = batch.get("position_ids")
        if positions is None:
            local_positions = shard_positions(seq_len, num_shards, rank, layout).to(ids.device)
        else:  # packed rows: the shard's own positions, and the whole sequence's document ids
            positions = positions.expand(ids.shape[0], -1)
            local_positions = shard_sequence(positions, num_shards=num_shards, rank=rank, layout=layout)
        local = {
            "input_ids": shard_sequence(ids, num_shards=num_shards, rank=rank, layout=layout),
            "position_ids": local_positions.expand(ids.shape[0], -1),
            "labels": local_targets,
            "shift_labels": local_targets,
            # a sum over this shard's targets divided by their count: 0, not NaN, when the shard has none
            "num_items_in_batch": torch.tensor(max(local_count, 1), device=ids.device),
            "use_cache": False,
        }
        document_ids = None if positions is None else document_ids_from_position_ids(positions)
        if document_ids is not None and bool(document_ids[:, -1:].ne(document_ids[:, :1]).any()):
            local[DOCUMENT_IDS_KEY] = document_ids
        total = int((targets != IGNORE_INDEX).sum())
        return local, (num_shards * local_count / total if total else 0.0)

    def pipeline(self, model: nn.Module, *, mesh: Mesh, plugin, stage_ids: list[int]) -> PipelinePart:
        stages = hf_llama_pipeline_stages(model, plugin.pp * plugin.num_model_chunks)
        chunks = [self.apply(stages[i], mesh=mesh, plugin=plugin) for i in stage_ids]
        tied: dict[str, nn.Parameter] = {}
        for chunk in chunks:
            tied.update(chunk.tied_parameters())
        return PipelinePart(chunks=chunks, loss_fn=causal_lm_loss, tied_parameters=tied)


_CONV1D_GLOBS = tuple(f"transformer.h.*.{name}" for name in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"))


def conv1d_to_linear(conv: nn.Module) -> nn.Linear:
    """An ``nn.Linear`` computing what a Hugging Face ``Conv1D`` computes: its weight transposed (a new
    parameter, same values), its bias parameter itself.

    Args:
        conv: a ``transformers.pytorch_utils.Conv1D`` (weight ``(in, out)``, bias ``(out,)``).

    Returns:
        nn.Linear: weight ``(out, in)``.
    """
    in_features, out_features = conv.weight.shape
    linear = nn.Linear(in_features, out_features, bias=False, device="meta")
    linear.weight = nn.Parameter(conv.weight.detach().t().contiguous(), requires_grad=conv.weight.requires_grad)
    linear.bias = conv.bias
    return linear


class HFGPT2Plan(_HFPlan):
    """Tensor parallelism for ``transformers.GPT2LMHeadModel`` (``Conv1D`` converted to ``nn.Linear``; see the
    module). Checkpoints name the converted weights in ``nn.Linear`` orientation: ``attn.c_attn`` as
    ``attn.c_attn.{q,k,v}_proj.{weight,bias}``, the others as ``<module>.linear.{weight,bias}`` (so they never load
    silently transposed into an unconverted GPT-2)."""

    model_name = "GPT2LMHeadModel"
    known = {
        "transformer.wte": "Embedding",
        "transformer.wpe": "Embedding",
        "transformer.h.*": "GPT2Block",
        "transformer.h.*.ln_1": "LayerNorm",
        "transformer.h.*.ln_2": "LayerNorm",
        "transformer.h.*.attn": "GPT2Attention",
        "transformer.h.*.mlp": "GPT2MLP",
        **dict.fromkeys(_CONV1D_GLOBS, "Conv1D"),
        "transformer.ln_f": "LayerNorm",
        "lm_head": "Linear",
    }
    required = ("transformer.wte", "transformer.h.*.attn", "lm_head")

    def check(self, model: nn.Module, plugin) -> None:
        self.check_structure(model)
        config = model.config
        inner = getattr(config, "n_inner", None) or 4 * config.hidden_size
        sizes = {"num_attention_heads": config.num_attention_heads, "n_inner": inner, "vocab_size": config.vocab_size}
        self.check_plugin(model, plugin, sizes)
        if plugin.pp > 1:
            raise UnsupportedLayout(
                f"HybridParallel: pp={plugin.pp} is not supported for GPT2LMHeadModel yet (its plan has no pipeline "
                "stages); use tp and dp",
                field="pp",
            )

    @staticmethod
    def tp_plan(num_heads: int) -> dict[str, ParallelStyle]:
        """Module-name pattern -> style, for the model after its ``Conv1D`` modules became ``nn.Linear``."""
        return {
            "transformer.wte": VocabParallel(),
            "transformer.h.*.attn.c_attn": FusedQKV(num_heads=num_heads, num_kv_heads=num_heads, head_attrs=None),
            "transformer.h.*.attn.c_proj": Rowwise(),
            "transformer.h.*.mlp.c_fc": Colwise(),
            "transformer.h.*.mlp.c_proj": Rowwise(),
            "lm_head": Colwise(gather_output=True),
        }

    def apply(self, model: nn.Module, *, mesh: Mesh, plugin) -> nn.Module:
        globs = [_pattern(glob) for glob in _CONV1D_GLOBS]
        for name in [n for n, _ in model.named_modules() if any(g.match(n) for g in globs)]:
            parent, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent), attr, conv1d_to_linear(model.get_submodule(name)))
        if plugin.tp == 1:
            return model
        self.shard(model, mesh=mesh, plan=self.tp_plan(model.config.num_attention_heads), embed="transformer.wte")
        for block in model.transformer.h:
            attention = block.attn
            attention.num_heads //= plugin.tp
            attention.embed_dim //= plugin.tp
            attention.split_size //= plugin.tp  # c_attn's output is this rank's [q | k | v]
        return model

    def checkpoint_names(self, model: nn.Module):
        """Names of the converted weights in checkpoints (see the class docstring)."""
        width = model.config.hidden_size
        converted = re.compile(r"^(.*\.(?:attn|mlp)\.(?:c_attn|c_proj|c_fc))\.(weight|bias|[qkv]_weight|[qkv]_bias)$")

        def names(name: str, parameter: nn.Parameter):
            match = converted.match(name)
            if match is None:
                return None
            module, leaf = match.groups()
            if module.endswith("c_attn"):
                if leaf in ("weight", "bias"):
                    return [(f"{module}.{part}_proj.{leaf}", i * width, width) for i, part in enumerate("qkv")]
                return [(f"{module}.{leaf[0]}_proj.{leaf[2:]}", 0, width)]
            layout = layout_of(parameter)
            rows = layout.global_shape[0] if layout is not None else parameter.shape[0]
            return [(f"{module}.linear.{leaf}", 0, rows)]

        return names

    def pipeline(self, model: nn.Module, *, mesh: Mesh, plugin, stage_ids: list[int]) -> PipelinePart:
        raise ValueError("HFGPT2Plan has no pipeline stages yet; use pp=1")
