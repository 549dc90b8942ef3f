"""Console entry point for ``spmdzero``: its config and checkpoint commands need no
devices, so it imports the package without starting the XLA runtime, except for
``spmdzero launch``, which trains."""

import os
import sys


def main(argv=None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args[:1] != ["launch"]:
        os.environ.setdefault("SPMDZERO_NO_RUNTIME", "1")
    from spmdzero.cli.main import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
