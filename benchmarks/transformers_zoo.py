"""The transformers zoo's table: each stock architecture of ``tests/transformers_zoo.py`` (every list) trained
4 SGD steps at ZeRO-2 on 8 CPU devices against plain torch from the same weights and batches
(fp32, clipping off), on the transformers this process imports.

    python benchmarks/transformers_zoo.py                       # transformers 5.x (the venv's)
    PYTHONPATH=.venv/transformers4 python benchmarks/transformers_zoo.py   # 4.57 (make setup installs it)

It prints, per architecture: steps, the largest relative loss difference, the largest parameter
difference over the tensor's scale, the programs compiled (a training program and an update for
four batches; more would be recompiles), and whether the training program runs eagerly (its
forward reads a value on the host: ``backends/torchax/engine/host_reads.py``). A case that fails prints
its error instead."""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import spmdzero  # noqa: E402,F401  (8 CPU devices before torch creates tensors)
import transformers  # noqa: E402

import transformers_zoo as zoo  # noqa: E402


def main() -> int:
    names = sys.argv[1:] or [*zoo.names(), *zoo.more_names(),
                             *zoo.moe_names(transformers.__version__.startswith("4."))]
    print(f"transformers {transformers.__version__}, {len(names)} architectures, ZeRO-2 on 8 CPU devices\n")
    print("| architecture | steps | max rel. loss diff | max param diff | compiles | eager | seconds |")
    print("|---|---|---|---|---|---|---|")
    failed = 0
    for name in names:
        start = time.perf_counter()
        try:
            r = zoo.train_both(name)
        except Exception as err:  # a failing case is a row of the table, not the end of it
            failed += 1
            print(f"| {name} | - | {type(err).__name__}: {str(err).splitlines()[0][:120]} | | | | |", flush=True)
            continue
        print(f"| {name} | {r['steps']} | {r['loss_diff']:.1e} | {r['param_diff']:.1e} | {r['compiles']} | "
              f"{'yes' if r['eager'] else 'no'} | {time.perf_counter() - start:.1f} |", flush=True)
    print(f"\n{len(names) - failed} of {len(names)} trained")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
