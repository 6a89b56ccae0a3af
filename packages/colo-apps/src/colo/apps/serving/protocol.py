"""The OpenAI wire format `colo serve` speaks: request models (validated by pydantic, unknown fields refused), the
response and stream-chunk bodies, and OpenAI's error shape ``{"error": {"message", "type", "param", "code"}}``.

Only what the engine implements is accepted: one prompt per request (``n`` choices of it), log-probs of the
generated tokens (not of an echoed prompt), no penalties, no ``logit_bias``. Those fields are named in the models so
that a client sending them gets a 400 that says what is unsupported, instead of a silently different result. Two
extensions follow vLLM's names: ``top_k`` and ``ignore_eos``, and ``return_token_ids`` adds ``prompt_token_ids`` /
``token_ids`` to the choices.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MAX_CHOICES = 16
"""The most choices (``n``) one request may ask for."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Strict):
    """``stream_options``: ``include_usage`` sends a last chunk with the usage and no choices."""

    include_usage: bool = False
    """Send the token counts in a last chunk before ``[DONE]``."""


class SamplingFields(_Strict):
    """The sampling fields both endpoints share (OpenAI's names, defaults and ranges; ``top_k`` and ``ignore_eos`` as
    vLLM spells them)."""

    model: str
    """The served model's name (``/v1/models``)."""
    max_tokens: int | None = Field(default=None, ge=1)
    """Most new tokens (default: 16 for completions, up to the model's window for chat)."""
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    """0: greedy; else the softmax temperature."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus sampling mass."""
    top_k: int = Field(default=0, ge=0)
    """Sample from the K most likely tokens (0: all). Not in OpenAI's API; vLLM's extension."""
    n: int = Field(default=1, ge=1, le=MAX_CHOICES)
    """Choices per request: ``n`` completions of the prompt, which is computed once (the choices share its cached
    blocks). With a ``seed``, choice ``i`` samples with ``seed + i``."""
    stop: str | list[str] | None = Field(default=None, validate_default=True)
    """Up to 4 strings that end the completion; the returned text stops before the first one."""
    seed: int | None = None
    """Seed of this request's sampling: the same seed and request give the same tokens, whatever else runs."""
    stream: bool = False
    """Send server-sent events, one chunk per engine step, ending with ``data: [DONE]``."""
    stream_options: StreamOptions | None = None
    """With ``stream``: ``{"include_usage": true}`` for a final usage chunk."""
    ignore_eos: bool = False
    """Keep generating past the eos token (benchmarks). vLLM's extension."""
    return_token_ids: bool = False
    """Add ``prompt_token_ids`` and ``token_ids`` to each choice (and chunk). vLLM's extension."""
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    """Ignored (OpenAI's end-user id)."""

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, value):
        stops = [value] if isinstance(value, str) else list(value or [])
        if len(stops) > 4:
            raise ValueError(f"at most 4 stop strings, got {len(stops)}")
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return stops

    @model_validator(mode="after")
    def _supported(self):
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) != 0.0:
                raise ValueError(f"{name} is not supported by colo serve; leave it at 0")
        if self.logit_bias:
            raise ValueError("logit_bias is not supported by colo serve; leave it out")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        return self


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``."""

    prompt: str | list[int] | list[str] | list[list[int]]
    """One prompt: text, or token ids (a list of one text or one id list is accepted too)."""
    echo: bool = False
    """Return the prompt text before the completion."""
    logprobs: int | None = Field(default=None, ge=0, le=20)
    """Each generated token's log-probability and the ``logprobs`` most likely tokens' at its step."""
    best_of: int | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _one_prompt(self):
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise ValueError(
                    f"prompt: got {len(prompt)} prompts; colo serve takes one prompt per request (send several "
                    "requests: they are batched on the server)"
                )
            self.prompt = prompt[0]
        if isinstance(self.prompt, (str, list)) and len(self.prompt) == 0:
            raise ValueError("prompt is empty; give at least one character or token id")
        if self.logprobs is not None and self.echo:
            raise ValueError("logprobs with echo (the prompt's log-probs) is not supported by colo serve; drop one")
        if self.best_of not in (None, 1):
            raise ValueError("best_of is not supported by colo serve; leave it out or set it to 1")
        if self.suffix:
            raise ValueError("suffix (insertion) is not supported by colo serve; leave it out")
        return self


class TextPart(_Strict):
    """A ``{"type": "text", "text": ...}`` part of a message's content."""

    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    """A message of a conversation."""

    role: str
    content: str | list[TextPart]
    name: str | None = None

    def text(self) -> str:
        """The content as one string (text parts joined)."""
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    """The conversation so far; rendered by the run's chat template with the assistant's marker at the end."""
    max_completion_tokens: int | None = Field(default=None, ge=1)
    """OpenAI's newer name for ``max_tokens``."""
    logprobs: bool = False
    """Return each generated token's log-probability."""
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    """With ``logprobs``: the most likely tokens at each step and their log-probabilities, this many."""

    @model_validator(mode="after")
    def _chat_supported(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("give max_tokens or max_completion_tokens, not both")
        return self


def error_body(message: str, *, kind: str = "invalid_request_error", param: str | None = None, code=None) -> dict:
    """OpenAI's error JSON."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


ERROR_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    429: "rate_limit_exceeded",
    500: "internal_server_error",
    503: "service_unavailable",
}


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's ``usage`` object (``prompt_tokens_details.cached_tokens``: prompt tokens the prefix cache held)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def completion_logprobs(entries, decode, text_offset: int = 0) -> dict:
    """A completion choice's ``logprobs``: ``tokens``, ``token_logprobs``, ``top_logprobs`` (token text -> log-prob)
    and ``text_offset``, from `colo.apps.serving.TokenLogprob` entries; ``decode(id)`` is one token's text."""
    tokens = [decode(entry.token_id) for entry in entries]
    offsets = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [entry.logprob for entry in entries],
        "top_logprobs": [{decode(token_id): logprob for token_id, logprob in entry.top} for entry in entries],
        "text_offset": offsets,
    }


def chat_logprobs(entries, decode) -> dict:
    """A chat choice's ``logprobs``: ``content``, one ``{token, logprob, bytes, top_logprobs}`` per token."""

    def item(token_id: int, logprob: float) -> dict:
        token = decode(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return {
        "content": [
            {**item(entry.token_id, entry.logprob), "top_logprobs": [item(t, lp) for t, lp in entry.top]}
            for entry in entries
        ]
    }


def completion_choice(
    index: int,
    *,
    text: str,
    finish_reason: str | None,
    extra: dict[str, Any],
    chat: bool,
    logprobs: dict | None = None,
) -> dict:
    """One choice of a whole (non-streamed) response. ``extra``: more fields of the choice (token ids);
    ``logprobs``: the choice's (`completion_logprobs` / `chat_logprobs`)."""
    if chat:
        choice = {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": logprobs}
    else:
        choice = {"index": index, "text": text, "logprobs": logprobs}
    choice.update(finish_reason=finish_reason, **extra)
    return choice


def completion_body(request_id: str, model: str, *, choices: list[dict], chat: bool) -> dict:
    """A whole (non-streamed) response, ``text_completion`` or ``chat.completion``, of `completion_choice` items."""
    return {
        "id": request_id,
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": choices,
    }


def chunk_body(
    request_id: str,
    model: str,
    created: int,
    *,
    text: str | None,
    finish_reason: str | None,
    chat: bool,
    first: bool = False,
    extra: dict[str, Any] | None = None,
    logprobs: dict | None = None,
    index: int = 0,
) -> dict:
    """One streamed chunk of choice ``index``. Chat chunks carry a ``delta`` (the first one the assistant's role);
    completion chunks the new text. ``logprobs``: those of the chunk's tokens."""
    if chat:
        delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else {}
        if text:
            delta["content"] = text
        choice = {"index": index, "delta": delta, "logprobs": logprobs}
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs}
    choice["finish_reason"] = finish_reason
    choice.update(extra or {})
    return {
        "id": request_id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": created,
        "model": model,
        "choices": [choice],
    }
