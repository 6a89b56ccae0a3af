"""Running `colo serve`: uvicorn with colo's graceful shutdown, on one rank or over ``tp`` local ranks.

Signals: uvicorn's own handling stops listening at once (new clients would see refused connections, not a 503) and
re-raises the signal after shutdown (the process would not exit 0). `serve_app` replaces it: the first SIGTERM or
SIGINT starts `ServingState.drain` (503 for new requests, ``grace`` seconds for the ones in flight, then they are
cancelled with an error), after which uvicorn closes; a second SIGINT exits at once.

Tensor parallelism: the ``tp - 1`` followers are started here as child processes of this one (rank 0), on a free
loopback port (``MASTER_ADDR``/``MASTER_PORT``/``RANK``/``WORLD_SIZE``, as torchrun would set them for
`colo.comm.init_distributed`). Rank 0 alone serves HTTP; the followers run the engine's steps
(`colo.apps.serving.follower`) until rank 0 shuts the engine down, which happens when the server stops, so one
signal to the server ends the whole job. Followers ignore SIGINT (a Ctrl-C reaches the whole process group: rank 0
decides), and a follower whose rank 0 died fails its next collective and exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import threading

logger = logging.getLogger("colo.serve")

SPEC_ENV = "COLO_SERVE_SPEC"
"""The environment variable carrying a follower's settings (JSON)."""


def serve_app(app, *, host: str, port: int, log_level: str = "warning") -> None:
    """Run ``app`` (from `create_app`) with uvicorn until a signal has drained it."""
    import uvicorn

    state = app.state.serving

    class Server(uvicorn.Server):
        draining: asyncio.Task | None = None

        async def serve(self, sockets=None) -> None:
            self.event_loop = asyncio.get_running_loop()
            await super().serve(sockets)

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            previous = {sig: signal.signal(sig, self.on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
            try:
                yield
            finally:
                for sig, handler in previous.items():
                    signal.signal(sig, handler)

        def on_signal(self, signum, frame) -> None:
            if self.draining is not None or not hasattr(self, "event_loop"):
                if signum == signal.SIGINT:  # a second Ctrl-C: stop now
                    self.should_exit = self.force_exit = True
                return
            print(
                f"colo serve: {signal.Signals(signum).name}: draining ({len(state.in_flight)} request(s) in flight, "
                f"--grace {state.settings.grace} s)",
                file=sys.stderr,
                flush=True,
            )
            self.draining = True  # set at once: the task itself is created on the loop
            self.event_loop.call_soon_threadsafe(self.start_drain)

        def start_drain(self) -> None:
            async def drain() -> None:
                await state.drain()
                self.should_exit = True

            self.draining = self.event_loop.create_task(drain())

    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5, lifespan="on", access_log=False
    )
    Server(config).run()


def start_followers(spec: dict, *, tp: int) -> tuple[list[subprocess.Popen], dict[str, str]]:
    """Start ranks ``1 .. tp - 1`` as child processes; return them and rank 0's distributed environment."""
    from colo.comm import find_free_port

    env = dict(os.environ)
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(find_free_port()), WORLD_SIZE=str(tp))
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // tp)))
    followers = []
    for rank in range(1, tp):
        rank_env = {**env, "RANK": str(rank), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(tp)}
        rank_env[SPEC_ENV] = json.dumps(spec)
        followers.append(subprocess.Popen([sys.executable, "-m", "colo.apps.serving.follower"], env=rank_env))
    own = {k: env[k] for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE")}
    own.update(RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE=str(tp))
    return followers, own


def stop_followers(followers: list[subprocess.Popen], *, timeout: float = 30.0) -> int:
    """Wait for the followers (they exit once the engine is shut down); kill those still running after
    ``timeout``. Each one that did not exit 0 is named on stderr with its code. Returns the first non-zero exit
    code, or 0."""
    code = 0
    for rank, process in enumerate(followers, start=1):
        try:
            result = process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            result = process.wait()
            print(f"colo serve: tp rank {rank} still ran {timeout:g} s after the shutdown: killed", file=sys.stderr)
        if result:
            print(f"colo serve: tp rank {rank} exited with code {result}", file=sys.stderr, flush=True)
        code = code or result
    return code
