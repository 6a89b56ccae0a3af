"""Each distinct prompt computed once, where a batch repeats it (the ``n`` samples of a prompt, a GRPO group).

- `generate` prefills each prompt once and copies its keys, values and last logits to its ``n`` rows: the rows of a
  ``top_k = 1`` ``n = 3`` batch equal the ``n = 1`` batch's (tokens exactly, log-probs within 1e-5), for colo's
  Llama and the Hugging Face Llama, and the prefill forward sees 3 prompt rows, not 9 (counted at the
  embedding).
- The rollout forward (`attach_rollout_forward`, ``share_prompts=True``) of colo's Llama and of the Hugging Face
  Llama runs the distinct prompts with a cache and the responses over it: its log-probs and entropies equal the full
  forward's (``share_prompts=False``) within 1e-5 and the gradients of a loss over both within rtol 1e-5 (fp32), on
  left-padded prompts of three lengths and responses of several lengths; the embedding sees ``3 P + 9 (T - 1)``
  tokens, not ``9 (P + T)``. Rows that share no prompt with a neighbour, and one-token responses, take the other
  paths and agree too; a model with hooks or activation checkpointing is not given the shared path.
- With a ``vocab_limit`` (a tokenizer smaller than the model's vocabulary) the rollout forward, shared or full, and
  generation take log-probs under the same policy, the softmax over the ids below it.
"""

from __future__ import annotations

import pytest
import torch

from colo.apps.generation import SamplingParams, generate, rollout_model_inputs
from colo.apps.generation.rollout import Rollout, shared_prompt_rows

SEED = 1234
PROMPTS = [[5, 17, 99, 3, 42, 8, 61], [77, 12], [30, 31, 32, 33]]
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


def _native():
    from colo.apps.models.llama import Llama, get_preset

    model = Llama(get_preset("tiny", initializer_range=0.1))
    model.init_weights(SEED)
    return model.eval()


def _hf():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.1, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(SEED)
    return transformers.LlamaForCausalLM(config).eval()


def _embedding(model) -> torch.nn.Module:
    return model.model.embed_tokens if hasattr(model, "model") else model.embed_tokens


class _Counted:
    """Records the id shapes the embedding sees (by wrapping its forward: a forward hook would itself turn the
    shared-prompt forward off, `can_share_prompts`)."""

    def __init__(self, model) -> None:
        self.embedding, self.shapes = _embedding(model), []
        original = self.embedding.forward

        def forward(ids):
            self.shapes.append(tuple(ids.shape))
            return original(ids)

        self.embedding.forward = forward

    def remove(self) -> None:
        del self.embedding.forward


def _count_rows(model) -> tuple[list[tuple[int, int]], _Counted]:
    counted = _Counted(model)
    return counted.shapes, counted


@pytest.mark.parametrize("kind", ["native", "hf"])
def test_each_prompt_is_prefilled_once_for_its_n_rows(kind):
    model = _native() if kind == "native" else _hf()
    # top_k=1: greedy tokens (n > 1 needs sampling); these models and prompts keep a top-2 logit gap >= 1e-3 at
    # every step (asserted in test_generation_engine.py), so rounding cannot flip a token
    single = generate(model, PROMPTS, SamplingParams(max_new_tokens=6, temperature=1.0, top_k=1, seed=0))
    shapes, handle = _count_rows(model)
    stats: dict = {}
    try:
        params = SamplingParams(max_new_tokens=6, temperature=1.0, top_k=1, n=3, seed=0)
        repeated = generate(model, PROMPTS, params, stats=stats)
    finally:
        handle.remove()
    assert shapes[0] == (3, 7)  # the prefill: each prompt once
    assert all(shape == (9, 1) for shape in shapes[1:]) and len(shapes) == 6  # then one token per row per step
    assert repeated.prompts() == [p for p in PROMPTS for _ in range(3)]
    for row in range(9):
        assert repeated.responses()[row] == single.responses()[row // 3], row
        torch.testing.assert_close(repeated.logprobs[row], single.logprobs[row // 3], **TOLERANCE)
    # the decode cache holds every row: 2 layers x (keys, values) x 9 rows x 12 positions (7 + 6 - 1) x kv heads x dim
    config = model.config
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_kv_heads
    head_dim = config.hidden_size // (getattr(config, "num_attention_heads", None) or config.num_heads)
    assert stats["kv_cache_bytes"] == 2 * 2 * 9 * 12 * kv_heads * head_dim * 4


def _rollout(response: int) -> Rollout:
    """3 prompts x 3 samples, left-padded prompts of lengths 7, 2, 4; responses of several lengths, padded after."""
    generator = torch.Generator().manual_seed(7)
    rows, prompt = 9, 7
    input_ids = torch.zeros(rows, prompt + response, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row in range(rows):
        ids = PROMPTS[row // 3]
        input_ids[row, prompt - len(ids) : prompt] = torch.tensor(ids)
        attention_mask[row, prompt - len(ids) : prompt] = 1
    lengths = torch.tensor([response, 3, 1, response, 2, response, 1, response, 4]).clamp(max=response)
    response_mask = (torch.arange(response)[None, :] < lengths[:, None]).long()
    tokens = torch.randint(3, 128, (rows, response), generator=generator)
    tokens[response_mask == 0] = 0
    input_ids[:, prompt:] = tokens
    attention_mask[:, prompt:] = response_mask
    return Rollout(
        input_ids=input_ids,
        attention_mask=attention_mask,
        response_mask=response_mask,
        logprobs=torch.zeros(rows, response),
        prompt_length=prompt,
        prompt_index=torch.arange(rows) // 3,
        temperature=0.8,
    )


def _forward(share: bool, rollout: Rollout, rows: slice = slice(None), kind: str = "hf"):
    from colo.apps.rlhf import attach_rollout_forward

    model = _hf() if kind == "hf" else _native()
    model = attach_rollout_forward(model.train(), temperature=0.8, share_prompts=share)
    batch = {key: value[rows] for key, value in rollout_model_inputs(rollout, hf=kind == "hf").items()}
    shapes, handle = _count_rows(model)
    try:
        output = model(**batch, response_mask=rollout.response_mask[rows])
    finally:
        handle.remove()
    mask = rollout.response_mask[rows].float()
    ((output["logps"] * mask).sum() + 0.1 * (output["entropy"] * mask).sum()).backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    return output["logps"].detach(), output["entropy"].detach(), grads, shapes


@pytest.mark.parametrize("kind", ["native", "hf"])
@pytest.mark.parametrize("response", [6, 1])
def test_rollout_forward_computes_each_prompt_once_and_equals_the_full_forward(kind, response):
    rollout = _rollout(response)
    assert shared_prompt_rows(rollout.input_ids, rollout.attention_mask, 7).tolist() == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    logps, entropy, grads, shapes = _forward(True, rollout, kind=kind)
    full_logps, full_entropy, full_grads, full_shapes = _forward(False, rollout, kind=kind)
    assert full_shapes == [(9, 7 + response)]
    assert shapes == [(3, 7)] + ([(9, response - 1)] if response > 1 else [])
    torch.testing.assert_close(logps, full_logps, **TOLERANCE)
    torch.testing.assert_close(entropy, full_entropy, **TOLERANCE)
    assert float(logps.abs().sum()) > 1.0
    for name, grad in grads.items():
        expected = full_grads[name]
        torch.testing.assert_close(grad, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()), msg=name)


def test_rows_without_a_shared_neighbour_or_with_hooks_take_the_full_forward():
    rollout = _rollout(6)
    every_third = slice(0, 9, 3)  # one row of each prompt
    assert shared_prompt_rows(rollout.input_ids[every_third], rollout.attention_mask[every_third], 7) is None
    logps, _, _, shapes = _forward(True, rollout, every_third)
    assert shapes == [(3, 13)]
    torch.testing.assert_close(logps, _forward(False, rollout, every_third)[0], **TOLERANCE)
    # hooks (ZeRO-3's gatherer, parallel plans) or activation checkpointing: the full forward
    from colo.apps.generation.rollout import can_share_prompts

    for model in (_native(), _hf()):
        assert can_share_prompts(model)
        handle = model.register_forward_pre_hook(lambda *_: None)
        assert not can_share_prompts(model)
        handle.remove()
    model = _hf()
    model.gradient_checkpointing_enable()
    assert not can_share_prompts(model)
    # the same ids under another padding mask are different prompts
    ids = torch.tensor([[0, 5, 6, 1], [0, 5, 6, 1]])
    assert shared_prompt_rows(ids, torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]]), 3) is None


@pytest.mark.parametrize("kind", ["native", "hf"])
def test_rollout_forward_with_a_vocab_limit_recomputes_the_rollouts_log_probs(kind):
    """A tokenizer of 100 ids under a 128-id vocabulary: generation samples only ids below 100 and reports their
    log-probs under the softmax over them; the rollout forward given the same ``vocab_limit`` recomputes them (shared
    prompts or not) within 1e-5 (the cached decode sums in other orders, ~1e-6), while over the whole vocabulary it
    reads each token lower by the padded ids' mass (here more than 1e-2)."""
    from colo.apps.rlhf import attach_rollout_forward

    limit, model = 100, _hf() if kind == "hf" else _native()
    params = SamplingParams(max_new_tokens=5, temperature=0.8, top_p=0.9, n=3, seed=SEED, vocab_limit=limit)
    rollout = generate(model, PROMPTS, params)
    assert int(rollout.input_ids[:, rollout.prompt_length :].max()) < limit
    batch = {**rollout_model_inputs(rollout, hf=kind == "hf"), "response_mask": rollout.response_mask}
    mask = rollout.response_mask.bool()
    with torch.no_grad():
        for share in (True, False):
            limited = attach_rollout_forward(model, temperature=0.8, share_prompts=share, vocab_limit=limit)
            logps = limited(**batch)["logps"]
            torch.testing.assert_close(logps[mask], rollout.logprobs[mask], **TOLERANCE)
            del model.forward, model._colo_rollout_forward  # the class's forward again, for the next attach
        whole = attach_rollout_forward(model, temperature=0.8)(**batch)["logps"]
    assert float((rollout.logprobs - whole)[mask].min()) > 1e-2
