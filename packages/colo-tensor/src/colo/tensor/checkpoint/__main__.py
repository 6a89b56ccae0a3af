"""``python -m colo.tensor.checkpoint {info,verify,export} ...``: see `colo.tensor.checkpoint.cli`."""

import sys

from .cli import main

sys.exit(main())
