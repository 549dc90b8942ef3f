"""Time to first step with XLA's persistent compilation cache, cold versus warm.

    python benchmarks/first_step.py

Runs the example model's first training step in two fresh processes sharing one
``spmd.compile_cache_dir``: the first fills the cache, the second could read it. Prints both
times, their ratio, and the cache counters torch_xla recorded.

The torch_xla backend's benchmark (`SPMDZERO_BACKEND=torch_xla`): XLA's persistent cache.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap

os.environ.setdefault("SPMDZERO_BACKEND", "torch_xla")  # the torch_xla backend's benchmark (its children inherit it)

CHILD = """
import json, sys, time
start = time.perf_counter()
import spmdzero, torch
import torch_xla.debug.metrics as met
sys.path.insert(0, "examples")
from model import TinyGPT
model = TinyGPT()
engine, *_ = spmdzero.initialize(model=model, config={"train_batch_size": 32, "zero_optimization": {"stage": 2},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "spmd": {"compile_cache_dir": sys.argv[1]}})
loss = engine(*model.example_inputs(32))
engine.backward(loss)
engine.step()
loss.item()
print(json.dumps({"seconds": time.perf_counter() - start,
                  "hits": met.counter_value("PersistentCacheHit") or 0,
                  "misses": met.counter_value("PersistentCacheMiss") or 0,
                  "deserialize_failures": met.counter_value("PersistentCacheDeserializeFailure") or 0}))
"""


def run(cache: str) -> dict:
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(CHILD), cache], cwd=repo, check=True,
                         capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> None:
    with tempfile.TemporaryDirectory() as cache:
        cold, warm = run(cache), run(cache)
    print(f"time to first step (import, initialize, one step): cold {cold['seconds']:.2f} s, "
          f"warm {warm['seconds']:.2f} s, warm/cold = {warm['seconds'] / cold['seconds']:.2f}")
    print(f"cache counters: cold {cold}, warm {warm}")
    if warm["deserialize_failures"]:
        print("note: this backend could not deserialize the cached executables, so the warm run compiled again")


if __name__ == "__main__":
    main()
