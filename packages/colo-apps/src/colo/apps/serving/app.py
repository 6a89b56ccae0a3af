"""The FastAPI application of `colo serve`: OpenAI's ``/v1/completions``, ``/v1/chat/completions`` (server-sent
events with ``stream``), ``/v1/models`` and ``/health``, over a `ServingEngine` driven by an `EngineLoop`.

Every error is OpenAI's JSON (``{"error": {"message", "type", "param", "code"}}``): 400 for a malformed or invalid
request (a request-body validation error included, where FastAPI would say 422) and for a prompt over
``max_prompt_tokens`` or one the engine refuses (prompt plus ``max_tokens`` over the model's length, ids outside the
vocabulary); 404 for another model's name; 429 when ``max_concurrent`` requests are in flight; 503 while the
server drains; 500 when the engine failed. A refused request never reaches the engine, so it disturbs no other.

Draining (`ServingState.drain`, on SIGTERM / SIGINT): new requests get 503 and ``/health`` turns 503; requests in
flight have ``grace`` seconds to finish; the rest are aborted: a streamed one receives a last SSE event holding an
error (OpenAI's client raises it as an ``APIError``), a whole one a 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
import time
import traceback
import uuid
from dataclasses import dataclass, field

from .engine import RequestParams
from .engine_loop import EngineFailure, EngineLoop
from .protocol import (
    ERROR_TYPES,
    ChatCompletionRequest,
    CompletionRequest,
    chat_logprobs,
    chunk_body,
    completion_body,
    completion_choice,
    completion_logprobs,
    error_body,
    usage,
)
from .text import TextStream

logger = logging.getLogger("colo.serve")


@dataclass(kw_only=True)
class ServeSettings:
    """The server's limits and names (``colo serve``'s options)."""

    model_name: str
    """The name clients send as ``model`` and ``/v1/models`` lists."""
    max_prompt_tokens: int | None = None
    """Longest prompt accepted, in tokens (``None``: the model's length less one generated token)."""
    max_concurrent: int = 64
    """Requests in flight at once; more get 429."""
    grace: float = 10.0
    """Seconds in-flight requests get to finish after SIGTERM / SIGINT."""
    idle_step_seconds: float | None = None
    """Step the idle engine this often (tensor parallelism); ``None``: only when requests are queued."""

    def __post_init__(self) -> None:
        if self.max_prompt_tokens is not None and self.max_prompt_tokens < 1:
            raise ValueError(f"max_prompt_tokens={self.max_prompt_tokens} must be >= 1")
        if self.max_concurrent < 1:
            raise ValueError(f"max_concurrent={self.max_concurrent} must be >= 1")
        if self.grace < 0:
            raise ValueError(f"grace={self.grace} must be >= 0 seconds")


class APIError(Exception):
    """An error answered in OpenAI's shape with ``status``."""

    def __init__(self, status: int, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param


@dataclass
class ServingState:
    """What the handlers share: the engine loop, the tokenizer, the chat template, the limits, the requests in
    flight and whether the server drains."""

    engine: object
    tokenizer: object
    chat_template: object | None
    settings: ServeSettings
    loop: EngineLoop | None = None
    draining: bool = False
    in_flight: set[str] = field(default_factory=set)
    cancelled_by_shutdown: set[str] = field(default_factory=set)
    started: float = field(default_factory=time.time)
    _ids: itertools.count = field(default_factory=itertools.count)

    @property
    def max_model_len(self) -> int:
        return int(self.engine.max_model_len)

    @property
    def max_prompt_tokens(self) -> int:
        limit = self.max_model_len - 1
        return min(limit, self.settings.max_prompt_tokens or limit)

    async def drain(self) -> None:
        """Refuse new requests (503), give the in-flight ones ``grace`` seconds, abort the rest and wait until
        their handlers have answered."""
        self.draining = True
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.grace
        while self.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.01)
        for request_id in list(self.in_flight):
            self.cancelled_by_shutdown.add(request_id)
            self.loop.abort(request_id)
        deadline = loop.time() + 10.0
        while self.in_flight and loop.time() < deadline:
            await asyncio.sleep(0.01)

    def new_id(self, prefix: str) -> str:
        return f"{prefix}-{uuid.uuid4().hex[:16]}{next(self._ids)}"


def _check_model(state: ServingState, name: str) -> None:
    if name != state.settings.model_name:
        raise APIError(
            404,
            f"The model {name!r} does not exist; this server serves {state.settings.model_name!r} (GET /v1/models)",
            param="model",
        )


def _prompt_ids(state: ServingState, request: CompletionRequest | ChatCompletionRequest) -> list[int]:
    tokenizer = state.tokenizer
    if isinstance(request, ChatCompletionRequest):
        if state.chat_template is None:
            raise APIError(
                400,
                "this model has no chat template (its checkpoint is not of an SFT run, data.task='sft'); use "
                "/v1/completions",
                param="messages",
            )
        messages = [{"role": m.role, "content": m.text()} for m in request.messages]
        try:
            ids, _ = state.chat_template.tokenize(messages, tokenizer, add_generation_prompt=True)
        except ValueError as error:
            raise APIError(400, f"messages: {error}", param="messages") from None
        return ids
    prompt = request.prompt
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    vocab = int(state.engine.vocab_size)
    bad = [t for t in prompt if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"prompt holds token id {bad[0]} outside the vocabulary [0, {vocab})", param="prompt")
    return list(prompt)


def _params(state: ServingState, request, prompt_len: int):
    max_tokens = request.max_tokens
    if isinstance(request, ChatCompletionRequest):
        max_tokens = max_tokens or request.max_completion_tokens or state.max_model_len - prompt_len
    elif max_tokens is None:
        max_tokens = 16
    if prompt_len + max_tokens > state.max_model_len:
        raise APIError(
            400,
            f"This model's maximum context length is {state.max_model_len} tokens; the request has {prompt_len} "
            f"prompt tokens and max_tokens={max_tokens} ({prompt_len + max_tokens} in all). Shorten the prompt or "
            "lower max_tokens.",
            param="max_tokens",
        )
    try:
        return RequestParams(
            max_tokens=max_tokens,
            temperature=request.temperature,
            top_p=request.top_p,
            top_k=request.top_k,
            stop=tuple(request.stop),
            seed=request.seed,
            ignore_eos=request.ignore_eos,
            logprobs=_num_logprobs(request),
        )
    except ValueError as error:
        raise APIError(400, str(error)) from None


def _num_logprobs(request) -> int | None:
    """`RequestParams.logprobs` of a request: chat's ``logprobs`` + ``top_logprobs``, completions' ``logprobs``."""
    if isinstance(request, ChatCompletionRequest):
        return (request.top_logprobs or 0) if request.logprobs else None
    return request.logprobs


def _logprobs_body(entries, tokenizer, *, chat: bool, text_offset: int = 0) -> dict:
    """The choice's ``logprobs`` for `TokenLogprob` entries in the endpoint's shape."""

    def decode(token_id: int) -> str:
        return tokenizer.decode([token_id])

    return chat_logprobs(entries, decode) if chat else completion_logprobs(entries, decode, text_offset)


def _sse(body: dict) -> str:
    return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"


def create_app(engine, tokenizer, *, settings: ServeSettings, chat_template=None):
    """The FastAPI application serving ``engine``.

    Args:
        engine: a `colo.apps.serving.ServingEngine` (rank 0's under tensor parallelism).
        tokenizer: the run's tokenizer (``encode`` / ``decode``, ``eos_id``).
        settings (ServeSettings): names and limits.
        chat_template: the run's `colo.apps.data.ChatTemplate`; ``None``: ``/v1/chat/completions`` answers 400.

    Returns:
        fastapi.FastAPI: the app; ``app.state.serving`` is its `ServingState`. Its lifespan starts the engine
        thread and stops it (shutting the engine down).
    """
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, StreamingResponse

    state = ServingState(engine=engine, tokenizer=tokenizer, chat_template=chat_template, settings=settings)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        state.loop = EngineLoop(
            engine,
            asyncio.get_running_loop(),
            idle_step_seconds=settings.idle_step_seconds,
            on_finished=state.in_flight.discard,  # also when a stream's client left before its first chunk
        )
        state.loop.start()
        try:
            yield
        finally:
            await asyncio.to_thread(state.loop.stop)

    app = FastAPI(title="colo serve", lifespan=lifespan)
    app.state.serving = state

    def error_response(status: int, message: str, param: str | None = None) -> JSONResponse:
        return JSONResponse(
            error_body(message, kind=ERROR_TYPES.get(status, "error"), param=param, code=status), status
        )

    @app.exception_handler(APIError)
    async def _api_error(request: Request, error: APIError):
        return error_response(error.status, error.message, error.param)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, error: Exception):
        logger.error("colo serve: %s failed:\n%s", request.url.path, traceback.format_exc())
        return error_response(500, f"internal error: {type(error).__name__}: {error}")

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, error: RequestValidationError):
        problems = []
        param = None
        for item in error.errors():
            loc = [part for part in item.get("loc", ()) if part != "body"]
            if item.get("type") == "json_invalid":  # its loc is a character offset, not a field: no param
                at = f" at character {loc[0]}" if loc else ""
                problems.append(f"the body is not valid JSON{at}: {item.get('ctx', {}).get('error', item.get('msg'))}")
                continue
            where = ".".join(str(part) for part in loc)
            param = param or where or None
            problems.append(f"{where or 'body'}: {item.get('msg')}")
        return error_response(400, "invalid request: " + "; ".join(problems), param)

    @app.get("/health")
    async def health():
        if state.loop is not None and state.loop.failure is not None:
            return error_response(500, state.loop.failure)
        if state.draining:
            return error_response(503, "the server is shutting down")
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": settings.model_name,
                    "object": "model",
                    "created": int(state.started),
                    "owned_by": "colo",
                    "max_model_len": state.max_model_len,
                }
            ],
        }

    async def run(request, *, chat: bool):
        if state.draining:
            raise APIError(503, "the server is shutting down; not accepting new requests")
        _check_model(state, request.model)
        prompt_ids = _prompt_ids(state, request)
        if len(prompt_ids) > state.max_prompt_tokens:
            raise APIError(
                400,
                f"the prompt has {len(prompt_ids)} tokens; this server accepts at most {state.max_prompt_tokens} "
                "(--max-prompt-tokens); shorten it",
                param="messages" if chat else "prompt",
            )
        params = _params(state, request, len(prompt_ids))
        if len(state.in_flight) + request.n > settings.max_concurrent:
            asked = f"; this one asks for {request.n} choices" if request.n > 1 else ""
            raise APIError(
                429,
                f"{len(state.in_flight)} of {settings.max_concurrent} sequences are in flight (--max-concurrent)"
                f"{asked}; retry later",
            )
        request_id = state.new_id("chatcmpl" if chat else "cmpl")
        hidden = {*engine.eos_ids} if not params.ignore_eos else set()
        queue, choices = _submit_choices(state, request_id, prompt_ids, params, request.n, hidden)
        echo = ""
        if not chat and request.echo:
            echo = request.prompt if isinstance(request.prompt, str) else tokenizer.decode(prompt_ids)
        extra_ids = {"prompt_token_ids": prompt_ids} if request.return_token_ids else {}
        if request.stream:
            include_usage = request.stream_options is not None and request.stream_options.include_usage
            return StreamingResponse(
                _events(state, request_id, queue, choices, chat=chat, model=request.model, echo=echo,
                        include_usage=include_usage, extra_ids=extra_ids, logprobs=params.logprobs is not None),
                media_type="text/event-stream",
            )  # fmt: skip
        try:
            await _collect(state, queue, choices)
        finally:
            state.in_flight.difference_update(choices)
        bodies = []
        for choice in choices.values():
            final = choice.final
            extra = {**extra_ids, "token_ids": choice.text.token_ids} if request.return_token_ids else {}
            logprobs = _logprobs_body(choice.logprobs, tokenizer, chat=chat) if params.logprobs is not None else None
            bodies.append(completion_choice(
                choice.index, text=echo + choice.text.text(final.stop_string), finish_reason=final.finish_reason,
                extra=extra, chat=chat, logprobs=logprobs,
            ))  # fmt: skip
        body = completion_body(request_id, request.model, choices=bodies, chat=chat)
        body["usage"] = _usage(choices)
        return body

    @app.post("/v1/completions")
    async def completions(request: CompletionRequest):
        return await run(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: ChatCompletionRequest):
        return await run(request, chat=True)

    return app


@dataclass(eq=False)
class _Choice:
    """One of a request's ``n`` choices: its engine request, its text and log-prob entries, its last output."""

    index: int
    engine_id: str
    text: TextStream
    logprobs: list = field(default_factory=list)
    final: object | None = None  # its last `RequestOutput`, once finished
    text_offset: int = 0  # a streamed completion: characters sent before its next chunk's tokens


def _submit_choices(state: ServingState, request_id: str, prompt_ids: list[int], params, n: int, hidden: set[int]):
    """Queue the ``n`` engine requests of a request, delivering into one queue; that queue and
    ``{engine id: _Choice}``.

    The choices are separate engine requests with the same prompt: the prefix cache shares the prompt's full blocks
    among them (computed by the first forward that writes them), so the prompt is prefilled once, less the
    partial last block each choice feeds itself (vLLM's V1 engine fans ``n`` out the same way). With a seed,
    choice ``i`` samples with ``seed + i``."""
    queue: asyncio.Queue = asyncio.Queue()
    choices: dict[str, _Choice] = {}
    for index in range(n):
        engine_id = request_id if n == 1 else f"{request_id}-{index}"
        choice_params = params
        if params.seed is not None and index:
            choice_params = dataclasses.replace(params, seed=params.seed + index)
        try:
            state.loop.submit(engine_id, prompt_ids, choice_params, queue=queue)
        except (ValueError, RuntimeError) as error:
            for submitted in choices:
                state.loop.abort(submitted)
            raise APIError(400 if isinstance(error, ValueError) else 503, str(error)) from None
        state.in_flight.add(engine_id)
        choices[engine_id] = _Choice(index, engine_id, TextStream(state.tokenizer, stop=params.stop, hidden_ids=hidden))
    return queue, choices


def _usage(choices: dict[str, _Choice]) -> dict:
    """The request's ``usage``: the prompt once, the completion tokens of every choice, the prompt tokens cached
    for the choice that had the fewest (the prompt as the request first found it)."""
    finals = [choice.final for choice in choices.values()]
    return usage(
        finals[0].prompt_tokens,
        sum(final.completion_tokens for final in finals),
        min(final.cached_prompt_tokens for final in finals),
    )


async def _outputs(state: ServingState, queue: asyncio.Queue, choices: dict[str, _Choice]):
    """The engine outputs of a request's choices as they arrive, ``(choice, output)``, until every choice has
    finished; an `APIError` for an engine failure. A choice that has not finished when this ends early (a client
    gone, another choice failed) is aborted."""
    pending = set(choices)
    try:
        while pending:
            item = await queue.get()
            if isinstance(item, EngineFailure):
                raise APIError(500, item.message)
            choice = choices[item.request_id]
            if item.finished:
                pending.discard(item.request_id)
                choice.final = item
            yield choice, item
    finally:
        for engine_id in pending:  # the handler was cancelled (client gone) or failed: free the engine's rows
            state.loop.abort(engine_id)


async def _collect(state: ServingState, queue: asyncio.Queue, choices: dict[str, _Choice]) -> None:
    """Wait for a whole request: each choice's tokens go to its ``text``, its `TokenLogprob` entries to its
    ``logprobs``, its last `RequestOutput` to its ``final``."""
    async with contextlib.aclosing(_outputs(state, queue, choices)) as outputs:
        async for choice, item in outputs:
            choice.text.token_ids.extend(item.new_token_ids)
            choice.logprobs.extend(item.logprobs or ())
            if item.finished and item.finish_reason == "abort":
                raise APIError(503, _cancelled_message(state, item.request_id))


def _cancelled_message(state: ServingState, request_id: str) -> str:
    if request_id in state.cancelled_by_shutdown:
        return (
            f"the server shut down and cancelled this request: it did not finish within the {state.settings.grace} s "
            "grace period (--grace)"
        )
    return "the request was aborted"


async def _events(
    state: ServingState,
    request_id: str,
    queue: asyncio.Queue,
    choices: dict[str, _Choice],
    *,
    chat: bool,
    model: str,
    echo: str,
    include_usage: bool,
    extra_ids: dict,
    logprobs: bool = False,
):
    """The server-sent events of one streamed request: a chunk per step and choice with new text (or new tokens,
    with ``logprobs``: each chunk carries its tokens' log-probs), each choice's last with its finish reason, the
    usage chunk if asked, ``[DONE]``; an aborted or failed request ends with an error event instead."""
    created = int(time.time())
    for choice in choices.values():
        choice.text_offset = len(echo)

    def chunk(choice: _Choice, delta: str | None, reason: str | None = None, *, first: bool = False,
              ids: list[int] | None = None, entries=None):  # fmt: skip
        extra = {**extra_ids, "token_ids": ids} if extra_ids else None
        body_logprobs = None
        if logprobs and entries is not None:
            body_logprobs = _logprobs_body(entries, state.tokenizer, chat=chat, text_offset=choice.text_offset)
            if not chat:
                choice.text_offset += sum(len(token) for token in body_logprobs["tokens"])
        body = chunk_body(request_id, model, created, text=delta, finish_reason=reason, chat=chat, first=first,
                          extra=extra, logprobs=body_logprobs, index=choice.index)  # fmt: skip
        if include_usage:
            body["usage"] = None
        return _sse(body)

    try:
        if chat or echo:
            for choice in choices.values():
                yield chunk(choice, echo or None, first=True, ids=[])
        try:
            async with contextlib.aclosing(_outputs(state, queue, choices)) as outputs:
                async for choice, item in outputs:
                    if item.finished and item.finish_reason == "abort":
                        message = _cancelled_message(state, item.request_id)
                        yield _sse(error_body(message, kind=ERROR_TYPES[503], code=503))
                        return
                    delta = choice.text.add(item.new_token_ids)
                    if item.finished:
                        delta += choice.text.finish(item.stop_string)
                        yield chunk(choice, delta, item.finish_reason, ids=list(item.new_token_ids),
                                    entries=item.logprobs or [])  # fmt: skip
                    elif delta or extra_ids or (logprobs and item.new_token_ids):
                        yield chunk(choice, delta, ids=list(item.new_token_ids), entries=item.logprobs or [])
        except APIError as error:  # the engine failed
            yield _sse(error_body(error.message, kind=ERROR_TYPES[error.status], code=error.status))
            return
        if include_usage:
            body = {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion",
                    "created": created, "model": model, "choices": [], "usage": _usage(choices)}  # fmt: skip
            yield _sse(body)
        yield "data: [DONE]\n\n"
    finally:
        state.in_flight.difference_update(choices)
