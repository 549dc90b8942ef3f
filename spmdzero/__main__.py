"""``python -m spmdzero``: the ``spmdzero`` command (the package import starts the XLA runtime,
which the console script skips for the commands that need no devices)."""

import sys

from spmdzero.cli.main import main

sys.exit(main())
