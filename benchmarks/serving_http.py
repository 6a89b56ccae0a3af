#!/usr/bin/env python3
"""`benchmarks/serving.py` with one more row: ``colo-http``, the same workload through `colo serve`'s HTTP server.

The server is the one `colo serve` runs (`colo.apps.serving.create_app` over a `ServingEngine` with the settings of
the ``colo`` row: ``max_batch_size`` 16, 16 x 8 blocks of 16 tokens), on uvicorn in a thread of this process, one per
format, started before the timed runs. ``C`` client threads (one ``httpx.Client`` each) post their request at once
to ``/v1/completions`` with the prompt as token ids, ``temperature`` 0, ``ignore_eos`` and ``return_token_ids``; a
request's latency is from the start to its response. The row therefore adds to ``colo`` what serving over HTTP
costs: JSON, the event loop, the hand-off between the engine thread and the handlers, and the clients' threads
competing for the same CPU. Its tokens must equal the ``colo`` fp32 row's in fp32 (``=colo fp32`` column).

Run::

    OMP_NUM_THREADS=1 python benchmarks/serving_http.py [--engines colo colo-http hf-sequential] [--repeats 3]

Writes ``benchmarks/results/serving_http_cpu.json`` unless ``--out`` is given.
"""

from __future__ import annotations

import concurrent.futures
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serving  # noqa: E402
from zero_dp import RESULTS  # noqa: E402

_SERVERS: dict[int, str] = {}
"""id(native model) -> the base URL of the server running it."""


def _start_server(model) -> str:
    import uvicorn

    from colo.apps.data import load_tokenizer
    from colo.apps.serving import InVocabularyTokenizer, ServeSettings, ServingEngine, create_app
    from colo.comm import find_free_port

    tokenizer = InVocabularyTokenizer(load_tokenizer(None))  # prompts are ids: text is only for the response
    engine = ServingEngine(model, eos_token_id=tokenizer.eos_id, max_batch_size=16, block_size=16, num_blocks=16 * 8)
    app = create_app(engine, tokenizer, settings=ServeSettings(model_name="bench", max_concurrent=64))
    port = find_free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False))
    threading.Thread(target=server.run, name="colo-http-bench", daemon=True).start()
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline:
            raise RuntimeError("the benchmark's colo serve app did not start within 60 s")
        time.sleep(0.01)
    return f"http://127.0.0.1:{port}"


def run_colo_http(models, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[float], list[list[int]]]:
    """Every request posted at once by its own client thread to `colo serve`'s ``/v1/completions``."""
    import httpx

    model = models["native"]
    if id(model) not in _SERVERS:
        _SERVERS[id(model)] = _start_server(model)
    url = _SERVERS[id(model)] + "/v1/completions"
    clients = [httpx.Client(timeout=600) for _ in prompts]
    barrier = threading.Barrier(len(prompts) + 1)

    def request(index: int) -> tuple[float, list[int]]:
        body = {"model": "bench", "prompt": prompts[index], "max_tokens": new_tokens, "temperature": 0,
                "ignore_eos": True, "return_token_ids": True}  # fmt: skip
        barrier.wait()
        response = clients[index].post(url, json=body)
        response.raise_for_status()
        return time.perf_counter(), response.json()["choices"][0]["token_ids"]

    with concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(request, index) for index in range(len(prompts))]
        barrier.wait()
        start = time.perf_counter()
        results = [future.result() for future in futures]
    for client in clients:
        client.close()
    seconds = max(done for done, _ in results) - start
    return seconds, [done - start for done, _ in results], [tokens for _, tokens in results]


serving.ENGINES["colo-http"] = run_colo_http

if __name__ == "__main__":
    if not any(arg == "--out" or arg.startswith("--out=") for arg in sys.argv[1:]):
        sys.argv += ["--out", str(RESULTS / "serving_http_cpu.json")]
    raise SystemExit(serving.main())
