"""colo.apps.serving: `colo serve`, an OpenAI-compatible HTTP server over the continuous-batching `ServingEngine`.

- `ServingEngine(model, ...)` (`engine.py`): continuous batching over a paged KV cache
  (`colo.apps.generation.PagedKVCache`, with automatic prefix caching) and optional chunked prefill, with
  per-request `RequestParams` (temperature / top-p / top-k, max tokens, stop strings and ids, seed, log-probs),
  reporting a `RequestOutput` per request and step.
- `create_app(engine, tokenizer, settings=ServeSettings(...), chat_template=...)`: the FastAPI app with
  ``/v1/completions``, ``/v1/chat/completions`` (SSE streaming), ``/v1/models`` and ``/health``; limits on prompt
  length and concurrent requests; graceful draining (`ServingState.drain`).
- `EngineLoop`: the thread stepping the engine and handing outputs to the request handlers.
- `load_for_serving` / `load_rank`: a run, quantized or Hugging Face checkpoint as a model (what `colo generate`
  loads too), optionally quantized, sharded over ``tp`` ranks.
- `serve_app`: uvicorn with colo's SIGTERM / SIGINT draining.

FastAPI and uvicorn are the ``serve`` extra (``pip install 'colo-apps[serve]'``), imported only when serving.
"""

from .app import ServeSettings, ServingState, create_app
from .engine import RequestOutput, RequestParams, ServingEngine, TokenLogprob
from .engine_loop import EngineLoop
from .model import EngineOptions, load_for_serving, load_rank
from .server import serve_app
from .text import TextStream

__all__ = [
    "EngineLoop",
    "EngineOptions",
    "RequestOutput",
    "RequestParams",
    "ServeSettings",
    "ServingEngine",
    "ServingState",
    "TextStream",
    "TokenLogprob",
    "create_app",
    "load_for_serving",
    "load_rank",
    "serve_app",
]
