"""colo.apps.generation: the decoding of `colo generate`, of the trainer's samples and of RLHF rollouts.

- `SamplingParams`: lengths, stop ids, temperature / top-p / top-k, samples per prompt.
- `generate(model, prompts, params)`: batched decoding with a static KV cache for the native Llama and the Hugging
  Face ``LlamaForCausalLM``: left-padded prompts, per-row stop at eos, per-token log-probs of the sampled tokens
  under the policy at the sampling temperature. Returns a `Rollout`.
- `continue_prompt(model, prompt_ids, max_new_tokens=...)`: one prompt's new token ids, the context window sliding
  past ``max_position_embeddings`` (`generate` while it fits; ``use_cache=False``: the uncached reference);
  `complete(model, tokenizer, prompt)`: the same as text, through an SFT run's chat template when given.
- `rollout_model_inputs`, `sequence_logprobs`: the training forward over a rollout sees what generation saw, and
  its log-probs equal the rollout's.
- `RolloutEngine(booster, model)`: the hybrid engine: generation from the weights a `Booster` trains, whatever the
  plugin's layout.
- `PagedKVCache`: the block-paged KV cache of `colo serve`'s continuous-batching engine
  (`colo.apps.serving.ServingEngine`).
"""

from .continuation import complete, continue_prompt
from .engine import generate
from .hybrid import RolloutEngine, RolloutReport
from .paged_cache import PagedKVCache
from .params import SamplingParams
from .rollout import Rollout, rollout_model_inputs, sequence_logprobs, token_logprobs

__all__ = [
    "PagedKVCache",
    "Rollout",
    "RolloutEngine",
    "RolloutReport",
    "SamplingParams",
    "complete",
    "continue_prompt",
    "generate",
    "rollout_model_inputs",
    "sequence_logprobs",
    "token_logprobs",
]
