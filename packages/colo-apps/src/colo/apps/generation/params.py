"""`SamplingParams`: how a batch of prompts is continued (length, stop tokens, temperature, top-p, top-k, samples)."""

from __future__ import annotations

import math
from dataclasses import dataclass


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """The settings of one `generate` call, validated on construction.

    The policy's distribution at a step is ``softmax(logits / temperature)`` over the ids below ``vocab_limit``; the
    sampled token is drawn from it after top-k and then top-p filtering (the order of Hugging Face's logits warpers),
    and its log-prob is taken *before* the filtering, under the policy itself (what the trainer recomputes).

    Example::

        params = SamplingParams(max_new_tokens=32, temperature=0.7, top_p=0.95, n=4, eos_token_id=2,
                                pad_token_id=0, seed=1)
    """

    max_new_tokens: int
    """The most tokens generated per sequence (a sequence stops earlier at an eos token)."""
    temperature: float = 1.0
    """Softmax temperature; ``0`` is greedy decoding (its log-probs are those of the unscaled logits)."""
    top_p: float = 1.0
    """Nucleus sampling (Holtzman et al., 2020): sample from the smallest set of tokens whose probability reaches
    ``top_p``; ``1.0`` keeps all."""
    top_k: int = 0
    """Sample from the ``top_k`` most likely tokens; ``0`` keeps all."""
    n: int = 1
    """Samples per prompt: prompt ``i`` becomes rows ``i * n .. i * n + n - 1`` of the `Rollout`."""
    eos_token_id: int | tuple[int, ...] | None = None
    """Token id(s) that end a sequence (the eos is kept in the response); ``None``: only ``max_new_tokens`` stops."""
    pad_token_id: int = 0
    """The id written on the left padding of prompts and after a sequence's eos."""
    seed: int | None = None
    """Seed of the sampling generator when `generate` is given none; ``None``: torch's global generator."""
    vocab_limit: int | None = None
    """Only ids below this are the policy's (a tokenizer smaller than the model's padded vocabulary): they are never
    sampled, and the log-probs are those of ``softmax(logits[:, :vocab_limit] / temperature)``, the distribution the
    trainers recompute (unlike top-k / top-p, which filter the sampling only). ``None``: the whole vocabulary."""

    def __post_init__(self) -> None:
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"SamplingParams: max_new_tokens={self.max_new_tokens!r} must be an int >= 1")
        temperature = self.temperature
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or not temperature >= 0:
            raise ValueError(f"SamplingParams: temperature={temperature!r} must be a finite float >= 0 (0 = greedy)")
        if not math.isfinite(temperature):
            raise ValueError(f"SamplingParams: temperature={temperature!r} must be a finite float >= 0 (0 = greedy)")
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams: top_p={self.top_p!r} must be in (0, 1] (1.0 keeps every token)")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"SamplingParams: top_k={self.top_k!r} must be an int >= 0 (0 keeps every token)")
        if not _is_int(self.n) or self.n < 1:
            raise ValueError(f"SamplingParams: n={self.n!r} samples per prompt must be an int >= 1")
        if self.n > 1 and self.temperature == 0:
            raise ValueError(
                f"SamplingParams: n={self.n} samples per prompt with temperature=0 are all the same greedy sequence; "
                "set temperature > 0 or n=1"
            )
        eos = self.eos_token_id
        if eos is not None:
            ids = (eos,) if _is_int(eos) else eos
            if not isinstance(ids, tuple) or not ids or not all(_is_int(i) and i >= 0 for i in ids):
                raise ValueError(
                    f"SamplingParams: eos_token_id={eos!r} must be a token id >= 0, a non-empty tuple of them, or None"
                )
        if not _is_int(self.pad_token_id) or self.pad_token_id < 0:
            raise ValueError(f"SamplingParams: pad_token_id={self.pad_token_id!r} must be a token id >= 0")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"SamplingParams: seed={self.seed!r} must be an int or None")
        if self.vocab_limit is not None and (not _is_int(self.vocab_limit) or self.vocab_limit < 1):
            raise ValueError(f"SamplingParams: vocab_limit={self.vocab_limit!r} must be an int >= 1 or None")

    @property
    def eos_ids(self) -> tuple[int, ...]:
        """The stop ids as a tuple (empty without ``eos_token_id``)."""
        if self.eos_token_id is None:
            return ()
        return (self.eos_token_id,) if _is_int(self.eos_token_id) else tuple(self.eos_token_id)

    @property
    def greedy(self) -> bool:
        """Whether decoding is greedy (``temperature == 0``)."""
        return self.temperature == 0
