"""Pipeline stages of a `Llama`: contiguous ranges of decoder layers, split by `colo.pipeline`'s partitioners.

A `LlamaStage` is what `colo.pipeline.PipelineExecutor` runs as a model chunk: called on one tensor, returning
one tensor. The first stage takes token ids (it holds the embedding), the last returns logits (it holds the final
norm, ``lm_head`` and the objective), the others map hidden states to hidden states. Positions are
``0 .. seq - 1`` unless ``position_ids`` come with the input (a sequence shard's global positions under Ulysses or
ring attention, or packed documents' restarting ones): then every stage uses them and hands them, and the whole
sequence's ``document_ids`` when given, on to the next stage with its hidden states. The loss is
`colo.apps.models.llama.causal_lm_loss` on the last stage's logits (`sharded_causal_lm_loss` for sequence shards).

Stages keep the model's module names (``embed_tokens``, ``layers.5``, ``norm``, ``lm_head``), so
`parallelize_llama` applies to a stage as to the whole model, and a stage materialized from the meta device gets
exactly the values of the matching modules of the whole model initialized with the same seed.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from colo.pipeline import partition_by_parameters, partition_uniform

from .model import Llama, attention_document_ids, init_llama_module, layers_document_mask


class LlamaStage(nn.Module):
    """Decoder layers ``layer_ids`` of ``model``, with the embedding on the first stage and the head on the last.

    The stage shares its modules with ``model`` (nothing is copied): build the model on the meta device, keep this
    rank's stage, then materialize it (`parallelize_llama` with ``materialize=``, or ``to_empty`` and
    `init_weights`).

    Args:
        model (Llama): the model to cut.
        layer_ids (Sequence[int]): the stage's layers, contiguous and in order.
        first (bool): the stage holds the embedding (takes token ids).
        last (bool): the stage holds the final norm and ``lm_head`` (returns logits).
    """

    def __init__(self, model: Llama, layer_ids: Sequence[int], *, first: bool, last: bool):
        super().__init__()
        self.config = model.config
        self.first, self.last = first, last
        self.document_ids_from_positions = model.document_ids_from_positions
        """As `Llama.document_ids_from_positions`: packed rows' document ids from this stage's positions (a
        sequence-parallel plan turns it off and passes the whole sequence's ids)."""
        if first:
            self.embed_tokens = model.embed_tokens
        self.rotary_emb = model.rotary_emb
        self.layers = nn.ModuleDict({str(i): model.layers[str(i)] for i in layer_ids})
        if last:
            self.norm, self.lm_head, self.objective = model.norm, model.lm_head, model.objective

    def forward(
        self, x: torch.Tensor, position_ids: torch.Tensor | None = None, document_ids: torch.Tensor | None = None
    ) -> torch.Tensor | dict[str, torch.Tensor]:
        """``x``: ``(batch, seq)`` token ids on the first stage, else ``(batch, seq, hidden)``. Returns hidden
        states, or ``(batch, seq, vocab)`` logits on the last stage.

        ``position_ids`` (``(batch, seq)``, this rank's tokens' positions in the whole sequence: a sequence
        shard's under Ulysses or ring attention, restarting per document in packed rows) and ``document_ids``
        (``(batch, keys)``, the whole sequence's, see `Llama.hidden_states`; without them, derived from
        ``position_ids`` as `Llama` derives them) are used by this stage's layers and handed on: a stage that is
        not the last then returns ``{"x": hidden, "position_ids": ..., "document_ids": ...}`` (the ones it got),
        which the pipeline sends to the next stage as they are."""
        given_document_ids = document_ids  # handed on as given: the boundary's tensors never depend on the rows
        if self.first:
            x = self.embed_tokens(x)
        if document_ids is None and position_ids is not None and self.document_ids_from_positions:
            document_ids = attention_document_ids(position_ids, x.shape[0])
        document_ids = layers_document_mask(document_ids, whole_sequence=not self.document_ids_from_positions)
        # Megatron-SP stages get a sequence shard of the hidden states but attend over the whole sequence
        seq_len = x.shape[1] if position_ids is None else position_ids.shape[-1]
        cos, sin = self.rotary_emb(seq_len, position_ids)
        for layer in self.layers.values():
            x = layer(x, cos, sin, document_ids=document_ids)
        if self.last:
            _, x = self.objective(self.norm(x), self.lm_head)
            return x
        if position_ids is None and given_document_ids is None:
            return x
        passed = {"x": x, "position_ids": position_ids, "document_ids": given_document_ids}
        return {key: value for key, value in passed.items() if value is not None}

    def tied_parameters(self) -> dict[str, nn.Parameter]:
        """``{"word_embeddings": weight}`` on the first and the last stage of a tied model, else ``{}``: the
        executor's ``tied_parameters`` (it sums the two stages' gradients)."""
        if not self.config.tie_word_embeddings or not (self.first or self.last):
            return {}
        return {"word_embeddings": self.embed_tokens.weight if self.first else self.lm_head.weight}

    def init_weights(self, seed: int) -> None:
        """Initialize the stage's modules as `Llama.init_weights` (same ``seed``) initializes them in the model."""
        if any(t.is_meta for t in (*self.parameters(), *self.buffers())):
            raise ValueError("LlamaStage.init_weights: the stage is on the meta device; call to_empty(device=...)")
        if self.first and self.last and self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        for name, module in self.named_modules():
            init_llama_module(name, module, config=self.config, seed=seed)


def llama_pipeline_stages(model: Llama, num_stages: int, *, balance: str = "uniform") -> list[LlamaStage]:
    """Cut ``model`` into ``num_stages`` `LlamaStage` s of contiguous decoder layers.

    Args:
        model (Llama): the model (the meta device is fine: only shapes are read).
        num_stages (int): number of stages (with an interleaved schedule, ``num_ranks * num_chunks``).
        balance (str): ``"uniform"``: equal numbers of layers (`colo.pipeline.partition_uniform`);
            ``"parameters"``: balanced parameter counts, the embedding counted on the first stage and ``lm_head``
            on the last (`colo.pipeline.partition_by_parameters`). Default: ``"uniform"``.

    Returns:
        list[LlamaStage]: stage ``i`` for pipeline stage ``i``.

    Raises:
        ValueError: for an unknown ``balance``, or more stages than layers.
    """
    layers = list(model.layers.values())
    if balance == "uniform":
        ranges = partition_uniform(len(layers), num_stages)
    elif balance == "parameters":
        ranges = partition_by_parameters(layers, num_stages, first=model.embed_tokens, last=model.lm_head)
    else:
        raise ValueError(f"llama_pipeline_stages: balance={balance!r} is unknown; use 'uniform' or 'parameters'")
    return [
        LlamaStage(model, layer_ids, first=index == 0, last=index == num_stages - 1)
        for index, layer_ids in enumerate(ranges)
    ]
