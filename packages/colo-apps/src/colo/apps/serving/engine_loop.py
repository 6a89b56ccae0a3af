"""The thread that drives a `ServingEngine` and hands each request's outputs to the asyncio handler waiting for them.

The HTTP handlers run on the event loop's thread; ``engine.step()`` (a model forward) runs on this one, so the server
keeps answering while the model computes. Requests enter through `EngineLoop.submit` (``engine.add_request`` is
thread-safe; a bad request raises its `ValueError` right there, before anything is queued), and each step's
`RequestOutput` goes back with ``loop.call_soon_threadsafe`` into the request's `asyncio.Queue`.

Under tensor parallelism the followers block in the broadcast that opens every ``step()``; an idle rank 0 therefore
keeps stepping every ``idle_step_seconds`` (an empty step: one small broadcast), so no collective waits long enough
to time out.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import traceback

logger = logging.getLogger("colo.serve")


class EngineFailure:
    """Put in a request's queue when ``engine.step()`` raised: the server answers 500 with ``message``."""

    def __init__(self, message: str) -> None:
        self.message = message


class EngineLoop:
    """Run ``engine.step()`` on a thread while requests are unfinished; deliver outputs to per-request queues.

    Args:
        engine: a `colo.apps.serving.ServingEngine` (rank 0's under tensor parallelism).
        loop (asyncio.AbstractEventLoop): the event loop of the handlers.
        idle_step_seconds (float | None): step this often while idle (tensor parallelism: keeps the followers'
            collectives alive); ``None``: sleep until a request arrives. Default: ``None``.
        on_finished: called on the event loop with the id of each request the engine finished (whether or not its
            handler is still reading), e.g. to release its concurrency slot. Default: ``None``.
    """

    def __init__(
        self, engine, loop: asyncio.AbstractEventLoop, *, idle_step_seconds: float | None = None, on_finished=None
    ) -> None:
        self.engine = engine
        self._loop = loop
        self._idle = idle_step_seconds
        self._on_finished = on_finished
        self._queues: dict[str, asyncio.Queue] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self.failure: str | None = None
        """The error of a failed ``step()``; the server is unhealthy from then on."""
        self._thread = threading.Thread(target=self._run, name="colo-serve-engine", daemon=True)

    def start(self) -> None:
        """Start the thread."""
        self._thread.start()

    def submit(self, request_id: str, prompt_ids: list[int], params, *, queue: asyncio.Queue | None = None):
        """Queue a request; return the queue its outputs arrive in (call from the event loop). ``queue``: deliver
        into this one (several requests may share a queue: each output names its request); ``None``: a new one.

        Raises:
            ValueError: the engine refused the request (its message says why); nothing was queued.
            RuntimeError: the engine failed or is stopping.
        """
        if self.failure is not None or self._stopping:
            raise RuntimeError(self.failure or "the engine is shutting down")
        queue = asyncio.Queue() if queue is None else queue
        with self._lock:
            self._queues[request_id] = queue
        try:
            self.engine.add_request(request_id, prompt_ids, params)
        except BaseException:
            with self._lock:
                self._queues.pop(request_id, None)
            raise
        self._wake.set()
        return queue

    def abort(self, request_id: str) -> None:
        """Stop a request; its queue receives the ``"abort"`` output at the next step."""
        with self._lock:
            known = request_id in self._queues
        if known:
            self.engine.abort(request_id)
            self._wake.set()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop stepping and shut the engine down (under tensor parallelism this releases the followers)."""
        self._stopping = True
        self._wake.set()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _deliver(self, request_id: str, item) -> None:
        queue = self._queues.get(request_id)
        if queue is not None:
            self._loop.call_soon_threadsafe(queue.put_nowait, item)

    def _run(self) -> None:
        try:
            while not self._stopping:
                if not self.engine.has_unfinished():
                    self._wake.wait(self._idle)
                    self._wake.clear()
                    if self._stopping:
                        break
                    if self._idle is None and not self.engine.has_unfinished():
                        continue
                for output in self.engine.step():
                    with self._lock:
                        self._deliver(output.request_id, output)
                        if output.finished:
                            self._queues.pop(output.request_id, None)
                            if self._on_finished is not None:
                                self._loop.call_soon_threadsafe(self._on_finished, output.request_id)
        except Exception as error:  # a failed forward: fail every waiting request, report unhealthy
            logger.error("colo serve: the engine failed:\n%s", traceback.format_exc())
            self.failure = f"the engine failed: {type(error).__name__}: {error}"
            with self._lock:
                for request_id in list(self._queues):
                    self._deliver(request_id, EngineFailure(self.failure))
                    if self._on_finished is not None:
                        self._loop.call_soon_threadsafe(self._on_finished, request_id)
                self._queues.clear()
        finally:
            try:  # shutdown() is applied (and, under tensor parallelism, broadcast to the followers) by a step
                self.engine.shutdown()
                self.engine.step()
            except Exception:  # pragma: no cover - shutting down after a failure
                logger.error("colo serve: engine shutdown failed:\n%s", traceback.format_exc())
