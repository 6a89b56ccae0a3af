"""Prefix caching and chunked prefill in `ServingEngine` skip or split work, never change a token.

- A request whose prompt starts with two full blocks another request computed shares those blocks (counted by the
  cache and the engine, reported as ``cached_prompt_tokens``), feeds only its other tokens, and gets the greedy
  tokens of an engine without prefix caching; so does a request admitted in the same step as the one computing
  them, and a prompt of exactly two blocks (it recomputes its last block: the last token always is computed).
- A cache of few blocks serving many prompts, distinct and repeated: after every step each held block's reference
  count equals the number of block tables holding it and held plus free blocks add up to the budget (so nothing
  leaks and no block in use was evicted and handed out again), cached blocks are evicted, the tokens equal a run
  without caching, and every reference count is back to zero at the end.
- Chunked prefill (``max_tokens_per_step``) gives the greedy tokens of unchunked prefill, feeds at most the budget
  per step, and a running request gets a token at every step of another's long prefill.

Greedy references come from single-request `generate` on fp32 fixtures whose top-2 logit gap is at least 1e-3 at
every step, so the few-ulp differences of computing a prompt in pieces (another summation order in attention)
cannot flip a token.
"""

from __future__ import annotations

import pytest
import torch

from colo.apps.generation import SamplingParams, generate
from colo.apps.models.llama import Llama, get_preset
from colo.apps.serving import RequestParams, ServingEngine

SEED = 1234
MIN_GAP = 1e-3
GREEDY = RequestParams(max_tokens=6, temperature=0)
SYSTEM = [5, 17, 99, 3, 42, 8, 61, 23]  # two blocks of 4
OTHER = [88, 14, 120, 6, 33, 70, 2, 95]


def _native() -> Llama:
    """The "tiny" Llama (grouped-query attention, 2 layers) in fp32 with std-0.1 weights so logits are not flat."""
    model = Llama(get_preset("tiny", initializer_range=0.1))
    model.init_weights(SEED)
    return model.eval()


def _single_greedy(model, prompt: list[int], steps: int) -> list[int]:
    """Single-request greedy `generate`, with the fixture's top-2 gap asserted on a full forward per step."""
    tokens = generate(model, [prompt], SamplingParams(max_new_tokens=steps, temperature=0)).responses()[0]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1 :].float()
    top2 = logits.topk(2, dim=-1).values
    gap = float((top2[:, 0] - top2[:, 1]).min())
    assert gap >= MIN_GAP, f"fixture too close to a tie for prompt {prompt}: gap {gap}"
    return tokens


def _check_block_accounting(engine: ServingEngine) -> None:
    """Each held block's reference count is the number of tables holding it; held + free = the budget."""
    cache = engine.cache
    holders: dict[int, int] = {}
    for table in cache.block_tables.values():
        for block in table:
            holders[block] = holders.get(block, 0) + 1
    assert all(cache.ref_count(block) == count for block, count in holders.items()), "a shared block's count is off"
    assert len(holders) + cache.num_free_blocks == cache.num_blocks, "a block leaked or is both held and free"


def _drain(engine: ServingEngine, tokens: dict[str, list[int]], *, check: bool = False) -> dict[str, object]:
    finished = {}
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                finished[out.request_id] = out
        if check:
            _check_block_accounting(engine)
    return finished


def test_a_shared_two_block_prefix_is_reused_and_gives_the_uncached_tokens():
    model = _native()
    prompts = {
        "first": SYSTEM + [77, 12],
        "second": SYSTEM + [30, 31, 32],  # after "first" ran: its two blocks are cached
        "third": SYSTEM + [64],  # with "fourth", admitted in one step: shares the blocks "second" left
        "fourth": SYSTEM + [9, 8, 7, 6, 5],
        "exact": SYSTEM,  # two blocks exactly: shares the first, recomputes the block of its last token
        "group0": OTHER + [1, 2],  # a new prefix, two requests admitted in one step (a GRPO group's prompt):
        "group1": OTHER + [3],  # the second reads the blocks the first writes in the same forward
    }
    expected = {request_id: _single_greedy(model, prompt, GREEDY.max_tokens) for request_id, prompt in prompts.items()}
    uncached = ServingEngine(model, max_batch_size=4, block_size=4, num_blocks=32, enable_prefix_caching=False)
    assert uncached.generate(list(prompts.values()), GREEDY) == list(expected.values())
    assert uncached.cache.num_prefix_hit_blocks == 0

    engine = ServingEngine(model, max_batch_size=4, block_size=4, num_blocks=32)
    tokens: dict[str, list[int]] = {}
    engine.add_request("first", prompts["first"], GREEDY)
    finished = _drain(engine, tokens)
    assert finished["first"].cached_prompt_tokens == 0 and engine.num_prefill_tokens == len(prompts["first"])
    engine.add_request("second", prompts["second"], GREEDY)
    finished.update(_drain(engine, tokens))
    assert finished["second"].cached_prompt_tokens == 8 and engine.cache.num_prefix_hit_blocks == 2
    assert engine.num_prefill_tokens == len(prompts["first"]) + 3  # only the suffix was fed
    engine.add_request("third", prompts["third"], GREEDY)
    engine.add_request("fourth", prompts["fourth"], GREEDY)
    engine.add_request("exact", prompts["exact"], GREEDY)
    finished.update(_drain(engine, tokens, check=True))
    assert [finished[r].cached_prompt_tokens for r in ("third", "fourth", "exact")] == [8, 8, 4]
    engine.add_request("group0", prompts["group0"], GREEDY)
    engine.add_request("group1", prompts["group1"], GREEDY)
    finished.update(_drain(engine, tokens, check=True))
    assert [finished[r].cached_prompt_tokens for r in ("group0", "group1")] == [0, 8]
    assert engine.cache.num_prefix_hit_blocks == 2 + 2 + 2 + 1 + 2
    assert engine.num_prefix_cached_tokens == 8 + 8 + 8 + 4 + 8
    assert tokens == expected
    assert engine.cache.num_free_blocks == 32 and not engine.cache.block_tables
    assert all(engine.cache.ref_count(block) == 0 for block in range(32))
    assert engine.cache.num_cached_blocks > 0  # kept for later requests, evictable
    engine.cache.reset_prefix_cache()
    assert engine.cache.num_cached_blocks == 0 and engine.cache.num_free_blocks == 32


def test_a_small_cache_serving_many_prompts_never_leaks_nor_evicts_a_held_block():
    model = _native()
    distinct = [[3 + i, 40 + 2 * i, 7, 90 - i, 11 + i] for i in range(8)]
    prompts = [SYSTEM + [1], *distinct[:4], SYSTEM + [2, 3], *distinct[4:], SYSTEM + [4], distinct[0]]
    params = RequestParams(max_tokens=5, temperature=0)
    uncached = ServingEngine(model, max_batch_size=3, block_size=2, num_blocks=12, enable_prefix_caching=False)
    expected = uncached.generate(prompts, params)

    engine = ServingEngine(model, max_batch_size=3, block_size=2, num_blocks=12)  # 3 running requests fill it
    tokens: dict[str, list[int]] = {}
    for index, prompt in enumerate(prompts):
        engine.add_request(f"p{index}", prompt, params)
        if index % 2:  # two requests join, then one step runs
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            _check_block_accounting(engine)
    _drain(engine, tokens, check=True)
    assert [tokens[f"p{index}"] for index in range(len(prompts))] == expected
    assert engine.cache.num_evicted_blocks > 0 and engine.cache.num_prefix_hit_blocks > 0
    assert not engine.cache.block_tables and engine.cache.num_free_blocks == 12
    assert all(engine.cache.ref_count(block) == 0 for block in range(12))


def test_chunked_prefill_equals_unchunked_and_running_requests_keep_decoding():
    model = _native()
    long_prompt = [(7 * i + 3) % 128 for i in range(37)]
    short = [77, 12]
    expected = {"short": _single_greedy(model, short, 12), "long": _single_greedy(model, long_prompt, 4)}
    budget = 4
    engine = ServingEngine(model, max_batch_size=4, block_size=4, num_blocks=40, max_tokens_per_step=budget)
    engine.add_request("short", short, RequestParams(max_tokens=12, temperature=0))
    tokens: dict[str, list[int]] = {"short": [], "long": []}
    steps_prefilling = 0
    for step in range(40):
        if step == 2:
            engine.add_request("long", long_prompt, RequestParams(max_tokens=4, temperature=0))
        fed_before = engine.num_prefill_tokens + engine.num_decode_tokens
        outputs = {out.request_id: out for out in engine.step()}
        assert engine.num_prefill_tokens + engine.num_decode_tokens - fed_before <= budget  # the step's forwards
        for request_id, out in outputs.items():
            tokens[request_id] += out.new_token_ids
        if step >= 2 and not tokens["long"]:  # the long prompt is still being prefilled
            steps_prefilling += 1
            if len(tokens["short"]) < 12:
                assert outputs["short"].new_token_ids, f"step {step}: the running request did not decode"
        if not engine.has_unfinished():
            break
    assert tokens == expected
    assert steps_prefilling >= 37 // budget  # the prompt took many steps, and decode went on in every one
    with pytest.raises(ValueError, match="max_tokens_per_step=2 must be an int >= max_batch_size=4"):
        ServingEngine(model, max_batch_size=4, max_tokens_per_step=2)
