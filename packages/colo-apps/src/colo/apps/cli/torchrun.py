"""torchrun as `colo launch` runs it: ``torch.distributed.run`` without its failure report when the ranks refused the
run's input.

When a rank finds an error in the user's input while the run is set up (a config the world size rejects, a broken
data file), rank 0 prints one ``colo: ...`` line and writes it to ``COLO_INPUT_ERROR_FILE``; every rank exits 2.
torchrun would then log the ranks' exits and print its own 30-line report of them under that line. This entry point
runs torchrun's ``main`` and, in that case only, drops those logs and exits 2 quietly; any other failure is reported
exactly as torchrun does.
"""

from __future__ import annotations

import logging
import os
import sys

from .launch import INPUT_ERROR_FILE_ENV


def _refused() -> bool:
    marker = os.environ.get(INPUT_ERROR_FILE_ENV)
    return bool(marker) and os.path.exists(marker)


def main(argv: list[str] | None = None) -> None:
    """``python -m colo.apps.cli.torchrun [torchrun arguments]``."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun_main

    for name in ("torch", "torch.distributed"):  # torch's own handlers (they do not propagate to the root)
        for handler in logging.getLogger(name).handlers:
            handler.addFilter(lambda record: not _refused())
    try:
        torchrun_main(sys.argv[1:] if argv is None else argv)
    except ChildFailedError:
        if _refused():  # the ranks' colo: line said it all
            sys.exit(2)
        raise


if __name__ == "__main__":
    main()
