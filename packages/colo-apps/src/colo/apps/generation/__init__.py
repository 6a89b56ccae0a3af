"""colo.apps.generation: the generation engine of `colo generate` and of RLHF rollouts.

- `SamplingParams`: lengths, stop ids, temperature / top-p / top-k, samples per prompt.
- `generate(model, prompts, params)`: batched decoding with a static KV cache for the native Llama and the Hugging
  Face ``LlamaForCausalLM``: left-padded prompts, per-row stop at eos, per-token log-probs of the sampled tokens
  under the policy at the sampling temperature. Returns a `Rollout`.
- `rollout_model_inputs`, `sequence_logprobs`: the training forward over a rollout sees what generation saw, and
  its log-probs equal the rollout's.
- `RolloutEngine(booster, model)`: the hybrid engine: generation from the weights a `Booster` trains, whatever the
  plugin's layout.
- `ServingEngine(model, ...)`: continuous batching over a paged KV cache (`PagedKVCache`) with per-request
  `RequestParams` (temperature / top-p / top-k, max tokens, stop strings and ids, seed), for `colo serve`.
"""

from .engine import generate
from .hybrid import RolloutEngine, RolloutReport
from .paged_cache import PagedKVCache
from .params import SamplingParams
from .rollout import Rollout, rollout_model_inputs, sequence_logprobs, token_logprobs
from .serving import RequestOutput, RequestParams, ServingEngine

__all__ = [
    "PagedKVCache",
    "RequestOutput",
    "RequestParams",
    "Rollout",
    "RolloutEngine",
    "RolloutReport",
    "SamplingParams",
    "ServingEngine",
    "generate",
    "rollout_model_inputs",
    "sequence_logprobs",
    "token_logprobs",
]
