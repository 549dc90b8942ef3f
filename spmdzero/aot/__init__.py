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

import importlib

# Where each public name lives. They are imported at first use (PEP 562), not with the package:
# the command line's own process imports ``spmdzero.aot.command`` for its options, and should
# not pay for torch and the tracing code that only ``spmdzero aot``'s child runs.
_HOMES = {
    "spmdzero.aot.steps": ("capture_step", "compare_stages", "compile_step", "describe_search", "find_max_batch",
                           "search_summary"),
    "spmdzero.tpu.capture": ("JaxStepCapture", "StepCapture", "capture", "check_traceable", "compile_mlir",
                             "trace_step"),
    "spmdzero.tpu.chips": ("chip_spec", "topology_chips"),
    "spmdzero.tpu.report": ("AotReport", "CollectivesReport"),
}
_HOME_OF = {name: module for module, names in _HOMES.items() for name in names}

__all__ = ["capture", "capture_step", "compile_step", "compare_stages", "find_max_batch", "describe_search",
           "search_summary", "StepCapture", "trace_step", "JaxStepCapture",
           "check_traceable", "compile_mlir", "chip_spec", "topology_chips", "AotReport", "CollectivesReport"]


def __getattr__(name: str):
    if name not in _HOME_OF:  # a submodule (``spmdzero.aot.steps``), as an eager import had made it an attribute
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"{__name__}.{name}":
                raise
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None
    value = getattr(importlib.import_module(_HOME_OF[name]), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
