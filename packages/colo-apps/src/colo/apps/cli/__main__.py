"""``python -m colo.apps.cli``: the ``colo`` command."""

from .app import main

main()
