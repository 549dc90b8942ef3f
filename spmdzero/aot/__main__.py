"""``python -m spmdzero.aot``: the ``spmdzero aot`` command."""

from spmdzero.aot.command import main

raise SystemExit(main())
