"""``spmdzero.aot``: compile the real training step for a TPU topology on any machine.

    with spmdzero.aot.capture(engine) as step:   # in a process with as many devices as chips
        loss = engine(batch)
        engine.backward(loss)
        engine.step()                             # traced, not executed
    report = step.compile("v5e:2x2")              # per-chip HBM, collectives, roofline

A torchax engine (``spmd.backend: "torchax"``) runs its programs when called, so its step is
traced by JAX instead, for a batch, and nothing runs:

    step = spmdzero.aot.trace_step(engine, *batch)  # the engine's mesh as many devices as chips
    report = step.compile("v5e:2x4")

``compile_step`` / ``compare_stages`` / ``find_max_batch`` build a shape-only engine from a
model source and a config (``steps``); ``python -m spmdzero.aot`` (``spmdzero aot``) is the
command (``command``); they compile the step of the backend the config selects, the
torchax one on an abstract mesh of the topology's size. This layer sits above
``initialize``: it builds engines. Below it, ``spmdzero.tpu`` does the capture and the
compile.
"""

from spmdzero.aot.steps import (capture_step, compare_stages, compile_step, describe_search, find_max_batch,
                                 search_summary)
from spmdzero.tpu.capture import JaxStepCapture, StepCapture, capture, check_traceable, compile_mlir, trace_step
from spmdzero.tpu.chips import chip_spec, topology_chips
from spmdzero.tpu.report import AotReport, CollectivesReport

__all__ = ["capture", "capture_step", "compile_step", "compare_stages", "find_max_batch", "describe_search",
           "search_summary", "StepCapture", "trace_step", "JaxStepCapture",
           "check_traceable", "compile_mlir", "chip_spec", "topology_chips", "AotReport", "CollectivesReport"]
