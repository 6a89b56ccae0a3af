"""Log-probabilities of generated tokens equal the log-softmax of a full forward's logits, in the engine and over
OpenAI's HTTP shapes.

- `ServingEngine` with ``RequestParams(logprobs=k)``: every generated token's log-probability and the ``k`` most
  likely tokens at its step equal ``log_softmax`` of a full (uncached) forward over the prompt and the tokens before
  it, within 1e-5 (fp32; not zero: the paged attention sums in another order), greedy and sampled, with prefix
  caching and chunked prefill on.
- ``/v1/completions`` with ``logprobs: 2`` (whole and streamed) and ``/v1/chat/completions`` with ``logprobs: true,
  top_logprobs: 2`` answer OpenAI's shapes with the same numbers; ``logprobs`` with ``echo``, ``top_logprobs``
  without ``logprobs`` and more than 20 alternatives get a 400.
"""

from __future__ import annotations

import asyncio
import json

import pytest
import torch

from colo.apps.data import ChatTemplate, load_tokenizer
from colo.apps.models.llama import Llama, get_preset
from colo.apps.serving import RequestParams, ServingEngine

TOKENIZER = load_tokenizer(None)  # bytes: 259 ids
TOLERANCE = {"rtol": 1e-5, "atol": 1e-5}


def _model() -> Llama:
    model = Llama(get_preset("tiny", vocab_size=260, initializer_range=0.2))
    model.init_weights(0)
    return model.eval()


def _reference(model, prompt: list[int], tokens: list[int], vocab_limit: int | None = None) -> torch.Tensor:
    """``(len(tokens), vocab)`` log-softmax of a full forward's logits at each generated token's step."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1 :].float()
    return torch.log_softmax(logits[:, :vocab_limit], dim=-1)


def _assert_entries_match(entries, tokens: list[int], reference: torch.Tensor, num_top: int) -> None:
    assert [entry.token_id for entry in entries] == tokens
    for step, entry in enumerate(entries):
        torch.testing.assert_close(entry.logprob, float(reference[step, tokens[step]]), **TOLERANCE)
        values, ids = reference[step].topk(num_top)
        assert [token for token, _ in entry.top] == ids.tolist()
        torch.testing.assert_close([lp for _, lp in entry.top], values.tolist(), **TOLERANCE)


def test_engine_logprobs_equal_a_full_forwards_log_softmax():
    model = _model()
    prompts = {"greedy": [72, 101, 108, 108, 111, 44, 32, 119], "sampled": [72, 101, 108, 108, 111, 33]}
    params = {
        "greedy": RequestParams(max_tokens=6, temperature=0, logprobs=3, ignore_eos=True),
        "sampled": RequestParams(max_tokens=6, temperature=1.0, seed=5, logprobs=0, ignore_eos=True),
    }
    engine = ServingEngine(model, max_batch_size=2, block_size=4, num_blocks=16, max_tokens_per_step=4)
    tokens = {request_id: [] for request_id in prompts}
    entries = {request_id: [] for request_id in prompts}
    for request_id, prompt in prompts.items():
        engine.add_request(request_id, prompt, params[request_id])
    while engine.has_unfinished():
        for out in engine.step():
            assert len(out.logprobs) == len(out.new_token_ids)
            tokens[out.request_id] += out.new_token_ids
            entries[out.request_id] += out.logprobs
    for request_id, prompt in prompts.items():
        reference = _reference(model, prompt, tokens[request_id])
        _assert_entries_match(entries[request_id], tokens[request_id], reference, params[request_id].logprobs)
    assert tokens["greedy"] == reference_greedy(model, prompts["greedy"], 6)
    plain = ServingEngine(model).generate([prompts["greedy"]], RequestParams(max_tokens=2, temperature=0))
    assert plain == [tokens["greedy"][:2]]  # and a request without logprobs gets none
    with pytest.raises(ValueError, match=r"logprobs=21 must be an int in \[0, 20\]"):
        RequestParams(logprobs=21)


def reference_greedy(model, prompt: list[int], steps: int) -> list[int]:
    tokens: list[int] = []
    with torch.no_grad():
        for _ in range(steps):
            tokens.append(int(model(torch.tensor([prompt + tokens])).logits[0, -1].argmax()))
    return tokens


def _serve(model, requests: list[tuple[str, dict]], *, engine_out: list | None = None):
    """POST each ``(path, body)`` to an in-process app over ``model``; the responses (the engine appended to
    ``engine_out`` when given)."""
    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from colo.apps.serving import ServeSettings, create_app

    engine = ServingEngine(model, tokenizer=TOKENIZER, eos_token_id=TOKENIZER.eos_id, max_batch_size=4, block_size=4)
    app = create_app(engine, TOKENIZER, settings=ServeSettings(model_name="tiny"), chat_template=ChatTemplate())
    if engine_out is not None:
        engine_out.append(engine)

    async def scenario():
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://serve", timeout=60) as client:
                return [await client.post(path, json=body) for path, body in requests]

    return asyncio.run(scenario())


def _decode(token_id: int) -> str:
    return TOKENIZER.decode([token_id])


def test_openai_logprobs_shapes_over_http():
    model = _model()
    prompt = "Hello, w"
    prompt_ids = TOKENIZER.encode(prompt)
    messages = [{"role": "user", "content": "Hi"}]
    chat_ids, _ = ChatTemplate().tokenize(messages, TOKENIZER, add_generation_prompt=True)
    base = {"model": "tiny", "max_tokens": 5, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    whole, streamed, chat, echoed, unpaired, too_many = _serve(
        model,
        [
            ("/v1/completions", {**base, "prompt": prompt, "logprobs": 2}),
            ("/v1/completions", {**base, "prompt": prompt, "logprobs": 2, "stream": True}),
            ("/v1/chat/completions", {**base, "messages": messages, "logprobs": True, "top_logprobs": 2}),
            ("/v1/completions", {**base, "prompt": prompt, "logprobs": 1, "echo": True}),
            ("/v1/chat/completions", {**base, "messages": messages, "top_logprobs": 2}),
            ("/v1/completions", {**base, "prompt": prompt, "logprobs": 21}),
        ],
    )
    choice = whole.json()["choices"][0]
    tokens = choice["token_ids"]
    reference = _reference(model, prompt_ids, tokens, vocab_limit=None)
    logprobs = choice["logprobs"]
    assert logprobs["tokens"] == [_decode(t) for t in tokens]
    torch.testing.assert_close(logprobs["token_logprobs"], reference[range(5), tokens].tolist(), **TOLERANCE)
    top = reference.topk(2, dim=-1)
    for step, alternatives in enumerate(logprobs["top_logprobs"]):  # keyed by text: bytes >= 128 all read "\ufffd"
        expected = {_decode(t): lp for t, lp in zip(top.indices[step].tolist(), top.values[step].tolist())}
        assert list(alternatives) == list(expected)
        torch.testing.assert_close(list(alternatives.values()), list(expected.values()), **TOLERANCE)
    assert logprobs["text_offset"] == [sum(len(_decode(t)) for t in tokens[:step]) for step in range(5)]

    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    streamed_logprobs = [event["choices"][0]["logprobs"] for event in events if event["choices"]]
    assert sum((lp["tokens"] for lp in streamed_logprobs), []) == logprobs["tokens"]
    assert sum((lp["token_logprobs"] for lp in streamed_logprobs), []) == logprobs["token_logprobs"]
    assert sum((lp["text_offset"] for lp in streamed_logprobs), []) == logprobs["text_offset"]

    chat_choice = chat.json()["choices"][0]
    chat_tokens = chat_choice["token_ids"]
    chat_reference = _reference(model, chat_ids, chat_tokens)
    content = chat_choice["logprobs"]["content"]
    assert [item["token"] for item in content] == [_decode(t) for t in chat_tokens]
    assert all(item["bytes"] == list(item["token"].encode()) for item in content)
    torch.testing.assert_close(
        [item["logprob"] for item in content], chat_reference[range(5), chat_tokens].tolist(), **TOLERANCE
    )
    chat_top = chat_reference.topk(2, dim=-1)
    assert [[alt["token"] for alt in item["top_logprobs"]] for item in content] == [
        [_decode(t) for t in step] for step in chat_top.indices.tolist()
    ]
    assert echoed.status_code == 400 and "echo" in echoed.json()["error"]["message"]
    assert unpaired.status_code == 400 and "top_logprobs needs logprobs=true" in unpaired.json()["error"]["message"]
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "logprobs"


def test_n_choices_share_the_prompts_blocks_and_each_equals_its_own_seeded_request():
    model = _model()
    prompt = "Hello, world! " * 3  # 42 byte tokens: 10 full blocks of 4 and 2 tokens
    prompt_ids = TOKENIZER.encode(prompt)
    base = {"model": "tiny", "prompt": prompt, "max_tokens": 6, "ignore_eos": True, "return_token_ids": True}
    engines = []
    many, streamed, *singles, too_many = _serve(
        model,
        [
            ("/v1/completions", {**base, "n": 3, "seed": 7, "logprobs": 1}),
            ("/v1/completions", {**base, "n": 3, "seed": 7, "stream": True, "stream_options": {"include_usage": True}}),
            *[("/v1/completions", {**base, "seed": 7 + index}) for index in range(3)],
            ("/v1/completions", {**base, "n": 17}),
        ],
        engine_out=engines,
    )
    choices = many.json()["choices"]
    assert [choice["index"] for choice in choices] == [0, 1, 2]
    tokens = [choice["token_ids"] for choice in choices]
    assert tokens == [single.json()["choices"][0]["token_ids"] for single in singles]  # choice i: seed 7 + i
    assert len({tuple(t) for t in tokens}) == 3  # sampled at temperature 1: the choices differ
    for choice in choices:  # each choice's log-probs are its own tokens'
        reference = _reference(model, prompt_ids, choice["token_ids"])
        expected = reference[range(6), choice["token_ids"]].tolist()
        torch.testing.assert_close(choice["logprobs"]["token_logprobs"], expected, **TOLERANCE)
    assert many.json()["usage"]["prompt_tokens"] == len(prompt_ids) == 42
    assert many.json()["usage"]["completion_tokens"] == 18
    # the first request's choices 1 and 2 took the 10 full blocks choice 0 computed; the later requests took them
    # from the cache too: 5 x 3 + 2 requests, 40 tokens each
    assert engines[0].num_prefix_cached_tokens == 40 * (2 + 3 + 3)
    assert engines[0].num_prefill_tokens == 42 + 2 * 8  # choice 0 whole, the 8 later ones their last 2 tokens

    events = [json.loads(line[6:]) for line in streamed.text.splitlines() if line.startswith("data: {")]
    streamed_ids: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for event in events[:-1]:
        (choice,) = event["choices"]
        streamed_ids[choice["index"]].extend(choice["token_ids"])
    assert [streamed_ids[index] for index in range(3)] == tokens
    assert events[-1]["usage"]["completion_tokens"] == 18 and events[-1]["usage"]["prompt_tokens"] == 42
    assert events[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == 40
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "n"
