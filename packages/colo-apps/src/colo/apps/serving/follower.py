"""A follower rank of ``colo serve --tp N``: loads and shards the model as rank 0 does, then runs the engine's steps
(rank 0 broadcasts what to admit, abort and sample) until rank 0 shuts the engine down.

Started by `colo.apps.serving.server.start_followers` (``python -m colo.apps.serving.follower`` with the settings in
``COLO_SERVE_SPEC`` and torchrun's rank variables).
"""

from __future__ import annotations

import json
import os
import signal


def main() -> None:
    """Follow rank 0's engine until it shuts down."""
    from colo.comm import destroy_distributed

    from .model import load_rank
    from .server import SPEC_ENV

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the process group: rank 0 drains and stops us
    engine, _, _ = load_rank(json.loads(os.environ[SPEC_ENV]))
    while not engine.is_shut_down:
        engine.step()
    destroy_distributed()


if __name__ == "__main__":
    main()
