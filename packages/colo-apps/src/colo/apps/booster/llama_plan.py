"""`HybridParallel`'s plan for colo's native `Llama`: tensor parallelism by `parallelize_llama`, Ulysses or ring
attention over ``sp`` on the attention cores, pipeline stages by `llama_pipeline_stages`."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Mapping
from typing import NamedTuple

import torch
from torch import nn

from colo.comm import Group, Mesh
from colo.kernels import document_ids_from_position_ids
from colo.tensor import RingAttention, UlyssesAttention, parallelize, shard_positions, shard_sequence
from colo.tensor.ulysses import check_ulysses_heads

from ..models.llama import AttentionCore, Llama, llama_pipeline_stages, parallelize_llama
from ..models.llama.loss import IGNORE_INDEX, causal_lm_loss, sharded_causal_lm_loss, shift_labels
from ..models.llama.parallelize import check_tp_size
from .parallel_dims import LayoutError
from .plans import ModelPlan, PipelinePart, materialize_device


def _materialize_device(model: nn.Module) -> torch.device | None:
    """Where to initialize a meta-device model (the current CUDA device, else the CPU); ``None`` for a real one."""
    return materialize_device() if any(p.is_meta for p in model.parameters()) else None


_INITIALIZER = "_colo_materialize_fn"


def set_materialize_fn(model: nn.Module, init_fn) -> nn.Module:
    """Have the Booster's Llama plan fill this meta-device model's modules with ``init_fn(name, module)`` when it
    materializes them (each rank only its shards, one module at a time), instead of the seeded initialization:
    e.g. `colo.apps.train.PretrainedLlamaWeights` to start from pretrained weights. Returns ``model``."""
    model.__dict__[_INITIALIZER] = init_fn  # a plain attribute: not a submodule, not in the state dict
    return model


def materialize_fn_of(model: nn.Module):
    """The ``init_fn`` `set_materialize_fn` gave ``model``, or ``None``."""
    return model.__dict__.get(_INITIALIZER)


class SequenceSplit(NamedTuple):
    """How a sequence-parallel Llama (Ulysses or ring attention over ``sp``) holds its sequences: each rank of
    ``group`` a piece of every row, in ``layout`` (`colo.tensor.shard_sequence`)."""

    group: Group
    layout: str


_SEQUENCE_SPLIT = "_colo_sequence_split"


def sequence_split_of(model: nn.Module) -> SequenceSplit | None:
    """The `SequenceSplit` the plan gave ``model`` (`LlamaPlan.apply_sp`), or ``None`` when it runs on whole rows."""
    return model.__dict__.get(_SEQUENCE_SPLIT)


def sequence_multiple(plugin) -> int:
    """What a row's length must be a multiple of under ``plugin``'s sequence split: ``sp`` (Ulysses), ``2 * sp``
    (ring, zigzag), else 1."""
    if getattr(plugin, "sp", 1) <= 1:
        return 1
    return plugin.sp * (2 if LlamaPlan.sequence_layout(plugin) == "zigzag" else 1)


@contextlib.contextmanager
def whole_sequence_attention(model: nn.Module) -> Iterator[nn.Module]:
    """Within the context a sequence-parallel Llama runs on whole rows on each rank: every attention core is a plain
    `AttentionCore` (the Ulysses core without its all-to-all hooks, ring attention's replaced) and the model derives
    document ids from positions again; both are put back on exit. Sequence parallelism does not shard weights, so
    this is the whole model (e.g. generation, whose KV cache holds whole rows). A model without a split is left
    alone."""
    if sequence_split_of(model) is None:
        yield model
        return
    cores = {name: layer.self_attn.core for name, layer in model.layers.items()}
    derive = model.document_ids_from_positions
    try:
        for name, layer in model.layers.items():
            core = cores[name]
            layer.self_attn.core = AttentionCore(causal=core.causal, scale=core.scale)
        model.document_ids_from_positions = True
        yield model
    finally:
        for name, layer in model.layers.items():
            layer.self_attn.core = cores[name]
        model.document_ids_from_positions = derive


def _splits_itself(batch: Mapping[str, torch.Tensor]) -> bool:
    """A batch of whole rows whose forward cuts the sequence itself: a rollout batch (``response_mask``, no
    ``labels``: `colo.apps.rlhf.attach_rollout_forward`) or a preference batch (``(pairs, 2, seq)`` ``input_ids``:
    `colo.apps.rlhf.attach_pair_forward`), whose forwards shard the rows and gather per-token values over sp
    (`colo.apps.rlhf.sequence_logps`). Its loss is every sequence-parallel rank's whole loss: weight 1, the gather's
    backward sums the ranks' gradients."""
    if "response_mask" in batch and "labels" not in batch:
        return True
    ids = batch.get("input_ids")
    return isinstance(ids, torch.Tensor) and ids.dim() == 3


class LlamaPlan(ModelPlan):
    """Tensor parallelism over ``tp`` (vocabulary-parallel loss without a pipeline) and a layer-range pipeline."""

    def check(self, model: Llama, plugin) -> None:
        config = model.config
        if plugin.tp > 1:
            check_tp_size(config, plugin.tp)
        if plugin.sp_mode == "ulysses":  # each rank attends with num_heads / (tp * sp) heads
            heads, kv_heads = config.num_attention_heads // plugin.tp, max(1, config.num_key_value_heads // plugin.tp)
            try:
                check_ulysses_heads(
                    plugin.sp, heads, kv_heads, f"HybridParallel.sp={plugin.sp} (Ulysses, tp={plugin.tp})"
                )
            except ValueError as error:
                raise LayoutError(str(error), field="sp") from None
        num_stages = plugin.pp * plugin.num_model_chunks
        if num_stages > config.num_hidden_layers:
            raise LayoutError(
                f"HybridParallel: pp={plugin.pp} x num_model_chunks={plugin.num_model_chunks} = {num_stages} stages "
                f"but the model has num_hidden_layers={config.num_hidden_layers}; use at most that many stages",
                field="pp",
            )

    def apply(self, model: nn.Module, *, mesh: Mesh, plugin) -> nn.Module:
        device = _materialize_device(model)
        if plugin.tp > 1:
            # a pipeline's last stage outputs logits for the executor's loss, so they are gathered there
            parallelize_llama(
                model,
                mesh=mesh,
                loss_parallel=plugin.pp == 1,
                sequence_parallel=plugin.sp_mode == "megatron",
                materialize=device,
                seed=plugin.seed,
                init_fn=materialize_fn_of(model),
            )
        elif device is not None:
            model.to_empty(device=device)
            init_fn = materialize_fn_of(model)
            if init_fn is None:
                model.init_weights(plugin.seed)
            else:
                for name, module in model.named_modules():
                    init_fn(name, module)
                if model.config.tie_word_embeddings and hasattr(model, "embed_tokens") and hasattr(model, "lm_head"):
                    model.lm_head.weight = model.embed_tokens.weight
        if plugin.sp > 1:
            self.apply_sp(model, mesh=mesh, plugin=plugin)
        return model

    @staticmethod
    def sequence_layout(plugin) -> str:
        """Ring attention splits the sequence zigzag (equal causal work per rank); Ulysses contiguously."""
        return "zigzag" if plugin.sp_mode == "ring" else "contiguous"

    def apply_sp(self, model: nn.Module, *, mesh: Mesh, plugin) -> None:
        """Ulysses or ring attention over ``sp`` on every attention core; the objective takes pre-shifted labels
        (each rank holds a piece of every sequence, so the shift is done before the split, in `prepare_batch`), and
        the model takes the whole sequence's ``document_ids`` from `prepare_batch` rather than deriving them from
        its shard's positions."""
        layout = self.sequence_layout(plugin)
        style = UlyssesAttention(layout=layout) if plugin.sp_mode == "ulysses" else RingAttention(layout=layout)
        # no Replicate layouts for the (unsharded) weights: a fused q/k/v weight with a layout reads as a
        # tensor-parallel shard, which checkpoints cannot split into q, k and v
        parallelize(model, mesh, {"layers.*.self_attn.core": style}, axis="sp", replicate_layouts=False)
        if hasattr(model, "objective"):  # a pipeline's last stage computes its loss outside the objective
            model.objective.labels_shifted = True
        model.document_ids_from_positions = False
        model.__dict__[_SEQUENCE_SPLIT] = SequenceSplit(mesh.group("sp"), layout)  # not a submodule or state

    @staticmethod
    def check_sequence_length(seq_len: int, plugin) -> None:
        """Raise a `ValueError` naming the fix when ``seq_len`` cannot be split as the plugin splits it (before any
        collective): over tp under Megatron-SP, into ``sp`` (Ulysses) or ``2 * sp`` (ring, zigzag) chunks."""
        if plugin.sp_mode == "megatron" and seq_len % plugin.tp:
            raise ValueError(
                f"sequence length {seq_len} does not divide by tp={plugin.tp}, which Megatron sequence parallelism "
                "splits it over; pad the sequences to a multiple of tp"
            )
        if plugin.sp > 1:
            layout = LlamaPlan.sequence_layout(plugin)
            chunks = plugin.sp * (2 if layout == "zigzag" else 1)
            if seq_len % chunks:
                raise ValueError(
                    f"sequence length {seq_len} does not divide into {chunks} chunks (sp={plugin.sp}, {layout} "
                    f"layout); use a multiple of {chunks}"
                )

    def prepare_batch(self, batch, *, mesh: Mesh, plugin):
        if plugin.sp > 1 and _splits_itself(batch):
            return batch, 1.0
        if "input_ids" in batch:
            self.check_sequence_length(batch["input_ids"].shape[1], plugin)
        if plugin.sp == 1:
            return batch, 1.0
        if "input_ids" not in batch or "labels" not in batch:
            raise ValueError(f"a sequence-parallel Llama batch needs 'input_ids' and 'labels'; got {sorted(batch)}")
        layout, num_shards, rank = self.sequence_layout(plugin), plugin.sp, mesh.rank("sp")
        ids, labels = batch["input_ids"], batch["labels"]
        ignore = IGNORE_INDEX
        targets = shift_labels(labels, ignore)
        local_targets = shard_sequence(targets, num_shards=num_shards, rank=rank, layout=layout)
        positions = batch.get("position_ids")
        local = {
            "input_ids": shard_sequence(ids, num_shards=num_shards, rank=rank, layout=layout),
            "labels": local_targets,
        }
        if positions is None:
            local["position_ids"] = shard_positions(ids.shape[1], num_shards, rank, layout).to(ids.device)
        else:  # packed rows: each rank its shard's positions, and the whole sequence's document ids
            positions = positions.expand_as(ids) if positions.dim() == 2 else positions.expand(ids.shape[0], -1)
            local["position_ids"] = shard_sequence(positions, num_shards=num_shards, rank=rank, layout=layout)
        document_ids = batch.get("document_ids")
        if document_ids is None and positions is not None:
            document_ids = document_ids_from_position_ids(positions)
        if document_ids is not None and bool(document_ids[:, -1:].ne(document_ids[:, :1]).any()):
            local["document_ids"] = document_ids
        total = int((targets != ignore).sum())
        weight = num_shards * int((local_targets != ignore).sum()) / total if total else 0.0
        return local, weight

    def pipeline(self, model: Llama, *, mesh: Mesh, plugin, stage_ids: list[int]) -> PipelinePart:
        stages = llama_pipeline_stages(model, plugin.pp * plugin.num_model_chunks)
        if materialize_fn_of(model) is not None:
            for stage in stages:
                set_materialize_fn(stage, materialize_fn_of(model))
        chunks = [self.apply(stages[i], mesh=mesh, plugin=plugin) for i in stage_ids]
        tied: dict[str, nn.Parameter] = {}
        for chunk in chunks:
            tied.update(chunk.tied_parameters())
        loss_fn = causal_lm_loss if plugin.sp == 1 else functools.partial(sharded_causal_lm_loss, num_shards=plugin.sp)
        return PipelinePart(chunks=chunks, loss_fn=loss_fn, tied_parameters=tied)

    def checkpoint_names(self, model: nn.Module):
        """Checkpoints hold q, k and v apart (``self_attn.q_proj.weight`` ...), as Hugging Face does, whether the
        model holds them fused (``qkv_proj.weight``) or sharded by a tensor-parallel plan (``qkv_proj.q_weight``).

        LoRA adapters of the fused projection (`colo.apps.lora`) are saved the way Hugging Face's q, k and v
        projections would hold them: the base weight and ``lora_B`` split by rows like the weight
        (``q_proj.base_layer.weight``, ``q_proj.lora_B.default.weight``, ...) and the shared ``lora_A`` saved under
        each of the three names (``B_q A``, ``B_k A`` and ``B_v A`` are the three projections' updates)."""
        config = model.config
        rows = {
            "q": config.num_attention_heads * config.head_dim,
            "k": config.num_key_value_heads * config.head_dim,
            "v": config.num_key_value_heads * config.head_dim,
        }

        def names(name: str, parameter: nn.Parameter):
            prefix, _, leaf = name.rpartition(".qkv_proj.")
            if not prefix:
                return None
            base = f"{prefix}."
            inner, _, leaf = leaf.rpartition(".")  # "" / "base_layer" / "lora_A.default" / "lora_B.default"
            inner = f".{inner}" if inner else ""
            if inner.startswith(".lora_A."):
                return [(f"{base}{part}_proj{inner}.{leaf}", 0, parameter.shape[0]) for part in "qkv"]
            if leaf == "weight":
                return [
                    (f"{base}q_proj{inner}.weight", 0, rows["q"]),
                    (f"{base}k_proj{inner}.weight", rows["q"], rows["k"]),
                    (f"{base}v_proj{inner}.weight", rows["q"] + rows["k"], rows["v"]),
                ]
            part = leaf.removesuffix("_weight")
            return [(f"{base}{part}_proj{inner}.weight", 0, rows[part])]

        return names

    def pipeline_batch(self, batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        if "input_ids" not in batch or "labels" not in batch:
            raise ValueError(f"a Llama pipeline batch needs 'input_ids' and 'labels'; got keys {sorted(batch)}")
        return batch["input_ids"], batch["labels"]

    def prepare_pipeline_batch(self, batch: Mapping[str, torch.Tensor], *, mesh: Mesh, plugin):
        """The first stage's inputs and the last stage's targets of this rank.

        Without sequence parallelism, positions or document ids: ``(input_ids, labels)``. With ``position_ids``
        (packed rows) the inputs are ``{"x": input_ids, "position_ids": ...}``, which every stage uses (deriving
        its attention's document ids from them) and hands on. Under Ulysses or ring attention (``sp > 1``) each
        rank gets its piece of every sequence as `prepare_batch` cuts it (zigzag for ring), its tokens' positions
        in the whole sequence and, when the batch has ``position_ids``, the whole sequence's ``document_ids``; the
        targets are ``{"labels": its shifted labels, "num_targets": each row's labelled targets}`` for
        `sharded_causal_lm_loss`. What crosses a stage boundary depends only on which keys the batch has (a
        pipeline fixes it at its first step), never on whether a row happens to hold several documents."""
        input_ids, labels = self.pipeline_batch(batch)
        self.check_sequence_length(input_ids.shape[1], plugin)
        rows = input_ids.shape[0]
        positions, document_ids = batch.get("position_ids"), batch.get("document_ids")
        if plugin.sp > 1:
            local, _ = self.prepare_batch(batch, mesh=mesh, plugin=plugin)
            inputs = {"x": local["input_ids"], "position_ids": local["position_ids"].expand(rows, -1)}
            if document_ids is None and positions is not None:
                document_ids = document_ids_from_position_ids(positions.expand(rows, -1))
            if document_ids is not None:
                inputs["document_ids"] = document_ids.expand(rows, -1)
            counts = (shift_labels(labels, IGNORE_INDEX) != IGNORE_INDEX).sum(dim=1)
            return inputs, {"labels": local["labels"], "num_targets": counts}
        if positions is None and document_ids is None:
            return input_ids, labels
        inputs = {"x": input_ids}
        if positions is not None:
            inputs["position_ids"] = positions.expand(rows, -1)
        if document_ids is not None:
            inputs["document_ids"] = document_ids.expand(rows, -1)
        return inputs, labels
