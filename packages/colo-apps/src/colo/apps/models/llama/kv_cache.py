"""`KVCache`: the static, preallocated key/value cache of incremental decoding (as Hugging Face's ``StaticCache``).

Every decoder layer gets one key and one value buffer ``(batch, max_len, num_kv_heads, head_dim)`` in the model's
dtype and device, allocated once; ``length`` counts the tokens already cached (the same for every layer and every
sequence of the batch). A forward with the cache (``Llama.forward(ids, kv_cache=cache)``) gives its ``seq`` new
tokens the positions ``length .. length + seq - 1``, writes each layer's new keys (after RoPE) and values at those
rows, attends over rows ``0 .. length + seq - 1`` and then advances ``length`` by ``seq``. The causal mask of
`colo.kernels.flash_attention` is bottom-right aligned, so ``seq`` queries over ``length + seq`` keys see exactly
the keys at or before their own position, as in the full forward.

Example::

    cache = KVCache.for_model(model, batch_size=1, max_len=256)
    logits = model(prompt_ids, kv_cache=cache).logits      # prefill: (batch, prompt_len, vocab)
    next_logits = model(next_ids, kv_cache=cache).logits   # then (batch, 1) ids at a time
    cache.reset()                                           # reuse the buffers for another prompt
"""

from __future__ import annotations

import torch
from torch import nn


def check_positive_ints(owner: str, **values) -> None:
    """Raise a `ValueError` naming the first of ``values`` that is not a positive int (a cache's sizes)."""
    for name, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{owner}: {name}={value!r} must be a positive int")


class KVCache:
    """Preallocated keys and values of every decoder layer, with the number of tokens cached so far.

    Args:
        num_layers (int): decoder layers of the model (or pipeline stage) the cache serves.
        batch_size (int): sequences decoded together.
        max_len (int): the most tokens (prompt and generated) the cache holds.
        num_kv_heads (int): key/value heads of one layer (this rank's count in a tensor-parallel model).
        head_dim (int): size of one head.
        dtype (torch.dtype): dtype of the buffers (the model's). Default: ``torch.float32``.
        device (torch.device | str | None): where the buffers live (the model's device). Default: ``None`` (the
            current default device).

    Attributes:
        keys (list[torch.Tensor]): per layer, ``(batch_size, max_len, num_kv_heads, head_dim)`` keys after RoPE.
        values (list[torch.Tensor]): per layer, the values, shaped like ``keys``.
        length (int): tokens cached so far; rows ``length ..`` of the buffers are stale.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        batch_size: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str | None = None,
    ):
        check_positive_ints(
            "KVCache",
            num_layers=num_layers,
            batch_size=batch_size,
            max_len=max_len,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
        )
        shape = (batch_size, max_len, num_kv_heads, head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.length = 0
        self._layers = [LayerKVCache(self, index) for index in range(num_layers)]

    @classmethod
    def for_model(cls, model: nn.Module, *, batch_size: int = 1, max_len: int | None = None) -> KVCache:
        """A cache shaped for ``model`` (a `Llama` or `LlamaStage`): its layers, heads, dtype and device.

        The head counts are read from the attention modules (``num_kv_heads``, ``head_dim``), so a tensor-parallel
        model gets a cache of this rank's kv heads (and multi-head latent attention one of its expanded, padded heads).

        Args:
            model (nn.Module): the model; must have ``config`` and ``layers``.
            batch_size (int): sequences decoded together. Default: ``1``.
            max_len (int | None): the most tokens the cache holds; ``None``: ``max_position_embeddings``.
                Default: ``None``.
        """
        layers = list(model.layers.values())
        if not layers:
            raise ValueError("KVCache.for_model: the model has no decoder layers to cache")
        attention = layers[0].self_attn
        projection = getattr(attention, "qkv_proj", attention)  # multi-head latent attention has several projections
        weight = next(projection.parameters(), None)  # a Linear's weight, a tp QKVParallelLinear's q_weight
        if weight is None:  # a weight-only quantized projection (colo.apps.quant) holds buffers: the norm's dtype
            weight = layers[0].input_layernorm.weight
        return cls(
            num_layers=len(layers),
            batch_size=batch_size,
            max_len=model.config.max_position_embeddings if max_len is None else max_len,
            num_kv_heads=attention.num_kv_heads,
            head_dim=attention.head_dim,
            dtype=weight.dtype,
            device=weight.device,
        )

    @property
    def num_layers(self) -> int:
        return len(self.keys)

    @property
    def batch_size(self) -> int:
        return self.keys[0].shape[0]

    @property
    def max_len(self) -> int:
        return self.keys[0].shape[1]

    @property
    def device(self) -> torch.device:
        return self.keys[0].device

    def reset(self) -> None:
        """Forget the cached tokens (the buffers are kept and overwritten by the next forward)."""
        self.length = 0

    def layer(self, index: int) -> LayerKVCache:
        """The view of layer ``index`` (its position among the model's layers) that `LlamaAttention` writes to."""
        return self._layers[index]

    def check_input(self, batch: int, seq: int, *, num_layers: int, device: torch.device) -> None:
        """Raise a `ValueError` saying what to change when ``seq`` new tokens of ``batch`` sequences do not fit.

        Args:
            batch (int): sequences of the input.
            seq (int): new tokens per sequence.
            num_layers (int): decoder layers of the model running the forward.
            device (torch.device): the input's device.
        """
        if num_layers != self.num_layers:
            raise ValueError(
                f"KVCache: built for {self.num_layers} layers but the model has {num_layers}; build it with "
                "KVCache.for_model(model, ...)"
            )
        if batch != self.batch_size:
            raise ValueError(
                f"KVCache: built for batch_size={self.batch_size} but the input has {batch} sequences; build it "
                f"with KVCache.for_model(model, batch_size={batch})"
            )
        if self.length + seq > self.max_len:
            raise ValueError(
                f"KVCache: {self.length} cached + {seq} new tokens exceed max_len={self.max_len}; reset() it, or "
                f"build it with max_len>={self.length + seq}"
            )
        if device != self.device:
            raise ValueError(f"KVCache: the cache is on {self.device} but the input is on {device}; build it there")

    def advance(self, num_tokens: int) -> None:
        """Count ``num_tokens`` more tokens as cached (called by the model after every layer wrote them)."""
        self.length += num_tokens

    def __repr__(self) -> str:
        k = self.keys[0]
        return (
            f"KVCache(num_layers={self.num_layers}, batch_size={k.shape[0]}, max_len={k.shape[1]}, "
            f"num_kv_heads={k.shape[2]}, head_dim={k.shape[3]}, dtype={k.dtype}, length={self.length})"
        )


class LayerKVCache:
    """One layer's slot of a `KVCache`: where `LlamaAttention` writes its new keys and values.

    Args:
        cache (KVCache): the cache.
        index (int): the layer's position among the cached layers.
    """

    def __init__(self, cache: KVCache, index: int):
        self.cache, self.index = cache, index

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``(batch, seq, kv_heads, head_dim)`` keys (after RoPE) and values at rows ``length ..``.

        Returns:
            tuple[torch.Tensor, torch.Tensor]: views of the layer's keys and values of rows
            ``0 .. length + seq - 1`` (the cached tokens and the new ones).
        """
        keys, values = self.cache.keys[self.index], self.cache.values[self.index]
        if k.shape[0] != keys.shape[0] or k.shape[2:] != keys.shape[2:] or v.shape != k.shape:
            raise ValueError(
                f"KVCache: layer {self.index} got keys {tuple(k.shape)} and values {tuple(v.shape)} but caches "
                f"(batch={keys.shape[0]}, seq, kv_heads={keys.shape[2]}, head_dim={keys.shape[3]}); build the cache "
                "with KVCache.for_model(model, ...) after any parallelize_llama"
            )
        start, end = self.cache.length, self.cache.length + k.shape[1]
        if end > keys.shape[1]:
            raise ValueError(
                f"KVCache: {start} cached + {k.shape[1]} new tokens exceed max_len={keys.shape[1]}; reset() it, or "
                f"build it with max_len>={end}"
            )
        keys[:, start:end].copy_(k)
        values[:, start:end].copy_(v)
        return keys[:, :end], values[:, :end]
