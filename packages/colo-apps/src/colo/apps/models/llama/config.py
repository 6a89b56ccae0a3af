"""`LlamaConfig`: the shape of a Llama model, validated, with named presets.

Field names follow Hugging Face's ``transformers.LlamaConfig`` where the meaning is the same, so a config can be
read from a Hugging Face ``config.json`` field by field (`colo.apps.models.llama.hf.llama_config_from_hf`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """The architecture of a Llama decoder (Touvron et al., 2023): sizes, RoPE and normalization constants.

    Frozen: derive a variant with ``dataclasses.replace(config, num_hidden_layers=4)`` or
    ``get_preset("tiny", num_hidden_layers=4)``; both validate again.
    """

    vocab_size: int
    """Number of token ids; the embedding and the output projection have this many rows."""

    hidden_size: int
    """Width of the residual stream (the model dimension)."""

    intermediate_size: int
    """Width of the SwiGLU MLP's gate and up projections."""

    num_hidden_layers: int
    """Number of decoder layers."""

    num_attention_heads: int
    """Number of query heads per layer."""

    num_key_value_heads: int
    """Number of key/value heads; must divide ``num_attention_heads``: equal for multi-head attention, fewer for
    grouped-query attention (Ainslie et al., 2023)."""

    max_position_embeddings: int = 2048
    """Longest sequence the model runs on: the rotary tables hold this many positions."""

    rms_norm_eps: float = 1e-6
    """Added to the mean square in every RMSNorm."""

    rope_theta: float = 10000.0
    """RoPE base: frequency ``i`` of a head is ``rope_theta ** (-2 i / head_dim)``."""

    tie_word_embeddings: bool = False
    """Share one matrix between the token embedding and the output projection (``lm_head``)."""

    initializer_range: float = 0.02
    """Standard deviation of the normal initialization of every linear and embedding weight."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads"):
            self._check_positive_int(name, getattr(self, name))
        self._check_positive_int("num_key_value_heads", self.num_key_value_heads)
        self._check_positive_int("max_position_embeddings", self.max_position_embeddings)
        heads = self.num_attention_heads
        if heads % self.num_key_value_heads:
            raise ValueError(
                f"LlamaConfig: num_attention_heads={heads} is not a multiple of num_key_value_heads="
                f"{self.num_key_value_heads}; each kv head serves a group of query heads, so choose "
                f"num_key_value_heads in {_divisors(heads)}"
            )
        if self.hidden_size % heads:
            raise ValueError(
                f"LlamaConfig: hidden_size={self.hidden_size} is not divisible by num_attention_heads={heads}; "
                f"choose num_attention_heads in {_divisors(self.hidden_size)}"
            )
        if self.head_dim % 2:
            raise ValueError(
                f"LlamaConfig: head_dim = hidden_size / num_attention_heads = {self.head_dim} must be even (rotary "
                "embeddings rotate pairs of features); change hidden_size or num_attention_heads"
            )
        for name in ("rms_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"LlamaConfig: {name}={value!r} must be a positive number")
        if not isinstance(self.initializer_range, (int, float)) or not self.initializer_range >= 0:
            raise ValueError(f"LlamaConfig: initializer_range={self.initializer_range!r} must be a number >= 0")
        if not isinstance(self.tie_word_embeddings, bool):
            raise ValueError(f"LlamaConfig: tie_word_embeddings={self.tie_word_embeddings!r} must be True or False")

    @property
    def head_dim(self) -> int:
        """Size of one attention head, ``hidden_size // num_attention_heads``."""
        return self.hidden_size // self.num_attention_heads

    @property
    def attention_head_dims(self) -> tuple[int, int]:
        """Per-head sizes of the (query / key, value) vectors attention multiplies: ``(head_dim, head_dim)``."""
        return self.head_dim, self.head_dim

    @property
    def num_norm_parameters(self) -> int:
        """Parameters of the RMSNorm scales: two per layer and the final one."""
        return (2 * self.num_hidden_layers + 1) * self.hidden_size

    @staticmethod
    def _check_positive_int(name: str, value: object) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"LlamaConfig: {name}={value!r} must be a positive integer")

    def num_parameters(self, *, embeddings: bool = True) -> int:
        """The number of parameters of `Llama` with this config, counted from the shapes.

        Args:
            embeddings (bool): count the token embedding. With tied embeddings the shared matrix is counted once,
                as the output projection, even when ``embeddings=False``. Default: ``True``.

        Returns:
            int: the parameter count (a tied matrix once).
        """
        hidden, head_dim = self.hidden_size, self.head_dim
        attention = hidden * (self.num_attention_heads + 2 * self.num_key_value_heads) * head_dim
        attention += self.num_attention_heads * head_dim * hidden
        layer = attention + 3 * hidden * self.intermediate_size + 2 * hidden  # two RMSNorm weights
        embedding = self.vocab_size * hidden
        total = self.num_hidden_layers * layer + hidden + embedding  # final norm, lm_head
        if not self.tie_word_embeddings and embeddings:
            total += embedding
        return total


PRESETS: dict[str, LlamaConfig] = {
    # CPU tests: every size small, head_dim 16 (a Triton attention size), GQA with 2 query heads per kv head
    "tiny": LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    ),
    # CPU demo: 5.0M parameters, trains a few hundred steps in minutes on a laptop
    "tiny-llama": LlamaConfig(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=1024,
    ),
    # the shared benchmark recipe (BENCHMARKS.md): 25.8M parameters, Hugging Face LlamaConfig defaults otherwise
    "bench-25m": LlamaConfig(
        vocab_size=8192,
        hidden_size=512,
        intermediate_size=1376,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=2048,
    ),
    # TinyLlama-1.1B (Zhang et al., 2024): the Llama-2 architecture at 1.1B, GQA with 4 kv heads
    "1b": LlamaConfig(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
    ),
    # Llama-2-7B: 6.74B parameters, multi-head attention
    "7b": LlamaConfig(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
    ),
    # Llama-2-70B: 69.0B parameters, GQA with 8 kv heads
    "70b": LlamaConfig(
        vocab_size=32000,
        hidden_size=8192,
        intermediate_size=28672,
        num_hidden_layers=80,
        num_attention_heads=64,
        num_key_value_heads=8,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
    ),
}
"""Named shapes: ``tiny`` (CPU tests), ``tiny-llama`` (CPU demo), ``bench-25m`` (the benchmark recipe), and the
published shapes ``1b`` (TinyLlama-1.1B), ``7b`` (Llama-2-7B) and ``70b`` (Llama-2-70B)."""


def get_preset(name: str, **overrides) -> LlamaConfig:
    """The preset config ``name``, optionally with some fields changed.

    Args:
        name (str): one of `PRESETS`: ``"tiny"``, ``"tiny-llama"``, ``"bench-25m"``, ``"1b"``, ``"7b"``, ``"70b"``.
        **overrides: fields to replace, e.g. ``num_hidden_layers=4`` (validated like any config).

    Returns:
        LlamaConfig: the config.

    Raises:
        ValueError: for an unknown name (the message lists the presets) or an invalid override.
    """
    if name not in PRESETS:
        raise ValueError(f"unknown Llama preset {name!r}; choose one of {sorted(PRESETS)}")
    unknown = sorted(set(overrides) - {field.name for field in dataclasses.fields(LlamaConfig)})
    if unknown:
        raise ValueError(f"get_preset({name!r}): {unknown} are not LlamaConfig fields")
    return dataclasses.replace(PRESETS[name], **overrides)
