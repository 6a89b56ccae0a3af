"""`colo serve` end to end: the real command as a subprocess on a loopback port, over a tiny fp32 Llama checkpoint of
an SFT run (byte tokenizer, the run's chat template), driven by the official ``openai`` client.

The claim is exactness against direct generation: every served request's tokens equal single-request greedy
`colo.apps.generation.continue_prompt` on the same model, whatever else is in the batch (16 concurrent clients of mixed
prompt lengths and lengths, half of them streamed), and ``--tp 2`` gives the tokens ``--tp 1`` gives. The prompts
are fixtures whose greedy path keeps the top-2 logit gap >= 1e-3 at every step, so the argmax cannot flip on the
float rounding that batching (padded rows, other reduction orders) or tensor-parallel matmuls change. Bad requests
are answered 4xx in OpenAI's error shape while a request in flight finishes unchanged; SIGTERM drains: 503 for new
requests, in-flight ones finish within ``--grace``, the rest end with an SSE error event (a whole one with 503), exit
code 0; past ``--max-concurrent`` requests in flight a new one gets 429.

Three servers (tp1, tp2, and one to shut down) start at once and are shared by the tests of this module.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from colo.apps.data import ChatTemplate, load_tokenizer  # noqa: E402
from colo.apps.generation import continue_prompt  # noqa: E402
from colo.apps.models.llama import Llama, get_preset, llama_state_dict_to_hf  # noqa: E402
from colo.comm import find_free_port  # noqa: E402
from colo.tensor.checkpoint import save_checkpoint  # noqa: E402

EOS = 257  # the byte tokenizer's
MIN_GAP = 1e-3
STARTUP_SECONDS = 120
GRACE = 2.0  # the drained server's --grace, seconds
SHORT = 40  # tokens of the request that finishes within the grace (~4 ms each, two requests in the batch)
TOKENIZER = load_tokenizer(None)


def _config():
    # vocab 260: the byte tokenizer's 259 ids plus one (even, so that tp=2 splits it); a window long enough that one
    # request outlasts the shutdown test's grace; initializer_range 0.2 spreads the logits (clear top-2 gaps)
    return get_preset("tiny", vocab_size=260, max_position_embeddings=4096, initializer_range=0.2)


def _write_checkpoint(path) -> Llama:
    config = _config()
    model = Llama(config)
    model.init_weights(0)
    state = llama_state_dict_to_hf(model.state_dict(), config)
    state = {name.removeprefix("model."): tensor.contiguous() for name, tensor in state.items()}
    run = {
        "llama_config": dataclasses.asdict(config),
        "config": {"data": {"task": "sft", "chat_template": {}}},  # an SFT run: chat through its template
        "tokenizer": None,
    }
    save_checkpoint(path, state, metadata={"run": run})
    return model.eval()


class Server:
    """``colo serve CHECKPOINT`` in a subprocess on a free loopback port."""

    def __init__(self, checkpoint, *args: str) -> None:
        self.port = find_free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        command = [sys.executable, "-m", "colo.apps.cli", "serve", str(checkpoint), "--port", str(self.port)]
        self.process = subprocess.Popen(
            [*command, "--model-name", "tiny", *args],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.output: list[str] = []
        self.signalled = False
        self._reader = threading.Thread(target=lambda: self.output.extend(self.process.stdout), daemon=True)
        self._reader.start()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_SECONDS
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise AssertionError(f"colo serve exited with {self.process.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"colo serve did not answer /health within {STARTUP_SECONDS} s:\n{self.log()}")

    def client(self):
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=60)

    def log(self) -> str:
        self._reader.join(timeout=0.5)
        return "".join(self.output)

    def signal_stop(self) -> None:
        """SIGTERM, once."""
        if not self.signalled and self.process.poll() is None:
            self.signalled = True
            self.process.send_signal(signal.SIGTERM)

    def stop(self) -> int:
        self.signal_stop()
        try:
            return self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            raise AssertionError(f"colo serve did not exit within 30 s of SIGTERM:\n{self.log()}") from None


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The checkpoint's model in this process, three servers on it (started together) and 16 prompt fixtures
    (chosen while the servers start)."""
    checkpoint = tmp_path_factory.mktemp("serve") / "tiny-sft"
    model = _write_checkpoint(checkpoint)
    servers = {
        "tp1": Server(checkpoint, "--max-concurrent", "16", "--max-prompt-tokens", "64"),
        "tp2": Server(checkpoint, "--tp", "2"),
        "drain": Server(checkpoint, "--max-concurrent", "3", "--grace", str(GRACE)),
    }
    try:
        fixtures = _fixtures(model, 16)
        for server in servers.values():
            server.wait_ready()
        yield model, servers, fixtures
    finally:
        for server in servers.values():  # all drain at once
            server.signal_stop()
        codes = {name: server.stop() for name, server in servers.items()}
        failed = {name: code for name, code in codes.items() if code != 0 and name != "drain"}
        assert not failed, "\n".join(
            f"{name} exited with {code}:\n{servers[name].log()[-3000:]}" for name, code in failed.items()
        )


def _greedy(model: Llama, prompt_ids: list[int], max_tokens: int, *, eos: int | None = EOS) -> tuple[list[int], float]:
    """Single-request greedy generation and the smallest top-2 logit gap along its path."""
    new = continue_prompt(model, prompt_ids, max_new_tokens=max_tokens, eos_id=eos)
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + new]), return_logits=True).logits[0].float()
    steps = logits[len(prompt_ids) - 1 : len(prompt_ids) - 1 + len(new)]
    top2 = steps.topk(2, dim=-1).values
    return new, float((top2[:, 0] - top2[:, 1]).min())


def _text(ids: list[int]) -> str:
    return TOKENIZER.decode([i for i in ids if i < TOKENIZER.vocab_size])


def _fixtures(model: Llama, count: int) -> list[tuple[str, int, list[int]]]:
    """``count`` (prompt, max_tokens, greedy tokens) of mixed lengths whose greedy paths have clear top-2 gaps."""
    chosen = []
    for index in range(200):
        prompt = f"def f{index}(x):" + " return x" * (index % 5) + "\n" * (index % 3)
        max_tokens = 3 + (index * 7) % 17
        new, gap = _greedy(model, TOKENIZER.encode(prompt), max_tokens)
        if gap >= MIN_GAP:
            chosen.append((prompt, max_tokens, new))
        if len(chosen) == count:
            return chosen
    raise AssertionError(f"only {len(chosen)} prompts keep a top-2 logit gap >= {MIN_GAP}; change the fixture model")


def _complete(client, prompt: str, max_tokens: int, *, stream: bool, **options) -> tuple[list[int], str, str]:
    """(token ids, text, finish reason) of one greedy completion, streamed or whole."""
    extra = {"return_token_ids": True, **options.pop("extra_body", {})}
    response = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0, stream=stream, extra_body=extra, **options
    )
    if not stream:
        choice = response.choices[0]
        return choice.token_ids, choice.text, choice.finish_reason
    ids, text, reason = [], "", None
    for chunk in response:
        choice = chunk.choices[0]
        ids += choice.token_ids
        text += choice.text
        reason = choice.finish_reason or reason
    return ids, text, reason


def test_sixteen_concurrent_clients_get_direct_greedy_tokens(served):
    model, servers, fixtures = served
    client = servers["tp1"].client()
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        futures = [
            pool.submit(_complete, client, prompt, max_tokens, stream=index % 2 == 1)
            for index, (prompt, max_tokens, _) in enumerate(fixtures)
        ]
        results = [future.result() for future in futures]
    for (prompt, _, expected), (ids, text, reason) in zip(fixtures, results, strict=True):
        assert ids == expected, prompt
        assert text == _text(expected), prompt  # streamed deltas add up to the same text
        assert reason == ("stop" if expected[-1] == EOS else "length")


def test_completion_usage_echo_and_models(served):
    model, servers, fixtures = served
    client = servers["tp1"].client()
    prompt, max_tokens, expected = fixtures[0]
    response = client.completions.create(model="tiny", prompt=prompt, max_tokens=max_tokens, temperature=0, echo=True)
    assert response.object == "text_completion" and response.model == "tiny"
    assert response.choices[0].text == prompt + _text(expected)
    prompt_tokens = len(TOKENIZER.encode(prompt))
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (prompt_tokens, len(expected))
    assert response.usage.total_tokens == prompt_tokens + len(expected)
    by_ids = client.completions.create(
        model="tiny", prompt=TOKENIZER.encode(prompt), max_tokens=max_tokens, temperature=0,
        extra_body={"return_token_ids": True},
    )  # fmt: skip
    assert by_ids.choices[0].token_ids == expected
    block_size = 16  # colo serve's default: the prompt's full blocks but the one of its last token were cached
    assert by_ids.usage.prompt_tokens_details.cached_tokens == (prompt_tokens - 1) // block_size * block_size
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert httpx.get(f"{servers['tp1'].url}/health").json() == {"status": "ok"}


def test_chat_uses_the_runs_template(served):
    model, servers, fixtures = served
    client = servers["tp1"].client()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a prime."}]
    prompt_ids, _ = ChatTemplate().tokenize(messages, TOKENIZER, add_generation_prompt=True)
    expected, gap = _greedy(model, prompt_ids, 12)
    assert gap >= MIN_GAP
    response = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=12, temperature=0, extra_body={"return_token_ids": True}
    )
    choice = response.choices[0]
    assert response.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.prompt_token_ids == prompt_ids and choice.token_ids == expected
    assert choice.message.content == _text(expected)
    assert response.usage.prompt_tokens == len(prompt_ids) and response.usage.completion_tokens == len(expected)
    stream = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=12, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].object == "chat.completion.chunk"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == _text(expected)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected)


def test_stream_is_openai_sse_ending_with_done(served):
    model, servers, fixtures = served
    prompt, max_tokens, expected = fixtures[0]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{servers['tp1'].url}/v1/completions", json=body, timeout=60) as response:
        assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
        events = [line for line in response.iter_lines() if line]
    assert all(line.startswith("data: ") for line in events) and events[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in events[:-1]]
    assert {c["object"] for c in chunks} == {"text_completion"} and len({c["id"] for c in chunks}) == 1
    assert "".join(c["choices"][0]["text"] for c in chunks) == _text(expected)
    assert [c["choices"][0]["finish_reason"] for c in chunks][-1] in ("stop", "length")


def test_stop_strings_are_cut_from_the_text(served):
    model, servers, fixtures = served
    client = servers["tp1"].client()

    def stop_at(text: str) -> int | None:  # where two printable characters start (not at the very beginning)
        plain = [text[i : i + 2].isprintable() and "\ufffd" not in text[i : i + 2] for i in range(len(text) - 1)]
        return next((i for i in range(2, len(plain)) if plain[i]), None)

    chosen = [(p, n, e) for p, n, e in fixtures if stop_at(_text(e)) is not None]
    assert chosen, "no fixture generates two printable characters to stop at"
    prompt, max_tokens, expected = chosen[0]
    text = _text(expected)
    stop = text[stop_at(text) : stop_at(text) + 2]
    cut = text[: text.find(stop)]
    for stream in (False, True):
        ids, got, reason = _complete(client, prompt, max_tokens, stream=stream, stop=[stop])
        assert (got, reason) == (cut, "stop"), stream
        assert ids == expected[: len(ids)] and stop in _text(ids)  # the tokens that formed the stop string came out


def test_bad_requests_get_4xx_and_leave_others_undisturbed(served):
    model, servers, fixtures = served
    server = servers["tp1"]
    client = server.client()
    prompt, _, _ = fixtures[0]
    long_tokens, gap = _greedy(model, TOKENIZER.encode(prompt), 60)
    assert gap >= MIN_GAP
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(_complete, client, prompt, 60, stream=True)
        url = f"{server.url}/v1/completions"
        good = {"model": "tiny", "prompt": "hi", "max_tokens": 4}
        cases = [
            (b"{not json", 400, "the body is not valid JSON at character 1"),
            ({"model": "tiny"}, 400, "prompt"),
            ({**good, "temperature": -1}, 400, "temperature"),
            ({**good, "max_tokens": 0}, 400, "max_tokens"),
            ({**good, "bogus": 1}, 400, "bogus"),
            ({**good, "n": 17}, 400, "n: Input should be less than or equal to 16"),
            ({**good, "logprobs": 3, "echo": True}, 400, "logprobs with echo"),
            ({**good, "prompt": ["a", "b"]}, 400, "one prompt per request"),
            ({**good, "prompt": [5, 999]}, 400, "999 outside the vocabulary"),
            ({**good, "model": "gpt-4"}, 404, "'gpt-4' does not exist"),
            ({**good, "prompt": "x" * 65}, 400, "65 tokens; this server accepts at most 64"),
            ({**good, "max_tokens": 5000}, 400, "maximum context length is 4096"),
        ]
        for body, status, words in cases:
            if isinstance(body, bytes):  # sent as a client sends JSON
                sent = httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=30)
            else:
                sent = httpx.post(url, json=body)
            assert sent.status_code == status, (body, sent.text)
            error = sent.json()["error"]
            assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
            assert words is None or words in error["message"], (words, error)
            if isinstance(body, bytes):  # OpenAI's shape: param names a field or is null, never a character offset
                assert error["param"] is None, error
        chat = f"{server.url}/v1/chat/completions"
        for body, words in [
            ({"model": "tiny", "messages": []}, "messages"),
            ({"model": "tiny", "messages": [{"role": "robot", "content": "hi"}]}, "role 'robot'"),
        ]:
            sent = httpx.post(chat, json=body)
            assert sent.status_code == 400 and words in sent.json()["error"]["message"], sent.text
        with pytest.raises(openai.BadRequestError, match="at most 64"):
            client.completions.create(model="tiny", prompt="y" * 100, max_tokens=2)
        ids, _, _ = running.result()
    assert ids == long_tokens
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_tp2_gives_the_tokens_of_tp1(served):
    model, servers, fixtures = served
    tp1, tp2 = servers["tp1"].client(), servers["tp2"].client()
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        one = [pool.submit(_complete, tp1, p, n, stream=False) for p, n, _ in fixtures[:4]]
        two = [pool.submit(_complete, tp2, p, n, stream=i % 2 == 0) for i, (p, n, _) in enumerate(fixtures[:4])]
        one, two = [f.result() for f in one], [f.result() for f in two]
    for (_, _, expected), a, b in zip(fixtures[:4], one, two, strict=True):
        assert a[0] == b[0] == expected


def test_sigterm_drains_503_finishes_within_grace_then_cancels(served):
    model, servers, fixtures = served
    server = servers["drain"]
    client = server.client()
    prompt, _, _ = fixtures[0]
    short, gap = _greedy(model, TOKENIZER.encode(prompt), SHORT, eos=None)
    assert gap >= MIN_GAP

    # ~4 ms a token on one CPU thread: the long requests need seconds, far past the grace
    def long_stream():
        stream = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=3000, temperature=0, stream=True, extra_body={"ignore_eos": True}
        )
        chunks = iter(stream)
        next(chunks)  # running in the engine now
        return stream, chunks

    def probe() -> bool:
        """Whether a one-token request is refused with 429 (else it was served)."""
        try:
            client.completions.create(model="tiny", prompt="hi", max_tokens=1)
        except openai.RateLimitError as error:
            assert error.status_code == 429 and "--max-concurrent" in str(error)
            return True
        return False

    pool = concurrent.futures.ThreadPoolExecutor(1)
    whole = pool.submit(  # a long non-streamed request: cancelled with a 503 after the grace
        client.completions.create, model="tiny", prompt=prompt, max_tokens=3000, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    _, long_chunks = long_stream()
    extra, _ = long_stream()
    deadline = time.monotonic() + 10
    while not probe():  # --max-concurrent 3: refused once the three long ones are in flight
        assert time.monotonic() < deadline, "three requests in flight never made a fourth one 429"
    extra.close()  # the client leaves: its request is aborted and its slot freed
    while probe():
        assert time.monotonic() < deadline + 10, "a closed stream's request kept its concurrency slot"
        time.sleep(0.02)

    short_stream = client.completions.create(
        model="tiny", prompt=prompt, max_tokens=SHORT, temperature=0, stream=True,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )  # fmt: skip
    short_chunks = iter(short_stream)
    short_ids = list(next(short_chunks).choices[0].token_ids)
    signalled = time.monotonic()
    server.signal_stop()
    while httpx.get(f"{server.url}/health").status_code != 503:
        assert time.monotonic() - signalled < 5, "the server did not start draining within 5 s of SIGTERM"
        time.sleep(0.01)
    with pytest.raises(openai.InternalServerError, match="shutting down") as refused:
        client.completions.create(model="tiny", prompt="hi", max_tokens=2)
    assert refused.value.status_code == 503

    for chunk in short_chunks:  # in flight at SIGTERM: finishes, within the grace period
        short_ids += chunk.choices[0].token_ids
    assert short_ids == short and time.monotonic() - signalled < GRACE
    assert "draining (3 request(s) in flight" in server.log()  # all three were in flight at SIGTERM
    with pytest.raises(openai.APIError, match="grace"):  # still running after the grace: a final SSE error event
        for _ in long_chunks:
            pass
    assert time.monotonic() - signalled >= GRACE - 0.05
    with pytest.raises(openai.InternalServerError, match="grace") as cancelled:
        whole.result(timeout=10)
    assert cancelled.value.status_code == 503
    pool.shutdown()
    assert server.process.wait(timeout=20) == 0, server.log()
