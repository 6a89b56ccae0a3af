"""``colo serve``: an OpenAI-compatible HTTP server for a checkpoint (`colo.apps.serving`)."""

from __future__ import annotations

import os
import signal
import sys
from typing import Annotated

import typer


def serve(
    checkpoint: Annotated[
        str,
        typer.Argument(
            help="A colo run checkpoint, a quantized one (`colo convert --quantize`) or a Hugging Face Llama directory."
        ),
    ],
    quantize: Annotated[
        str | None, typer.Option(help="Quantize the weights when loading: int8 or int4 (weight-only; --tp 1).")
    ] = None,
    group_size: Annotated[
        int | None, typer.Option(help="With --quantize int4: input columns per scale, 32, 64 or 128.")
    ] = None,
    tp: Annotated[int, typer.Option(help="Tensor-parallel ranks on this machine (rank 0 serves HTTP).")] = 1,
    host: Annotated[str, typer.Option(help="Address to bind; loopback unless you mean to expose it.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port.")] = 8000,
    grace: Annotated[
        float, typer.Option(help="On SIGTERM / SIGINT: seconds in-flight requests get to finish before cancelling.")
    ] = 10.0,
    max_concurrent: Annotated[
        int, typer.Option("--max-concurrent", help="Requests in flight at once; more are answered 429.")
    ] = 64,
    max_prompt_tokens: Annotated[
        int | None,
        typer.Option(
            "--max-prompt-tokens", help="Longest prompt in tokens (default: the model's length - 1); 400 past it."
        ),
    ] = None,
    model_name: Annotated[
        str | None, typer.Option("--model-name", help="The model's name in the API (default: the directory's name).")
    ] = None,
    tokenizer: Annotated[
        str | None, typer.Option(help="Tokenizer path (default: the run's; a Hugging Face directory's own).")
    ] = None,
    max_batch_size: Annotated[int, typer.Option("--max-batch-size", help="Requests decoded together.")] = 16,
    max_model_len: Annotated[
        int | None,
        typer.Option("--max-model-len", help="Prompt + generated tokens per request (default: the model's window)."),
    ] = None,
    kv_cache_mb: Annotated[
        float | None,
        typer.Option("--kv-cache-mb", help="KV-cache budget per rank in MiB (default: max-batch-size full requests)."),
    ] = None,
    prefix_caching: Annotated[
        bool,
        typer.Option(
            "--prefix-caching/--no-prefix-caching",
            help="Reuse the KV blocks of prompts' shared leading blocks (a system prompt) instead of recomputing them.",
        ),
    ] = True,
    max_tokens_per_step: Annotated[
        int | None,
        typer.Option(
            "--max-tokens-per-step",
            help="Tokens fed per engine step (>= --max-batch-size): long prompts are prefilled in chunks while the "
            "others decode (default: no bound).",
        ),
    ] = None,
    log_level: Annotated[str, typer.Option("--log-level", help="uvicorn's log level.")] = "warning",
) -> None:
    """Serve a checkpoint behind OpenAI's API: /v1/completions, /v1/chat/completions (the run's chat template),
    streaming (SSE), /v1/models, /health.

    Continuous batching over a paged KV cache (colo.apps.serving.ServingEngine). Limits: --max-prompt-tokens
    (400 past it), --max-concurrent (429). SIGTERM or Ctrl-C drains: new requests get 503, in-flight ones get
    --grace seconds, then are cancelled (streams end with an error event); the command exits 0.

    Example: colo serve runs/sft/checkpoints/step-00000300 --port 8000, then
    OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none").chat.completions.create(model="step-00000300", ...)
    """

    def fail(message: str) -> typer.Exit:
        typer.echo(f"colo serve: {message}", err=True)
        return typer.Exit(2)

    if tp < 1:
        raise fail(f"--tp={tp} must be at least 1")
    if not 0 <= port <= 65535:
        raise fail(f"--port={port} must be in 0..65535")
    if quantize is not None and quantize not in ("int8", "int4"):
        raise fail(f"--quantize {quantize!r}: use int8 or int4")
    if group_size is not None and quantize != "int4":
        raise fail("--group-size is for --quantize int4")
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise fail("serving needs FastAPI and uvicorn: pip install 'colo-apps[serve]'") from None
    from colo.tensor.checkpoint import CheckpointError

    from ..runs import chat_template_of
    from ..serving import ServeSettings, create_app, load_rank, serve_app
    from ..serving.server import start_followers, stop_followers

    if tp > 1 and quantize is not None:
        raise fail("--quantize serves on one rank: quantized weights are not sharded; use --tp 1")
    for name, value, least in (
        ("--max-concurrent", max_concurrent, 1),
        ("--max-prompt-tokens", max_prompt_tokens, 1),
        ("--max-batch-size", max_batch_size, 1),
        ("--grace", grace, 0),
    ):
        if value is not None and value < least:
            raise fail(f"{name}={value} must be >= {least}")
    settings = ServeSettings(
        model_name=model_name or os.path.basename(os.path.normpath(checkpoint)),
        max_prompt_tokens=max_prompt_tokens,
        max_concurrent=max_concurrent,
        grace=grace,
        idle_step_seconds=0.05 if tp > 1 else None,
    )
    spec = {
        "checkpoint": checkpoint,
        "quantize": quantize,
        "group_size": group_size,
        "tokenizer": tokenizer,
        "tp": tp,
        "engine": {
            "max_batch_size": max_batch_size,
            "max_model_len": max_model_len,
            "kv_cache_bytes": None if kv_cache_mb is None else int(kv_cache_mb * 2**20),
            "enable_prefix_caching": prefix_caching,
            "max_tokens_per_step": max_tokens_per_step,
        },
    }
    followers = []
    if tp > 1:
        followers, env = start_followers(spec, tp=tp)
        os.environ.update(env)
    try:
        engine, run, tok = load_rank(spec)
    except (ValueError, TypeError, CheckpointError, FileNotFoundError) as error:
        for process in followers:
            process.kill()
        raise fail(str(error)) from None
    app = create_app(engine, tok, settings=settings, chat_template=chat_template_of(run))
    print(
        f"colo serve: {settings.model_name} (tp={tp}, max_model_len={engine.max_model_len}) on http://{host}:{port}/v1",
        file=sys.stderr,
        flush=True,
    )
    serve_app(app, host=host, port=port, log_level=log_level)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # drained and closed: a repeated SIGTERM must not kill the exit
    code = stop_followers(followers)
    if code:
        raise typer.Exit(1)
