"""`colo serve`'s parts in one process, no HTTP: the streamed text (held-back UTF-8 and stop-string prefixes, deltas
adding up to the final text), what `load_for_serving` loads (run, Hugging Face and quantized checkpoints, quantizing
when loading) and the engine over a quantized model, and the command's refusals before it starts anything."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from typer.testing import CliRunner

from colo.apps.cli import app
from colo.apps.data import load_tokenizer
from colo.apps.generation import continue_prompt
from colo.apps.hf.llama_io import save_llama_as_hf
from colo.apps.models.llama import Llama, get_preset, llama_state_dict_to_hf
from colo.apps.quant import QuantizedLinear, quantize_model, save_quantized
from colo.apps.serving import EngineOptions, TextStream, load_for_serving
from colo.apps.serving.model import build_engine
from colo.tensor.checkpoint import save_checkpoint

TOKENIZER = load_tokenizer(None)
EOS = TOKENIZER.eos_id


def _stream_all(text_ids: list[int], stream: TextStream, stop_string: str | None = None) -> list[str]:
    deltas = [stream.add([token]) for token in text_ids]
    return [*deltas, stream.finish(stop_string)]


def test_stream_holds_back_unfinished_utf8_and_adds_up_to_the_text():
    text = "héllo wörld ✓ done"
    ids = TOKENIZER.encode(text) + [EOS]
    deltas = _stream_all(ids, TextStream(TOKENIZER, hidden_ids=[EOS]))
    assert "".join(deltas) == text
    assert all("\ufffd" not in delta for delta in deltas)  # a multi-byte character is sent once it is whole
    assert TextStream(TOKENIZER, hidden_ids=[EOS]).text() == ""


def test_stream_never_sends_text_a_stop_string_later_cuts():
    text = "abc wörld xyz"
    ids = TOKENIZER.encode(text)
    stream = TextStream(TOKENIZER, stop=("wör", "zz"))
    deltas = [stream.add([token]) for token in ids[: len(TOKENIZER.encode("abc wö"))]]
    assert "".join(deltas) == "abc "  # "wö" could start "wör" (len - 1 characters): held back, not sent
    deltas.append(stream.add(TOKENIZER.encode("r")))
    deltas.append(stream.finish("wör"))
    assert "".join(deltas) == "abc "
    whole = TextStream(TOKENIZER, stop=("wör",))
    whole.add(ids)
    assert whole.text("wör") == "abc "
    plain = TextStream(TOKENIZER, stop=("qq",))
    assert "".join(_stream_all(ids, plain)) == text  # no stop string met: the held-back tail comes at the end


def _config():
    return get_preset("tiny", vocab_size=260, intermediate_size=192, initializer_range=0.2)


def _run_checkpoint(path) -> Llama:
    model = Llama(_config())
    model.init_weights(0)
    state = llama_state_dict_to_hf(model.state_dict(), model.config)
    state = {name.removeprefix("model."): tensor.contiguous() for name, tensor in state.items()}
    run = {"llama_config": dataclasses.asdict(model.config), "config": {}, "tokenizer": None}
    save_checkpoint(path, state, metadata={"run": run})
    return model.eval()


def _logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids]), return_logits=True).logits


def test_load_for_serving_reads_run_hf_and_quantized_checkpoints(tmp_path):
    model = _run_checkpoint(tmp_path / "run")
    ids = [3, 70, 101, 9, 255]
    loaded, run, tokenizer = load_for_serving(tmp_path / "run")
    assert torch.equal(_logits(loaded, ids), _logits(model, ids)) and run["llama_config"]["vocab_size"] == 260
    # the model's 260 output rows pad the byte tokenizer's 259 ids: the engine never samples the padding row, even
    # where its logit is the largest (an id the tokenizer could not decode)
    from colo.apps.serving import RequestParams

    with torch.no_grad():
        last = loaded.hidden_states(torch.tensor([ids]))[0, -1]
        loaded.lm_head.weight[259] = 100 * last / last.norm()
    assert int(_logits(loaded, ids)[0, -1].argmax()) == 259
    engine = build_engine(loaded, tokenizer, EngineOptions(max_batch_size=1, max_model_len=16))
    assert engine.vocab_limit == tokenizer.vocab_size == 259
    assert engine.generate([ids], RequestParams(max_tokens=1, temperature=0.0))[0][0] < 259
    loaded.lm_head.weight.data[259] = model.lm_head.weight[259]

    save_llama_as_hf(model, tmp_path / "hf")
    from_hf, run, _ = load_for_serving(tmp_path / "hf")
    assert torch.equal(_logits(from_hf, ids), _logits(model, ids)) and run == {"tokenizer": None}

    quantized, _, _ = load_for_serving(tmp_path / "run", quantize="int8")
    expected = Llama(model.config)
    expected.load_state_dict(model.state_dict())
    quantize_model(expected, "int8")
    assert isinstance(quantized.layers["0"].mlp.down_proj, QuantizedLinear)
    for name, tensor in expected.state_dict().items():
        assert torch.equal(quantized.state_dict()[name], tensor), name

    save_quantized(expected, tmp_path / "int8", run={"llama_config": dataclasses.asdict(model.config)})
    stored, _, _ = load_for_serving(tmp_path / "int8")
    assert torch.equal(_logits(stored, ids), _logits(expected.eval(), ids))
    with pytest.raises(ValueError, match="already quantized; leave out --quantize"):
        load_for_serving(tmp_path / "int8", quantize="int4")
    with pytest.raises(ValueError, match="is not a directory"):
        load_for_serving(tmp_path / "missing")

    engine = build_engine(stored, TOKENIZER, EngineOptions(max_batch_size=2))
    from colo.apps.serving import RequestParams

    prompts = [[5, 6, 7], [80, 81]]
    served = engine.generate(prompts, RequestParams(max_tokens=6, temperature=0))
    for prompt, tokens in zip(prompts, served, strict=True):
        assert tokens == continue_prompt(stored, prompt, max_new_tokens=6, eos_id=EOS)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--quantize", "int3"], "--quantize 'int3': use int8 or int4"),
        (["--group-size", "32"], "--group-size is for --quantize int4"),
        (["--tp", "2", "--quantize", "int8"], "quantized weights are not sharded"),
        (["--tp", "0"], "--tp=0 must be at least 1"),
        (["--max-concurrent", "0"], "--max-concurrent=0 must be >= 1"),
        (["--grace", "-1"], "--grace=-1.0 must be >= 0"),
        (["--max-prompt-tokens", "0"], "--max-prompt-tokens=0 must be >= 1"),
    ],
)
def test_colo_serve_refuses_bad_options_before_starting(tmp_path, args, message):
    result = CliRunner().invoke(app, ["serve", str(tmp_path), *args])
    assert result.exit_code == 2 and message in result.output, result.output


def test_colo_serve_names_a_checkpoint_it_cannot_load(tmp_path):
    result = CliRunner().invoke(app, ["serve", str(tmp_path / "nowhere"), "--port", "0"])
    assert result.exit_code == 2 and "is not a directory" in result.output, result.output


class _FailingEngine:
    """A stand-in engine whose forward fails on the first step (a broken GPU, a dead tensor-parallel rank)."""

    eos_ids = (EOS,)
    vocab_size = 260
    max_model_len = 64

    def __init__(self) -> None:
        self.queued: list[str] = []
        self.shut_down = False

    def add_request(self, request_id, prompt_ids, params) -> None:
        self.queued.append(request_id)

    def abort(self, request_id) -> None:
        pass

    def has_unfinished(self) -> bool:
        return bool(self.queued) and not self.shut_down

    def step(self):
        if self.shut_down:
            return []
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    def shutdown(self) -> None:
        self.shut_down = True


def test_an_engine_failure_answers_500_then_health_500_and_new_requests_503():
    import asyncio

    httpx = pytest.importorskip("httpx")
    pytest.importorskip("fastapi")
    from colo.apps.serving import ServeSettings, create_app

    engine = _FailingEngine()
    app = create_app(engine, TOKENIZER, settings=ServeSettings(model_name="tiny"))

    async def scenario():
        async with app.router.lifespan_context(app):
            transport = httpx.ASGITransport(app=app)
            async with httpx.AsyncClient(transport=transport, base_url="http://serve") as client:
                body = {"model": "tiny", "prompt": "hi", "max_tokens": 4}
                failed = await client.post("/v1/completions", json=body)
                streamed = await client.post("/v1/completions", json={**body, "stream": True})
                health = await client.get("/health")
                return failed, streamed, health
        # the lifespan's end shut the engine down

    failed, streamed, health = asyncio.run(scenario())
    assert failed.status_code == 500 and "illegal memory access" in failed.json()["error"]["message"]
    assert streamed.status_code == 503 and "the engine failed" in streamed.json()["error"]["message"]
    assert health.status_code == 500 and health.json()["error"]["code"] == 500
    assert engine.shut_down


def test_incremental_text_decodes_a_window_per_token_and_equals_the_whole_decode():
    from colo.apps.serving.text import IncrementalText

    text = "héllo wörld ✓ " * 40  # 1- to 3-byte characters, 720 byte tokens
    ids = TOKENIZER.encode(text)
    windows: list[int] = []

    def decode(window: list[int]) -> str:
        windows.append(len(window))
        return TOKENIZER.decode(window)

    incremental = IncrementalText(decode)
    deltas = [incremental.add([token]) for token in ids]
    assert "".join(deltas) == incremental.text == text
    assert all("\ufffd" not in delta for delta in deltas)
    assert max(windows) <= 4  # the settled token before a 3-byte character and its 3 bytes, never the whole text
    stream = TextStream(TOKENIZER, stop=("✓ h",))
    streamed = "".join(_stream_all(ids, stream, "✓ h"))
    assert streamed == text[: text.find("✓ h")]
