"""`MoELlama`: the Llama decoder with mixture-of-experts MLPs (Mixtral-style), architecture only.

Layer ``i`` with ``config.is_moe_layer(i)`` has a `colo.tensor.moe.MoEBlock` as its ``mlp`` (router ``mlp.gate``,
experts ``mlp.experts.w1`` / ``w2`` / ``w3`` as ``(E, ...)`` tensors: transformers 5's in-memory Mixtral names up to
the fused ``gate_up_proj``; with shared experts DeepSeek-V3's ``mlp.shared_experts.gate_proj`` / ``up_proj`` /
``down_proj``); with ``kv_lora_rank`` set, each ``self_attn`` is DeepSeek-V3's multi-head latent attention
(`colo.apps.models.moe_llama.mla`); every other module is `colo.apps.models.llama.Llama`'s. The training loss is the
next-token loss plus every MoE layer's weighted auxiliary losses from the same forward. Expert parallelism is applied
from outside (`colo.tensor.moe.shard_experts`).
"""

from __future__ import annotations

import torch
from torch import nn

from colo.tensor.moe import GroupedExperts, MoEBlock, TopKRouter, moe_aux_loss

from ..llama.layers import RotaryEmbedding
from ..llama.model import Llama, LlamaOutput, init_llama_module, module_seed
from .config import MoELlamaConfig
from .mla import MultiHeadLatentAttention


@torch.no_grad()
def init_moe_llama_module(name: str, module: nn.Module, *, config: MoELlamaConfig, seed: int) -> None:
    """`init_llama_module` plus the MoE modules: the router weight and each expert tensor from
    ``normal(0, initializer_range)`` with a generator seeded by (seed, name); expert ``e``'s slices are drawn
    from a generator of their own (``"{name}.{e}"``), so a rank holding some experts draws the same values."""
    if isinstance(module, TopKRouter):
        generator = torch.Generator(device=module.weight.device).manual_seed(module_seed(seed, name))
        nn.init.normal_(module.weight, std=config.initializer_range, generator=generator)
        module.expert_bias.zero_()
    elif isinstance(module, GroupedExperts):
        for param_name in ("w1", "w2", "w3"):
            tensor = getattr(module, param_name)
            for e in range(tensor.shape[0]):
                generator = torch.Generator(device=tensor.device).manual_seed(
                    module_seed(seed, f"{name}.{e}.{param_name}")
                )
                nn.init.normal_(tensor[e], std=config.initializer_range, generator=generator)
    elif not isinstance(module, MoEBlock):
        init_llama_module(name, module, config=config, seed=seed)


class MoELlama(Llama):
    """The Llama causal LM with MoE MLPs (see the module docstring).

    Args:
        config (MoELlamaConfig): the model's shape and routing.

    Example::

        model = MoELlama(get_moe_preset("tiny-moe"))
        loss = model(input_ids, labels=input_ids).loss      # next-token loss + aux losses
    """

    def __init__(self, config: MoELlamaConfig):
        if not isinstance(config, MoELlamaConfig):
            raise TypeError(
                f"MoELlama: config must be a MoELlamaConfig (get_moe_preset('tiny-moe')), not {type(config)}"
            )
        self._building = True
        super().__init__(config)
        meta = self.embed_tokens.weight.is_meta
        moe = config.moe_config()
        with torch.device("meta" if meta else self.embed_tokens.weight.device):
            for index, layer in self.layers.items():
                if config.is_moe_layer(int(index)):
                    layer.mlp = MoEBlock(config.hidden_size, config.expert_intermediate_size, moe)
                if config.latent_attention:
                    layer.self_attn = MultiHeadLatentAttention(
                        config.hidden_size,
                        config.num_attention_heads,
                        kv_lora_rank=config.kv_lora_rank,
                        q_lora_rank=config.q_lora_rank,
                        qk_nope_head_dim=config.qk_nope_head_dim,
                        qk_rope_head_dim=config.qk_rope_head_dim,
                        v_head_dim=config.v_head_dim,
                        rope_interleave=config.rope_interleave,
                        rms_norm_eps=config.rms_norm_eps,
                    )
            if config.latent_attention:  # the rotary tables of the decoupled rotary dims
                self.rotary_emb = RotaryEmbedding(
                    config.qk_rope_head_dim, config.max_position_embeddings, config.rope_theta
                )
        self._building = False
        if not meta:
            self.init_weights()

    def init_weights(self, seed: int | None = None) -> None:
        """(Re)initialize every parameter deterministically from ``seed`` (see `Llama.init_weights`)."""
        if self._building:
            return
        if any(t.is_meta for t in (*self.parameters(), *self.buffers())):
            raise ValueError("MoELlama.init_weights: the model is on the meta device; call model.to_empty(...) first")
        if seed is None:
            seed = int(torch.randint(0, 2**62, ()).item())
        self.tie_weights()
        for name, module in self.named_modules():
            init_moe_llama_module(name, module, config=self.config, seed=seed)

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        *args,
        aux_loss_scale: float = 1.0,
        **kwargs,
    ) -> LlamaOutput:
        """`Llama.forward`; with ``labels`` the loss also holds the MoE layers' weighted aux losses, times
        ``aux_loss_scale`` (a sequence-parallel plan sets it to undo the shard weight it puts on the whole loss)."""
        out = super().forward(input_ids, labels, *args, **kwargs)
        if out.loss is not None:
            aux = moe_aux_loss(self)
            if aux is not None:
                out.loss = out.loss + aux.to(out.loss.dtype) * aux_loss_scale
        return out
