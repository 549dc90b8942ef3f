"""Console entry point for ``spmdzero``: it imports the package without starting the XLA
runtime. The config and checkpoint commands need no devices; ``spmdzero launch`` starts the
runtime itself, so that a bad ``CPU_NUM_DEVICES`` or ``PJRT_DEVICE`` is one line, not a
traceback from the import."""

import os


def main(argv=None) -> int:
    os.environ.setdefault("SPMDZERO_NO_RUNTIME", "1")
    from spmdzero.cli.main import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
