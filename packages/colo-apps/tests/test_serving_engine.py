"""`ServingEngine`: continuous batching over a paged KV cache gives every request what it gets alone.

- Greedy tokens of requests of mixed prompt lengths joining the running batch at different steps equal
  single-request greedy `generate` (the static-cache engine, one prompt per call) for each request, on fp32
  fixtures whose top-2 logit gap is at least 1e-3 at every step (asserted against a full forward per step, so a
  tie broken by rounding cannot decide the test); the same with a KV budget so small that requests are preempted
  and recomputed, and with a Hugging Face Llama (converted to the native one).
- The paged attention's logits for rows of different cached lengths equal a full forward over each row alone
  within 1e-5 (fp32; not zero: the gathered context and SDPA sum in another order than the full forward).
- Seeded sampling is reproducible per request whatever else is in the batch; top_k=1 is greedy; stop at eos,
  stop ids, stop strings (a char-level tokenizer), max_tokens; abort; errors name the limit; a second thread
  adding requests while another steps.
- Tensor parallel: tp2 gives tp1's tokens (greedy and seeded), in a 2-rank test.
"""

from __future__ import annotations

import threading

import pytest
import torch

from colo.apps.generation import PagedKVCache, SamplingParams, generate
from colo.apps.models.llama import Llama, get_preset
from colo.apps.serving import RequestParams, ServingEngine
from colo.comm.testing import run_distributed

SEED = 1234
MIN_GAP = 1e-3
PROMPTS = [[5, 17, 99, 3, 42, 8, 61], [77, 12], [30, 31, 32, 33], list(range(3, 60, 3)), [64], [9, 8, 7, 6, 5, 4]]
GREEDY = RequestParams(max_tokens=10, temperature=0)


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


def _run_staged(engine: ServingEngine, schedule: dict[int, list[tuple[str, list[int], RequestParams]]]):
    """Add ``schedule[s]``'s requests before step ``s``; step until all finish. Returns tokens and finish reasons
    by request id, checking every output's running count."""
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, str] = {}
    step = 0
    while step <= max(schedule) or engine.has_unfinished():
        for request_id, prompt, params in schedule.get(step, []):
            engine.add_request(request_id, prompt, params)
            tokens[request_id] = []
        for out in engine.step():
            assert out.request_id not in reasons, f"{out.request_id} reported after it finished"
            tokens[out.request_id] += out.new_token_ids
            assert out.completion_tokens == len(tokens[out.request_id])
            if out.finished:
                reasons[out.request_id] = out.finish_reason
        step += 1
        assert step < 500, "the engine does not finish"
    return tokens, reasons


def _staggered(prompts, params=GREEDY) -> dict[int, list]:
    """Requests joining at steps 0, 0, 2, 3, 5, 6, ...: some while others decode, some after others left."""
    joins = [0, 0, 2, 3, 5, 6, 6, 9]
    schedule: dict[int, list] = {}
    for index, prompt in enumerate(prompts):
        schedule.setdefault(joins[index], []).append((f"r{index}", prompt, params))
    return schedule


@pytest.mark.parametrize("packed", [False, True], ids=["padded", "packed"])
def test_paged_attention_logits_equal_each_row_alone(packed):
    """Rows of different lengths prefilled together, right-padded or packed into one row of real tokens (the
    projections see no padding), then decoded together: every row's hidden states and logits equal the row alone."""
    model = _native()
    cache = PagedKVCache.for_model(model, num_blocks=12, block_size=4)
    rows = {"a": [5, 17, 99, 3, 42, 8, 61], "b": [77, 12], "c": [30, 31, 32, 33, 34]}
    with torch.no_grad():
        for seq_id, tokens in rows.items():  # prefill all but the last token, each row its own length
            assert cache.allocate(seq_id, len(tokens) - 1)
        if packed:
            ids = torch.tensor([sum((tokens[:-1] for tokens in rows.values()), [])])
        else:
            ids = torch.zeros(3, 6, dtype=torch.long)
            for row, tokens in enumerate(rows.values()):
                ids[row, : len(tokens) - 1] = torch.tensor(tokens[:-1])
        batch = cache.batch(list(rows), [0, 0, 0], [len(t) - 1 for t in rows.values()], packed=packed)
        prefill = model.hidden_states(ids, batch.position_ids, kv_cache=batch)
        offset = 0
        for row, tokens in enumerate(rows.values()):
            alone = model.hidden_states(torch.tensor([tokens[:-1]]))[0]
            got = prefill[0, offset : offset + len(alone)] if packed else prefill[row, : len(alone)]
            torch.testing.assert_close(got, alone, rtol=1e-5, atol=1e-5)
            offset += len(alone)
        for seq_id, tokens in rows.items():  # then one decode step for every row together
            assert cache.allocate(seq_id, len(tokens))
        batch = cache.batch(list(rows), [len(t) - 1 for t in rows.values()], [1, 1, 1])
        last = torch.tensor([[t[-1]] for t in rows.values()])
        hidden = model.hidden_states(last, batch.position_ids, kv_cache=batch)
        _, logits = model.objective(hidden, model.lm_head)
        for row, tokens in enumerate(rows.values()):
            expected = model(torch.tensor([tokens])).logits[0, -1]
            torch.testing.assert_close(logits[row, -1], expected, rtol=1e-5, atol=1e-5)
    assert cache.num_free_blocks == 12 - 2 - 1 - 2
    for seq_id in rows:
        cache.free(seq_id)
    assert cache.num_free_blocks == 12
    assert not cache.allocate("huge", 13 * 4) and cache.num_free_blocks == 12  # all or nothing


def test_continuous_batching_equals_single_request_greedy():
    model = _native()
    expected = {f"r{i}": _single_greedy(model, prompt, GREEDY.max_tokens) for i, prompt in enumerate(PROMPTS)}
    engine = ServingEngine(model, max_batch_size=4, block_size=4, num_blocks=40)
    tokens, reasons = _run_staged(engine, _staggered(PROMPTS))
    assert tokens == expected
    assert set(reasons.values()) == {"length"}
    assert engine.num_preemptions == 0 and engine.cache.num_free_blocks == 40


def test_tiny_kv_budget_preempts_and_recomputes_to_the_same_tokens():
    model = _native()
    expected = {f"r{i}": _single_greedy(model, prompt, GREEDY.max_tokens) for i, prompt in enumerate(PROMPTS)}
    engine = ServingEngine(model, max_batch_size=6, block_size=2, num_blocks=15)  # the longest request needs 14
    tokens, _ = _run_staged(engine, _staggered(PROMPTS))
    assert tokens == expected
    assert engine.num_preemptions > 0
    assert engine.cache.num_free_blocks == 15 and not engine.cache.block_tables


def test_hf_llama_is_served_through_the_native_model():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, initializer_range=0.1, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(SEED)
    hf = transformers.LlamaForCausalLM(config).eval()
    prompts = PROMPTS[:3]
    expected = [_single_greedy(hf, prompt, 6) for prompt in prompts]
    engine = ServingEngine(hf, max_batch_size=2, block_size=4)
    assert engine.generate(prompts, RequestParams(max_tokens=6, temperature=0)) == expected


def test_seeded_sampling_is_reproducible_per_request_whatever_the_batch():
    model = _native()
    sampled = RequestParams(max_tokens=12, temperature=1.0, top_p=0.9, top_k=50, seed=7)
    alone = ServingEngine(model, max_batch_size=4, block_size=4).generate([PROMPTS[0]], sampled)[0]
    engine = ServingEngine(model, max_batch_size=4, block_size=2, num_blocks=16)  # crowded: preemptions too
    noisy = RequestParams(max_tokens=12, temperature=1.3, seed=None)
    schedule = {
        0: [("other0", PROMPTS[3], noisy), ("other1", PROMPTS[1], noisy)],
        2: [("seeded", PROMPTS[0], sampled), ("other2", PROMPTS[2], RequestParams(max_tokens=12, seed=99))],
    }
    tokens, _ = _run_staged(engine, schedule)
    assert tokens["seeded"] == alone
    assert engine.num_preemptions > 0
    reseeded = ServingEngine(model).generate([PROMPTS[0]], RequestParams(max_tokens=12, temperature=1.0, seed=8))[0]
    assert reseeded != alone  # another seed, other draws
    top3 = RequestParams(max_tokens=12, temperature=2.0, top_k=3, seed=5)
    drawn = ServingEngine(model).generate([PROMPTS[3]], top3)[0]
    with torch.no_grad():  # every draw is among the 3 most likely tokens of a full forward at its step
        logits = model(torch.tensor([PROMPTS[3] + drawn[:-1]])).logits[0, len(PROMPTS[3]) - 1 :]
    allowed = logits.topk(3, dim=-1).indices
    assert all(token in allowed[step].tolist() for step, token in enumerate(drawn))
    assert any(token != allowed[step, 0] for step, token in enumerate(drawn))  # and not just greedy
    greedy = ServingEngine(model).generate([PROMPTS[0]], RequestParams(max_tokens=12, temperature=0))[0]
    top1 = ServingEngine(model).generate([PROMPTS[0]], RequestParams(max_tokens=12, temperature=0.8, top_k=1))[0]
    assert top1 == greedy


def _char_tokenizer():
    """A char-level fast tokenizer over the model's 128 ids (id ``i`` is one printable character)."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models

    chars = [chr(0x21 + i) for i in range(128)]
    rust = Tokenizer(models.WordLevel({c: i for i, c in enumerate(chars)}, unk_token=chars[0]))
    rust.decoder = decoders.Fuse()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=rust)


def test_stop_conditions_eos_stop_ids_stop_strings_and_length():
    model = _native()
    prompt = PROMPTS[0]
    reference = _single_greedy(model, prompt, 10)
    tokenizer = _char_tokenizer()
    text = tokenizer.decode(reference)
    assert text == "".join(chr(0x21 + t) for t in reference)

    eos = reference[3]
    first_eos = reference.index(eos)
    engine = ServingEngine(model, tokenizer=tokenizer, eos_token_id=eos)
    stop = text[4:6]
    end = text.find(stop) + len(stop)  # char-level: the tokens up to the one completing the stop string
    schedule = [
        ("eos", prompt, GREEDY),
        ("ignore", prompt, RequestParams(max_tokens=10, temperature=0, ignore_eos=True)),
        ("ids", prompt, RequestParams(max_tokens=10, temperature=0, stop_token_ids=(reference[5],), ignore_eos=True)),
        ("text", prompt, RequestParams(max_tokens=10, temperature=0, stop=("never", stop), ignore_eos=True)),
        ("short", prompt, RequestParams(max_tokens=2, temperature=0, ignore_eos=True)),
    ]
    outputs, tokens = {}, {}
    for request_id, prompt_ids, params in schedule:
        engine.add_request(request_id, prompt_ids, params)
        tokens[request_id] = []
    while engine.has_unfinished():
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                outputs[out.request_id] = out
    assert tokens["eos"] == reference[: first_eos + 1] and outputs["eos"].finish_reason == "stop"
    assert tokens["ignore"] == reference and outputs["ignore"].finish_reason == "length"
    assert tokens["ids"] == reference[: reference.index(reference[5]) + 1] and outputs["ids"].finish_reason == "stop"
    assert tokens["text"] == reference[:end]
    assert (outputs["text"].finish_reason, outputs["text"].stop_string) == ("stop", stop)
    assert outputs["eos"].stop_string is None and outputs["ids"].stop_string is None
    assert tokens["short"] == reference[:2] and outputs["short"].finish_reason == "length"
    assert outputs["short"].completion_tokens == 2 and outputs["short"].prompt_tokens == len(prompt)


def test_abort_and_shutdown_leave_the_others_untouched():
    model = _native()
    expected = _single_greedy(model, PROMPTS[1], 10)
    engine = ServingEngine(model, max_batch_size=4, block_size=4, num_blocks=20)
    engine.add_request("keep", PROMPTS[1], GREEDY)
    engine.add_request("drop", PROMPTS[0], GREEDY)
    engine.add_request("queued", PROMPTS[2], GREEDY)
    assert (engine.num_waiting, engine.num_running) == (3, 0)
    engine.abort("queued")  # applied in order at the next step: never runs
    kept, dropped = [], None
    for step in range(12):
        if step == 2:
            engine.abort("drop")
            engine.abort("unknown")  # nothing
        for out in engine.step():
            if out.request_id == "keep":
                kept += out.new_token_ids
            elif out.request_id == "drop" and out.finished:
                dropped = out
            elif out.request_id == "queued":
                assert (out.finished, out.finish_reason, out.new_token_ids) == (True, "abort", [])
    assert kept == expected
    assert dropped.finish_reason == "abort" and dropped.completion_tokens == 3  # 2 in its first step, 1 in the next
    engine.add_request("drop", PROMPTS[0], GREEDY)  # a finished id can be used again
    engine.add_request("late", PROMPTS[3], GREEDY)
    engine.step()
    engine.shutdown()
    with pytest.raises(RuntimeError, match="shutting down"):
        engine.add_request("refused", PROMPTS[0], GREEDY)
    outs = engine.step()
    assert {(o.request_id, o.finished, o.finish_reason) for o in outs} == {
        ("drop", True, "abort"),
        ("late", True, "abort"),
    }
    assert engine.is_shut_down and engine.step() == [] and not engine.has_unfinished()
    assert engine.cache.num_free_blocks == 20


def test_bad_requests_fail_with_the_limit_named_and_disturb_nothing():
    model = _native()
    engine = ServingEngine(model, max_batch_size=2, block_size=4, num_blocks=8, max_model_len=40)
    engine.add_request("ok", PROMPTS[1], GREEDY)
    engine.step()
    cases = [
        (("e", [], GREEDY), "empty prompt"),
        (("v", [1, 128], GREEDY), r"outside the vocabulary \[0, 128\)"),
        (("l", list(range(35)), GREEDY), "max_model_len=40"),
        (("b", [1] * 30, GREEDY), "needs 10 KV blocks of 4 tokens but the cache holds 8"),
        (("ok", [1], GREEDY), "already in use"),
        (("s", [1], RequestParams(stop=("x",))), "tokenizer"),
    ]
    for (request_id, prompt, params), message in cases:
        with pytest.raises(ValueError, match=message):
            engine.add_request(request_id, prompt, params)
    for field, value in [("max_tokens", 0), ("temperature", -1.0), ("top_p", 0.0), ("top_k", -1), ("stop", "x"),
                         ("stop_token_ids", (-1,)), ("seed", 1.5), ("ignore_eos", 1)]:  # fmt: skip
        with pytest.raises(ValueError, match=f"RequestParams: {field}="):
            RequestParams(**{field: value})
    with pytest.raises(ValueError, match="kv_cache_bytes or num_blocks"):
        ServingEngine(model, kv_cache_bytes=1 << 20, num_blocks=4)
    with pytest.raises(ValueError, match="max_model_len=999"):
        ServingEngine(model, max_model_len=999)
    tokens = []
    while engine.has_unfinished():
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    assert len(tokens) == GREEDY.max_tokens - 2  # "ok" ran on; its first step's two tokens were taken above
    budget = ServingEngine(model, block_size=4, kv_cache_bytes=PagedKVCache.bytes_per_block(model, 4) * 5 + 7)
    assert budget.cache.num_blocks == 5 and budget.cache.nbytes() == PagedKVCache.bytes_per_block(model, 4) * 5


def test_requests_added_from_another_thread_while_stepping():
    model = _native()
    expected = {f"t{i}": _single_greedy(model, prompt, 6) for i, prompt in enumerate(PROMPTS)}
    engine = ServingEngine(model, max_batch_size=3, block_size=4, num_blocks=24)
    params = RequestParams(max_tokens=6, temperature=0)

    def client():
        for index, prompt in enumerate(PROMPTS):
            engine.add_request(f"t{index}", prompt, params)

    thread = threading.Thread(target=client)
    tokens: dict[str, list[int]] = {key: [] for key in expected}
    finished: set[str] = set()
    thread.start()
    while len(finished) < len(PROMPTS):
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            if out.finished:
                finished.add(out.request_id)
    thread.join()
    assert tokens == expected


def _tp_case(prompts: list[list[int]]):
    from colo.apps.models.llama import parallelize_llama
    from colo.comm import Mesh

    mesh = Mesh(tp=2)
    reference = _native()
    model = _native()
    parallelize_llama(model, mesh=mesh)
    seeded = RequestParams(max_tokens=8, temperature=0.9, top_p=0.95, seed=3)
    schedule = _staggered(prompts, RequestParams(max_tokens=8, temperature=0))
    schedule.setdefault(1, []).append(("seeded", prompts[0], seeded))
    engine = ServingEngine(model, max_batch_size=3, block_size=2, num_blocks=14, group=mesh.group("tp"))
    if mesh.rank("tp") == 0:
        tokens, _ = _run_staged(engine, schedule)
        engine.shutdown()
        engine.step()
    else:
        steps = 0
        while not engine.is_shut_down:
            assert engine.step() is not None
            steps += 1
        tokens = {"follower_steps": steps}
    single = ServingEngine(reference, max_batch_size=3, block_size=2, num_blocks=14)
    return tokens, _run_staged(single, schedule)[0], engine.num_preemptions, engine.is_shut_down


def test_tp2_gives_the_tokens_of_tp1():
    results = run_distributed(_tp_case, PROMPTS[:5], world_size=2, timeout=120)
    (tp2, tp1, preemptions, shut), (follower, tp1_again, follower_preemptions, follower_shut) = results
    assert tp2 == tp1 == tp1_again
    assert preemptions > 0 and preemptions == follower_preemptions  # both ranks scheduled identically
    assert shut and follower_shut and follower["follower_steps"] > 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_continuous_batching_on_cuda_equals_single_request_greedy():
    model = _native().cuda()
    expected = {f"r{i}": _single_greedy(model, prompt, GREEDY.max_tokens) for i, prompt in enumerate(PROMPTS)}
    engine = ServingEngine(model, max_batch_size=6, block_size=2, num_blocks=15)  # preempts, as on CPU
    tokens, _ = _run_staged(engine, _staggered(PROMPTS))
    assert tokens == expected and engine.num_preemptions > 0
    sampled = RequestParams(max_tokens=8, temperature=1.0, seed=7)
    assert engine.generate([PROMPTS[0]], sampled) == ServingEngine(model).generate([PROMPTS[0]], sampled)
