"""Pipeline stages of a Hugging Face ``LlamaForCausalLM``: contiguous decoder layers wrapping the HF modules.

Hugging Face computes the rotary position embeddings and the causal mask in ``LlamaModel.forward``, once for all
layers; a stage recomputes both from its input's sequence length (every stage holds ``rotary_emb``, which has no
parameters), with transformers' own ``create_causal_mask``, so a stage's layers see exactly what the whole
model's layers see. The first stage takes token ids (``model.embed_tokens``), the last returns logits
(``model.norm`` and ``lm_head``); the loss is `colo.apps.models.llama.causal_lm_loss` on them, which shifts the
labels as Hugging Face does. Stages keep the model's parameter names (``model.layers.5.mlp.up_proj.weight``), so
the tensor-parallel plan, the optimizer re-pointing and checkpoints apply to a stage as to the whole model.
"""

from __future__ import annotations

import torch
from torch import nn

from colo.pipeline import partition_uniform


class _Trunk(nn.Module):
    """Holds a stage's share of ``LlamaForCausalLM.model`` under its original names."""


class HFLlamaStage(nn.Module):
    """Decoder layers ``layer_ids`` of a Hugging Face ``LlamaForCausalLM`` (shared, not copied).

    Args:
        model: the ``transformers.LlamaForCausalLM``.
        layer_ids (list[int]): the stage's layers, contiguous and in order.
        first (bool): the stage holds the embedding and takes token ids.
        last (bool): the stage holds the final norm and ``lm_head`` and returns logits.
    """

    def __init__(self, model: nn.Module, layer_ids: list[int], *, first: bool, last: bool):
        super().__init__()
        self.config = model.config
        self.first, self.last = first, last
        self.model = _Trunk()
        if first:
            self.model.embed_tokens = model.model.embed_tokens
        self.model.rotary_emb = model.model.rotary_emb
        self.model.layers = nn.ModuleDict({str(i): model.model.layers[i] for i in layer_ids})
        if last:
            self.model.norm = model.model.norm
            self.lm_head = model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``(batch, seq)`` token ids on the first stage, else ``(batch, seq, hidden)``. Returns hidden
        states, or ``(batch, seq, vocab)`` logits on the last stage."""
        from transformers.masking_utils import create_causal_mask

        if self.first:
            x = self.model.embed_tokens(x)
        position_ids = torch.arange(x.shape[1], device=x.device).unsqueeze(0)
        mask = create_causal_mask(
            config=self.config, inputs_embeds=x, attention_mask=None, past_key_values=None, position_ids=position_ids
        )
        position_embeddings = self.model.rotary_emb(x, position_ids=position_ids)
        for layer in self.model.layers.values():
            x = layer(x, attention_mask=mask, position_ids=position_ids, position_embeddings=position_embeddings)
            if isinstance(x, tuple):  # decoder layers of transformers < 4.54 return a tuple
                x = x[0]
        if self.last:
            x = self.lm_head(self.model.norm(x))
        return x

    def tied_parameters(self) -> dict[str, nn.Parameter]:
        """``{"word_embeddings": weight}`` on the first and the last stage of a tied model, else ``{}``."""
        if not getattr(self.config, "tie_word_embeddings", False) or not (self.first or self.last):
            return {}
        return {"word_embeddings": self.model.embed_tokens.weight if self.first else self.lm_head.weight}


def hf_llama_pipeline_stages(model: nn.Module, num_stages: int) -> list[HFLlamaStage]:
    """Cut a Hugging Face ``LlamaForCausalLM`` into ``num_stages`` stages of equal numbers of decoder layers.

    Args:
        model: the ``transformers.LlamaForCausalLM``.
        num_stages (int): the number of stages (at most the number of layers).

    Returns:
        list[HFLlamaStage]: stage ``i`` for pipeline stage ``i``. A tied model's stages untie nothing: the first
        and last stage share the embedding until a tensor-parallel plan replaces it (see `HFLlamaPlan`).
    """
    ranges = partition_uniform(len(model.model.layers), num_stages)
    return [
        HFLlamaStage(model, list(layer_ids), first=index == 0, last=index == num_stages - 1)
        for index, layer_ids in enumerate(ranges)
    ]
