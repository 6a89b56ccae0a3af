"""`colo.apps.generation.generate`: batched static-cache decoding gives what one-prompt-at-a-time full forwards give.

- Greedy tokens of a left-padded batch equal a no-cache reference that runs every prompt alone, unpadded, with a
  full forward per step (and Hugging Face ``generate`` for the HF Llama), on fixtures whose top-2 logit gap is at
  least 1e-3 at every step (asserted, so a tie broken by rounding cannot make the test pass or fail by luck).
- Log-probs of sampled rollouts (temperature, top-k, top-p, n samples) equal both the training forward over the
  rollout (`rollout_model_inputs` + `sequence_logprobs`) and the single-process reference (each row alone,
  unpadded) within 1e-5 in fp32: not zero, because the cached decode multiplies matrices of other shapes and the
  padded batch attends over other key ranges, so sums run in other orders (observed: about 1e-6).
- A row stops at its eos (the eos kept, padding after it), the others go on; n samples per prompt are contiguous;
  bad settings fail with a message naming the field.
"""

from __future__ import annotations

import pytest
import torch

from colo.apps.generation import Rollout, SamplingParams, generate, rollout_model_inputs, sequence_logprobs
from colo.apps.generation.sampling import filter_logits, next_tokens
from colo.apps.models.llama import Llama, get_preset

SEED = 1234
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}
MIN_GAP = 1e-3
PROMPTS = [[5, 17, 99, 3, 42, 8, 61], [77, 12], [30, 31, 32, 33]]


def _native(**overrides) -> Llama:
    """The "tiny" Llama (grouped-query attention, 2 layers) in fp32 with std-0.1 weights so logits are not flat."""
    config = get_preset("tiny", initializer_range=0.1, **overrides)
    model = Llama(config)
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


def _logits(model, ids: list[int]) -> torch.Tensor:
    """fp32 logits of one unpadded sequence, full forward, no cache: ``(len(ids), vocab)``."""
    with torch.no_grad():
        out = model(torch.tensor([ids]))
    return out.logits[0].float()


def _reference_greedy(model, prompt: list[int], steps: int) -> tuple[list[int], list[float]]:
    """Greedy decoding of one prompt alone with a full forward per step; asserts the top-2 gap at every step."""
    ids, logprobs = list(prompt), []
    for step in range(steps):
        logits = _logits(model, ids)[-1]
        top2 = logits.topk(2).values
        assert top2[0] - top2[1] >= MIN_GAP, f"fixture too close to a tie at step {step}: gap {top2[0] - top2[1]}"
        token = int(logits.argmax())
        logprobs.append(float(torch.log_softmax(logits, -1)[token]))
        ids.append(token)
    return ids[len(prompt) :], logprobs


def _reference_logprobs(model, rollout: Rollout) -> torch.Tensor:
    """Each row alone, unpadded (its real prompt then its response), one full forward: ``(R, T)`` log-probs."""
    temperature = rollout.temperature or 1.0
    out = torch.zeros_like(rollout.logprobs)
    for row, (prompt, response) in enumerate(zip(rollout.prompts(), rollout.responses(), strict=True)):
        logits = _logits(model, prompt + response)[len(prompt) - 1 : -1] / temperature
        out[row, : len(response)] = torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None])[:, 0]
    return out


def _training_logprobs(model, rollout: Rollout) -> torch.Tensor:
    with torch.no_grad():
        inputs = rollout_model_inputs(rollout, model=model)
        logits = model(**inputs).logits
    return sequence_logprobs(logits, rollout)


@pytest.mark.parametrize("kind", ["native", "hf"])
def test_greedy_batch_equals_unpadded_no_cache_reference(kind):
    model = _native() if kind == "native" else _hf()
    steps = 10
    rollout = generate(model, PROMPTS, SamplingParams(max_new_tokens=steps, temperature=0, pad_token_id=0))
    assert rollout.input_ids.shape == (3, 7 + steps) and rollout.prompt_length == 7
    for row, prompt in enumerate(PROMPTS):
        tokens, logprobs = _reference_greedy(model, prompt, steps)
        assert rollout.responses()[row] == tokens
        torch.testing.assert_close(rollout.logprobs[row], torch.tensor(logprobs), **TOLERANCE)
    torch.testing.assert_close(_training_logprobs(model, rollout), rollout.logprobs, **TOLERANCE)
    if kind == "hf":  # and what transformers' own generate does with the same left-padded batch
        prompt_part = slice(0, rollout.prompt_length)
        expected = model.generate(
            input_ids=rollout.input_ids[:, prompt_part], attention_mask=rollout.attention_mask[:, prompt_part],
            max_new_tokens=steps, do_sample=False, pad_token_id=0,
        )  # fmt: skip
        assert torch.equal(expected, rollout.input_ids)


@pytest.mark.parametrize("kind", ["native", "hf"])
def test_sampled_logprobs_equal_training_forward_and_single_process_reference(kind):
    model = _native() if kind == "native" else _hf()
    params = SamplingParams(max_new_tokens=9, temperature=0.7, top_p=0.9, top_k=40, n=3, seed=5, eos_token_id=(7, 9))
    rollout = generate(model, PROMPTS, params)
    assert rollout.input_ids.shape[0] == 9 and rollout.logprobs.dtype == torch.float32
    assert bool((rollout.logprobs < 0).any()) and bool((rollout.logprobs[rollout.response_mask == 0] == 0).all())
    torch.testing.assert_close(_training_logprobs(model, rollout), rollout.logprobs, **TOLERANCE)
    torch.testing.assert_close(_reference_logprobs(model, rollout), rollout.logprobs, **TOLERANCE)


def test_left_padding_does_not_change_a_continuation():
    model = _native()
    params = SamplingParams(max_new_tokens=8, temperature=0, pad_token_id=0)
    alone = generate(model, [PROMPTS[1]], params)
    batched = generate(model, [PROMPTS[0], PROMPTS[1]], params)  # the short prompt gets 5 tokens of left padding
    assert batched.input_ids[1, :5].tolist() == [0] * 5 and batched.attention_mask[1, :5].sum() == 0
    assert batched.responses()[1] == alone.responses()[0]
    torch.testing.assert_close(batched.logprobs[1], alone.logprobs[0], **TOLERANCE)


def test_each_row_stops_at_its_eos_and_the_rest_go_on():
    model = _native()
    free = generate(model, PROMPTS, SamplingParams(max_new_tokens=10, temperature=0, pad_token_id=0)).responses()
    eos = free[0][3]  # row 0 produces it at step 3; on this fixture row 2 at step 2 and row 1 never
    stops = [row.index(eos) + 1 if eos in row else None for row in free]
    assert stops == [4, None, 3]
    params = SamplingParams(max_new_tokens=10, temperature=0, pad_token_id=0, eos_token_id=eos)
    stopped = generate(model, PROMPTS, params)
    assert stopped.response_length == 10
    for row, stop in enumerate(stops):
        length = stop or 10
        assert stopped.responses()[row] == free[row][:length]  # the eos included
        assert stopped.response_mask[row].tolist() == [1] * length + [0] * (10 - length)
        assert stopped.response_ids[row, length:].eq(0).all()  # padding after the eos
    assert stopped.attention_mask[:, stopped.prompt_length :].equal(stopped.response_mask)


def test_all_rows_stopping_ends_the_loop_early():
    model = _native()
    free = generate(model, [PROMPTS[0]], SamplingParams(max_new_tokens=10, temperature=0))
    eos = free.responses()[0][2]
    stopped = generate(model, [PROMPTS[0]], SamplingParams(max_new_tokens=10, temperature=0, eos_token_id=eos))
    assert stopped.response_length == free.responses()[0].index(eos) + 1  # columns cut to the steps run


def test_checking_for_finished_rows_every_few_steps_gives_the_same_rollout(monkeypatch):
    """The decode loop reads `done` (a host-device sync) every FINISHED_CHECK_EVERY steps: the steps it decodes after
    every row finished are dropped, so the rollout equals checking after every token."""
    from colo.apps.generation import engine

    model = _native()
    free = generate(model, PROMPTS, SamplingParams(max_new_tokens=12, temperature=0, pad_token_id=0)).responses()
    eos = (free[0][2], free[1][4], free[2][1])  # every row finishes within 5 steps, at different steps
    params = SamplingParams(max_new_tokens=12, temperature=0, pad_token_id=0, eos_token_id=eos)
    rollouts = {}
    for every in (1, 7):  # 7: past every row's finish, so steps after it are decoded and dropped
        monkeypatch.setattr(engine, "FINISHED_CHECK_EVERY", every)
        rollouts[every] = generate(model, PROMPTS, params)
    assert rollouts[1].response_length < 12  # every row stopped early: the loop ended before max_new_tokens
    for field in ("input_ids", "attention_mask", "response_mask", "logprobs"):
        assert torch.equal(getattr(rollouts[1], field), getattr(rollouts[7], field)), field


def test_n_samples_per_prompt_are_contiguous_and_seeded():
    model = _native()
    params = SamplingParams(max_new_tokens=6, temperature=1.0, n=4, seed=3)
    first, again = generate(model, PROMPTS, params), generate(model, PROMPTS, params)
    assert first.prompt_index.tolist() == [0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2]
    assert first.prompts() == [p for p in PROMPTS for _ in range(4)]
    assert torch.equal(first.input_ids, again.input_ids)  # same seed, same samples
    assert len({tuple(r) for r in first.responses()[:4]}) > 1  # the samples of one prompt differ
    other = generate(model, PROMPTS, params, generator=torch.Generator().manual_seed(4))
    assert not torch.equal(first.input_ids, other.input_ids)


def test_top_k_one_is_greedy_with_log_probs_before_the_filter():
    model = _native()
    greedy = generate(model, PROMPTS, SamplingParams(max_new_tokens=6, temperature=0))
    top1 = generate(model, PROMPTS, SamplingParams(max_new_tokens=6, temperature=1.0, top_k=1, seed=0))
    assert top1.responses() == greedy.responses()
    torch.testing.assert_close(top1.logprobs, greedy.logprobs, **TOLERANCE)  # not 0: the unfiltered policy's
    assert bool((top1.logprobs < -1e-3).all())


def test_filters_keep_the_top_k_and_the_nucleus():
    logits = torch.log(torch.tensor([[0.5, 0.05, 0.3, 0.15]]))
    kept = lambda **kw: torch.isfinite(filter_logits(logits, SamplingParams(max_new_tokens=1, **kw)))[0].tolist()  # noqa: E731
    assert kept(top_k=2) == [True, False, True, False]
    assert kept(top_p=0.8) == [True, False, True, False]  # 0.5 + 0.3 reaches 0.8
    assert kept(top_p=0.81) == [True, False, True, True]
    assert kept(top_p=0.1) == [True, False, False, False]  # never empty
    assert kept(top_k=3, top_p=0.9, vocab_limit=3) == [True, False, True, False]  # nucleus of the renormalized 3
    assert kept(top_k=3, top_p=0.95, vocab_limit=3) == [True, True, True, False]


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_log_probs_are_over_the_ids_below_the_vocab_limit(temperature):
    """With a padded vocabulary the policy is the softmax over the tokenizer's ids (those below ``vocab_limit``, the
    only ones sampled): the reported log-prob is ``log_softmax(logits[:, :limit] / T)`` of the chosen id (greedy: T
    taken as 1), before top-k / top-p. The padded columns here hold real mass, so counting them lowers every log-prob
    by more than 1e-2 (asserted), far past the 1e-6 tolerance (fp32 rounding of two equal computations)."""
    generator = torch.Generator().manual_seed(SEED)
    limit = 40
    logits = torch.randn(16, 64, generator=generator) * 2
    logits[:, limit:] += 1.5  # the padding columns a tokenizer never emits, made likely under the whole softmax
    params = SamplingParams(max_new_tokens=1, temperature=temperature, top_k=20, top_p=0.9, vocab_limit=limit)
    tokens, logprobs = next_tokens(logits, params, torch.Generator().manual_seed(0))
    assert bool((tokens < limit).all())
    scale = temperature or 1.0
    policy = torch.log_softmax(logits[:, :limit] / scale, dim=-1).gather(-1, tokens[:, None])[:, 0]
    whole = torch.log_softmax(logits / scale, dim=-1).gather(-1, tokens[:, None])[:, 0]
    torch.testing.assert_close(logprobs, policy, rtol=1e-6, atol=1e-6)
    assert float((logprobs - whole).min()) > 1e-2  # the padded columns' mass no longer counts
    if temperature == 0:
        assert torch.equal(tokens, logits[:, :limit].argmax(dim=-1))
    free, free_logprobs = next_tokens(logits, SamplingParams(max_new_tokens=1, temperature=temperature), generator)
    whole_free = torch.log_softmax(logits / scale, dim=-1).gather(-1, free[:, None])[:, 0]
    torch.testing.assert_close(free_logprobs, whole_free, rtol=1e-6, atol=1e-6)  # no limit: the whole row


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"max_new_tokens": 0}, "max_new_tokens=0 must be an int >= 1"),
        ({"temperature": -1.0}, "temperature=-1.0"),
        ({"top_p": 0.0}, r"top_p=0.0 must be in \(0, 1\]"),
        ({"top_k": -2}, "top_k=-2"),
        ({"n": 0}, "n=0 samples per prompt"),
        ({"n": 2, "temperature": 0}, "set temperature > 0 or n=1"),
        ({"eos_token_id": ()}, "eos_token_id=()"),
        ({"pad_token_id": -1}, "pad_token_id=-1"),
    ],
)
def test_bad_sampling_params_name_the_field(settings, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**{"max_new_tokens": 4, **settings})


@pytest.mark.parametrize(
    ("prompts", "params", "message"),
    [
        ([], {}, "non-empty list of token-id lists"),
        ([[1, 2], []], {}, r"prompts\[1\] is empty"),
        ([[1, 200]], {}, r"id 200 outside the model's vocabulary \[0, 128\)"),
        ([[1] * 100], {"max_new_tokens": 40}, "plus max_new_tokens=40 exceeds the model's max_position_embeddings=128"),
        ([[1, 2]], {"eos_token_id": 500}, "must be ids in the model's vocabulary"),
    ],
)
def test_bad_prompts_fail_before_any_forward(prompts, params, message):
    with pytest.raises(ValueError, match=message):
        generate(_native(), prompts, SamplingParams(**{"max_new_tokens": 4, **params}))
