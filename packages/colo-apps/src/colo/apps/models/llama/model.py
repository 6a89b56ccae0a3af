"""`Llama`: the Llama decoder-only language model (Touvron et al., 2023), architecture only.

Token embedding, ``num_hidden_layers`` pre-norm decoder layers (RMSNorm, grouped-query attention with RoPE,
SwiGLU MLP), a final RMSNorm and the output projection ``lm_head``; the loss is computed by a swappable
`CausalLMObjective`. Parallelism is applied from outside (`colo.apps.models.llama.parallelize_llama`).

Parameter names follow Hugging Face's ``LlamaForCausalLM`` without its ``model.`` prefix, except that q, k and v
are one fused projection (``layers.N.self_attn.qkv_proj``); `colo.apps.models.llama.hf` maps between the two.
Layers live in an ``nn.ModuleDict`` keyed by their index, so a pipeline stage holding layers 4..7 names them
``layers.4`` .. ``layers.7``, as the full model does.

**Packed rows.** A row may hold several documents (``packing: documents``): their ``position_ids`` restart at each
document, and the model derives document ids from them (a document starts wherever the positions do not go up by
one, as transformers does) so that attention stays within each document: the row trains exactly as if each
document were its own row. ``document_ids`` can also be given directly (padding an id of its own, see
`colo.kernels.document_mask`); a sequence-parallel plan passes the whole sequence's ids, since each rank's
positions are those of its shard (it sets ``document_ids_from_positions = False``). Otherwise the model builds one
`colo.kernels.DocumentMask` per forward and every layer attends with it: the ids are checked once (a host sync),
not per layer, and the attention kernels' block ranges are computed once.

**Initialization** is a pure function of ``(seed, module name)``: every weight is drawn from its own generator
seeded from the model seed and the module's qualified name (normal with ``initializer_range``, norms at one, as
Hugging Face initializes Llama). So a model built on the meta device and materialized module by module, shard by
shard, or stage by stage gets exactly the values ``init_weights(seed)`` gives the whole model.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch import nn

from colo.kernels import DocumentMask, build_document_mask, document_ids_from_position_ids

from .config import LlamaConfig
from .kv_cache import KVCache
from .layers import LlamaDecoderLayer, RMSNorm, RotaryEmbedding
from .loss import CausalLMObjective, LMHead


@dataclass
class LlamaOutput:
    """What `Llama.forward` returns.

    Attributes:
        loss: the fp32 scalar mean next-token loss, when labels were given.
        logits: ``(batch, seq, vocab)`` logits, without labels or with ``return_logits=True``.
    """

    loss: torch.Tensor | None = None
    logits: torch.Tensor | None = None


def module_seed(seed: int, name: str) -> int:
    """The seed of module ``name``'s generator: 63 bits of SHA-256 of ``"{seed}/{name}"`` (stable everywhere)."""
    digest = hashlib.sha256(f"{int(seed)}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


@torch.no_grad()
def init_llama_module(name: str, module: nn.Module, *, config: LlamaConfig, seed: int) -> None:
    """Initialize ``module``'s own parameters and buffers (not its children's) in place.

    The ``init_fn(name, module)`` of `colo.tensor.parallelize` (bind ``config`` and ``seed``). Linear and
    embedding weights are drawn from ``normal(0, config.initializer_range)`` with a generator seeded by
    `module_seed`, biases are zero, RMSNorm scales one, rotary tables computed. A tied ``lm_head`` draws with the
    embedding's name (its sibling ``embed_tokens``), so it gets the embedding's values even where the two live
    apart (on the first and the last pipeline stage).

    Args:
        name (str): the module's qualified name in the model (``"layers.3.mlp.up_proj"``).
        module (nn.Module): the module, unsharded and off the meta device.
        config (LlamaConfig): the model's config.
        seed (int): the model seed.

    Raises:
        TypeError: for a module with parameters and no rule here (e.g. an already sharded layer).
    """
    if isinstance(module, (RMSNorm, RotaryEmbedding)):
        module.reset_parameters()
    elif isinstance(module, (nn.Linear, nn.Embedding)):
        prefix, _, leaf = name.rpartition(".")
        if leaf == "lm_head" and config.tie_word_embeddings:
            name = f"{prefix}.embed_tokens" if prefix else "embed_tokens"
        generator = torch.Generator(device=module.weight.device).manual_seed(module_seed(seed, name))
        nn.init.normal_(module.weight, std=config.initializer_range, generator=generator)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)
    elif next(module.parameters(recurse=False), None) is not None:
        raise TypeError(
            f"init_llama_module: no initialization rule for {name!r} ({type(module).__name__}); initialize the "
            "unsharded model (init_weights before parallelize_llama, or let parallelize_llama materialize it)"
        )


def attention_document_ids(position_ids: torch.Tensor, batch_size: int) -> torch.Tensor | None:
    """``(batch, seq)`` document ids of packed rows derived from their positions
    (`colo.kernels.document_ids_from_position_ids`), ``None`` when no row restarts its positions (plain causal
    attention)."""
    ids = document_ids_from_position_ids(position_ids)
    if not bool(ids[..., -1:].any()):
        return None
    return ids.expand(batch_size, -1) if ids.dim() == 1 or ids.shape[0] == 1 else ids


def layers_document_mask(
    document_ids: torch.Tensor | None, *, whole_sequence: bool, seq_q: int | None = None
) -> torch.Tensor | DocumentMask | None:
    """What the layers of one forward attend with: ``document_ids`` made one `DocumentMask` for all of them
    (`colo.kernels.build_document_mask`, for ``seq_q`` queries per row, ``None``: one per id; checked once, block
    ranges cached), or as given when they are the ``whole_sequence``'s ids for a sequence-parallel core, or under
    ``torch.compile`` (the compiled graph reads nothing on the host either way)."""
    if document_ids is None or whole_sequence or torch.compiler.is_compiling():
        return document_ids
    return build_document_mask(document_ids, seq_q=seq_q)


class Llama(nn.Module):
    """The Llama causal language model.

    Built eagerly, it is initialized from a seed drawn from torch's global generator; built under
    ``torch.device("meta")`` it allocates nothing: materialize it with ``model.to_empty(device=...)`` and
    `init_weights`, or let `parallelize_llama` materialize only this rank's shards.

    Args:
        config (LlamaConfig): the model's shape.

    Example::

        config = get_preset("tiny")
        model = Llama(config)
        out = model(input_ids, labels=input_ids)
        out.loss.backward()
    """

    def __init__(self, config: LlamaConfig):
        super().__init__()
        if not isinstance(config, LlamaConfig):
            raise TypeError(f"Llama: config must be a LlamaConfig (e.g. get_preset('tiny')), not {type(config)}")
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta)
        self.layers = nn.ModuleDict({str(i): LlamaDecoderLayer(config) for i in range(config.num_hidden_layers)})
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = LMHead(config.hidden_size, config.vocab_size, bias=False)
        self.objective = CausalLMObjective()
        self.document_ids_from_positions = True
        """Derive the attention's document ids from ``position_ids`` (packed rows); plans that shard the sequence
        turn it off and pass the whole sequence's ``document_ids`` instead."""
        self.tie_weights()
        if not self.embed_tokens.weight.is_meta:
            self.init_weights()

    def tie_weights(self) -> None:
        """Make ``lm_head`` share the embedding's weight when the config ties them (``to_empty`` unties them)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def init_weights(self, seed: int | None = None) -> None:
        """(Re)initialize every parameter and buffer in place, deterministically from ``seed``.

        Args:
            seed (int | None): the model seed (see the module docstring); ``None`` draws one from torch's global
                generator. Default: ``None``.

        Raises:
            ValueError: if the model is still on the meta device.
        """
        if any(t.is_meta for t in (*self.parameters(), *self.buffers())):
            raise ValueError(
                "Llama.init_weights: the model is on the meta device; call model.to_empty(device=...) first, or "
                "let parallelize_llama(model, mesh=..., materialize=device, seed=...) materialize its shards"
            )
        if seed is None:
            seed = int(torch.randint(0, 2**62, ()).item())
        self.tie_weights()
        for name, module in self.named_modules():
            init_llama_module(name, module, config=self.config, seed=seed)

    def attention_document_ids(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor | None, document_ids: torch.Tensor | None
    ) -> torch.Tensor | None:
        """The attention's document ids: ``document_ids`` as given, else derived from per-row ``position_ids``
        (`colo.kernels.document_ids_from_position_ids`), ``None`` when every row is one document."""
        if document_ids is not None or position_ids is None or not self.document_ids_from_positions:
            return document_ids
        return attention_document_ids(position_ids, input_ids.shape[0])

    def hidden_states(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        *,
        kv_cache: KVCache | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The final hidden states (after the last norm): ``(batch, seq, hidden_size)``.

        Args:
            input_ids (torch.Tensor): ``(batch, seq)`` token ids.
            position_ids (torch.Tensor | None): ``(seq,)``, ``(1, seq)`` or ``(batch, seq)`` positions for RoPE;
                ``None``: ``0 .. seq - 1``, or ``kv_cache.length .. kv_cache.length + seq - 1`` with a cache.
                Without a cache, positions that restart within a row start a new document there (packed rows):
                attention does not cross it. Default: ``None``.
            kv_cache (KVCache | None): incremental decoding: ``input_ids`` are the tokens that follow the
                ``kv_cache.length`` cached ones; every layer appends their keys and values to the cache and attends
                over all of it, and ``kv_cache.length`` grows by ``seq``. Default: ``None`` (attend over
                ``input_ids`` alone).
            document_ids (torch.Tensor | None): ``(batch, keys)`` document ids of the keys, non-decreasing per row,
                padding an id of its own (`colo.kernels.document_mask`); with a cache, one per cached and new token
                (``kv_cache.length + seq``), e.g. ``-1`` on the left padding of batched prompts. ``None``: derived
                from ``position_ids`` (without a cache). Default: ``None``.
        """
        if input_ids.dim() != 2:
            raise ValueError(f"Llama: input_ids must be (batch, seq), got shape {tuple(input_ids.shape)}")
        if kv_cache is None:
            document_ids = self.attention_document_ids(input_ids, position_ids, document_ids)
            document_ids = layers_document_mask(document_ids, whole_sequence=not self.document_ids_from_positions)
            cos, sin = self.rotary_emb(input_ids.shape[1], position_ids)
            h = self.embed_tokens(input_ids)
            for layer in self.layers.values():
                h = layer(h, cos, sin, document_ids=document_ids)
            return self.norm(h)
        batch, seq = input_ids.shape
        kv_cache.check_input(batch, seq, num_layers=len(self.layers), device=input_ids.device)
        cos, sin = self.rotary_emb(seq, position_ids, offset=kv_cache.length)
        # the new tokens' queries over every cached and new key (a paged cache's layers mask themselves)
        document_ids = layers_document_mask(
            document_ids, whole_sequence=not self.document_ids_from_positions, seq_q=seq
        )
        h = self.embed_tokens(input_ids)
        for index, layer in enumerate(self.layers.values()):
            h = layer(h, cos, sin, kv_cache=kv_cache.layer(index), document_ids=document_ids)
        kv_cache.advance(seq)
        return self.norm(h)

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        *,
        return_logits: bool = False,
        kv_cache: KVCache | None = None,
        document_ids: torch.Tensor | None = None,
    ) -> LlamaOutput:
        """Logits, or the next-token loss.

        Args:
            input_ids (torch.Tensor): ``(batch, seq)`` token ids.
            labels (torch.Tensor | None): ``(batch, seq)`` labels aligned with ``input_ids`` (Hugging Face's
                convention: position ``t`` predicts ``labels[:, t + 1]``; ``-100`` marks tokens without a loss).
                Default: ``None``.
            position_ids (torch.Tensor | None): positions for RoPE (see `hidden_states`). Default: ``None``.
            return_logits (bool): return the logits along with the loss; without it a loss is computed without
                materializing the logits. Default: ``False``.
            kv_cache (KVCache | None): incremental decoding (see `hidden_states`); ``input_ids`` continue the cached
                tokens. Default: ``None``.
            document_ids (torch.Tensor | None): the document mask (see `hidden_states`); ``None``: from
                ``position_ids``. Default: ``None``.

        Returns:
            LlamaOutput: ``loss`` when ``labels`` are given; ``logits`` without labels or with ``return_logits``.
        """
        if labels is not None and labels.shape != input_ids.shape:
            raise ValueError(
                f"Llama: labels {tuple(labels.shape)} must be shaped like input_ids {tuple(input_ids.shape)}"
            )
        hidden = self.hidden_states(input_ids, position_ids, kv_cache=kv_cache, document_ids=document_ids)
        loss, logits = self.objective(hidden, self.lm_head, labels, return_logits=return_logits)
        return LlamaOutput(loss=loss, logits=logits)
