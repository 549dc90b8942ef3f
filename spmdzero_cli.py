"""Console entry point for ``spmdzero``: it inspects configs and needs no devices, so it
imports the package without starting the XLA runtime."""

import os


def main(argv=None) -> int:
    os.environ.setdefault("SPMDZERO_NO_RUNTIME", "1")
    from spmdzero.cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
