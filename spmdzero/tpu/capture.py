"""Capture one training step of an engine as StableHLO, without executing it, and compile it
in a subprocess: for a TPU topology with libtpu's compile-only client, or for this process's
XLA:CPU devices (``collectives_report``). After the capture the engine is as it was."""

from __future__ import annotations
import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from typing import Optional
import numpy as np
import torch
from spmdzero.tpu.retarget import check_same_plan, retarget, target_mesh_shape, trace_devices
from spmdzero.tpu.chips import GIB, ChipSpec, chip_spec, topology_chips  # noqa: F401  (topology_chips: public here)
from spmdzero.tpu.compile import LIBTPU_HINT
from spmdzero.tpu.report import AotReport, CollectivesReport, HLO_DTYPES
from spmdzero.sharding.mesh import mesh_shape
from spmdzero.tpu.captured_engine import InterceptedEngine, TracedEngine
from spmdzero.runtime import jax_private
from spmdzero.runtime.jax_runtime import shardy_partitioner


class StepCapture:
    """One traced step: its StableHLO and which arguments its outputs update in place."""

    def __init__(self, engine: InterceptedEngine, inputs: dict):
        self.engine = engine
        self.inputs = inputs  # state key -> the tensor holding its value before the step
        self.mlir: Optional[str] = None
        self.donate: list[tuple[int, int]] = []
        self.loss: Optional[torch.Tensor] = None

    def record(self) -> None:
        """Called by the engine's ``step()`` once it has traced the update."""
        import torch_xla
        import torch_xla.core.xla_model as xm

        state = {k: t for k, (t, _) in self.engine.state_tensors().items()}
        state.update({f"grad.{k}": b for k, b in self.engine.grad_buffers().items()})
        # Outputs are the state the step changed (an untouched tensor is no output: the
        # exporter would drop it and shift the numbering), then the loss.
        probe = torch_xla._XLAC.lowering.LoweringContext("probe")
        probe.build(list(state.values()))
        changed = [k for k, t in state.items() if probe.tensor_parameter_id(t) < 0]
        outputs = [state[k] for k in changed] + ([self.loss] if self.loss is not None else [])
        lowering = torch_xla._XLAC.lowering.LoweringContext("step")
        lowering.build(outputs)
        for index, key in enumerate(changed):
            arg = lowering.tensor_parameter_id(self.inputs[key]) if key in self.inputs else -1
            if arg >= 0:
                self.donate.append((arg, index))
        self.mlir = xm.get_stablehlo(outputs)

    def _check(self) -> None:
        if self.mlir is None:
            raise RuntimeError("nothing captured: call engine.step() inside `with spmdzero.aot.capture(engine)`")

    def compile(self, topology: str, timeout: int = 3600) -> AotReport:
        self._check()
        chips = topology_chips(topology)
        devices = int(self.engine.mesh.size())
        mlir, micro_batch = self.mlir, self.engine.train_micro_batch_size_per_gpu()
        if chips != devices:
            if devices != trace_devices(topology):
                raise ValueError(f"topology {topology!r} has {chips} chips but the mesh has {devices} devices; capture "
                                 f"in a process started with CPU_NUM_DEVICES={trace_devices(topology)} (set before "
                                 "importing spmdzero)")
            # more chips than one process can trace: the same global program, its shardings
            # moved onto the target mesh (spmdzero.tpu.retarget)

            traced = mesh_shape(self.engine.mesh)
            target = target_mesh_shape(self.engine, chips)
            check_same_plan(self.engine.plan, target)
            mlir = retarget(mlir, traced, target)
            micro_batch //= chips // devices
        result = compile_mlir(mlir, topology, self.donate, timeout)
        return AotReport(stage=self.engine.plan.stage, gradient_bytes=self.gradient_bytes(),
                         micro_batch=micro_batch, gradient_names=self.gradient_names(), backend="torch_xla",
                         **result)

    def gradient_bytes(self) -> int:
        trainable = [s.param for s in self.engine.trained_parameters()]
        return sum(p.numel() for p in trainable) * self.engine.precision.communication_dtype.itemsize

    def gradient_names(self) -> dict[str, list[str]]:
        """Each gradient's HLO shape (``f32[50257,768]``) -> the parameters with that shape."""
        dtype = HLO_DTYPES[self.engine.precision.communication_dtype]
        names: dict[str, list[str]] = {}
        for slot in self.engine.trained_parameters():
            shape = f"{dtype}[{','.join(str(d) for d in slot.param.shape)}]"
            names.setdefault(shape, []).append(slot.name)
        return names

    def collectives_report(self, timeout: int = 1800) -> "CollectivesReport":
        """The collectives of this step compiled for XLA:CPU on this process's devices, with
        the CPU lowering of a reduce-scatter (all-reduce + partition-indexed slices) named as
        what TPU and GPU compile it to."""
        self._check()
        devices = int(self.engine.mesh.size())
        result = compile_mlir(self.mlir, f"cpu:{devices}", self.donate, timeout)
        return CollectivesReport(devices, result["collectives"], self.gradient_bytes(), self.engine.plan.stage)


# The newest Mosaic IR (a Pallas kernel's serialized form) libtpu 0.0.21 reads: it refuses
# JAX 0.7.1's default, 8 ("Unsupported version: expected <= 7 but got 8").
LIBTPU_MOSAIC_IR_VERSION = 7


class JaxStepCapture:
    """One step of a torchax engine (``spmd.backend: "torchax"``) as StableHLO: the engine's
    training and update programs composed into one ``jax.jit`` function and traced
    (``TorchaxEngine.trace_step``), lowered here for TPU. Nothing runs: on a shape-only engine
    its arguments are ``jax.ShapeDtypeStruct``s on an abstract mesh, so the module is the
    topology's own program whatever devices this machine has (no retargeting, any chip count).

    JAX writes into the module what ``StepCapture`` has to add: each argument's sharding and
    each donated state's output (Shardy's ``sdy.sharding``, ``tf.aliasing_output``), and the
    outputs' shardings where the step gives them (the update's: parameters replicated, states
    laid out by the plan), which the compile keeps."""

    backend = "torchax"

    def __init__(self, engine: TracedEngine, traced_step):
        self.engine = engine
        self.step = traced_step  # TorchaxEngine.trace_step's TracedStep
        # The TPU lowering (its own rules for a few ops, e.g. the RNG), not this machine's, with
        # JAX's default partitioner, Shardy, as the engine runs on a TPU VM (SPMDZERO_BACKEND=
        # torchax): a process where torch_xla used JAX has it switched off for good (torch_xla's
        # jax_workarounds.maybe_get_jax), and would lower GSPMD's annotations instead.
        with shardy_partitioner(True), jax_private.mosaic_ir_version_at_most(LIBTPU_MOSAIC_IR_VERSION):
            self.mlir: str = traced_step.traced.lower(lowering_platforms=("tpu",)).as_text()
        self.donate: list[tuple[int, int]] = []  # in the module already

    @property
    def devices(self) -> int:
        return int(self.engine.mesh.size)

    def compile(self, topology: str, timeout: int = 3600) -> AotReport:
        chips = topology_chips(topology)
        if chips != self.devices:
            raise ValueError(f"topology {topology!r} has {chips} chips but the step was traced for a mesh of "
                             f"{self.devices} devices; trace it for {chips} (spmdzero.aot.capture_step(..., "
                             f"topology={topology!r}) builds a shape-only engine of that size)")
        result = compile_mlir(self.mlir, topology, (), timeout, fixed_outputs=True)
        return AotReport(stage=self.engine.plan.stage, gradient_bytes=self.gradient_bytes(),
                         micro_batch=self.step.micro_batch, gradient_names=self.gradient_names(),
                         backend=self.backend, attention=self.engine.attention_kernels.describe(),
                         experts=self.engine.expert_matmuls.describe(), **result)

    def collectives_report(self, timeout: int = 1800) -> CollectivesReport:
        """The collectives of this step compiled for XLA:CPU on the engine's devices (lowered for
        the CPU, with Shardy as for the TPU), reported as ``StepCapture.collectives_report`` does."""
        with shardy_partitioner(True):
            mlir = self.step.traced.lower(lowering_platforms=("cpu",)).as_text()
        result = compile_mlir(mlir, f"cpu:{self.devices}", (), timeout, fixed_outputs=True)
        return CollectivesReport(self.devices, result["collectives"], self.gradient_bytes(), self.engine.plan.stage)

    def gradient_bytes(self) -> int:
        count = sum(int(np.prod(shape, dtype=np.int64)) for shape in self.step.trained.values())
        return count * self.step.communication_dtype.itemsize

    def gradient_names(self) -> dict[str, list[str]]:
        """Each gradient's HLO shape (``f32[50257,768]``) -> the parameters with that shape."""
        dtype = HLO_DTYPES[self.step.communication_dtype]
        names: dict[str, list[str]] = {}
        for name, shape in self.step.trained.items():
            names.setdefault(f"{dtype}[{','.join(str(d) for d in shape)}]", []).append(name)
        return names


def trace_step(engine: TracedEngine, *inputs, **kwargs) -> JaxStepCapture:
    """One training step of a torchax engine for a batch of ``inputs``, traced, not run: the
    engine is as it was. ``.compile(topology)`` compiles it for a TPU topology with as many
    chips as the engine's mesh has devices."""
    if not hasattr(engine, "trace_step"):
        raise TypeError(f"spmdzero.aot.trace_step takes a torchax engine (spmd.backend='torchax'), got a "
                        f"{type(engine).__name__}: capture a torch_xla engine's step with "
                        "`with spmdzero.aot.capture(engine) as step:`")
    return JaxStepCapture(engine, engine.trace_step(*inputs, **kwargs))


def check_traceable(topology: str) -> int:
    """How many devices to trace ``topology`` on (``CPU_NUM_DEVICES``): its chips, or for 128
    and more (PyTorch's autograd engine counts devices in 8 bits) a quarter or sixteenth of
    them, the program then moved onto the whole topology (``spmdzero.tpu.retarget``)."""
    return trace_devices(topology)


def compile_mlir(mlir: str, topology: str, donate=(), timeout: int = 3600, fixed_outputs: bool = False) -> dict:
    """Run ``spmdzero.tpu.compile`` in a subprocess; raise its error here. ``fixed_outputs``:
    the outputs' shardings in the module are kept (``compile.prepare_module``)."""
    if not topology.startswith("cpu:") and importlib.util.find_spec("libtpu") is None:
        raise RuntimeError(f"libtpu is not installed; {LIBTPU_HINT}")
    with tempfile.TemporaryDirectory() as tmp:
        src, meta, out = (os.path.join(tmp, name) for name in ("step.mlir", "step.json", "report.json"))
        with open(src, "w") as f:
            f.write(mlir)
        with open(meta, "w") as f:
            json.dump({"donate": [list(pair) for pair in donate], "fixed_outputs": fixed_outputs}, f)
        env = {**os.environ, "SPMDZERO_NO_RUNTIME": "1"}
        proc = subprocess.run([sys.executable, "-m", "spmdzero.tpu.compile", src, topology, out, meta], env=env,
                              capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0 or not os.path.exists(out):
            how = (f"killed by signal {-proc.returncode}" + (" (out of host memory?)" if proc.returncode == -9 else "")
                   if proc.returncode < 0 else f"exit status {proc.returncode}")
            unknown = "Unknown command line flag" in proc.stderr
            hint = ("\n(libtpu does not know a flag in LIBTPU_INIT_ARGS: fix or unset it; "
                    "SPMDZERO_LIBTPU_FLAGS=0 leaves out spmdzero's own)") if unknown else ""
            raise RuntimeError(f"TPU compilation for {topology} failed ({how}):\n{proc.stderr[-3000:]}{hint}")
        with open(out) as f:
            result = json.load(f)
    if "error" in result:
        raise (RuntimeError if result.get("kind") == "runtime" else ValueError)(result["error"])
    return result


@contextlib.contextmanager
def capture(engine: InterceptedEngine, inputs: Optional[dict] = None):
    """Trace one training step without executing it; restore the engine afterwards.
    ``inputs`` (from ``spmdzero.aot.shapes.shape_only_engine``) names the placeholders holding
    the state before the step; by default the engine's live state is (kept by its snapshot)."""
    if hasattr(engine, "trace_step"):  # its forward runs when called: nothing to intercept
        raise TypeError("spmdzero.aot.capture(engine) traces a torch_xla engine's step; a torchax engine's "
                        "(spmd.backend='torchax') is traced by spmdzero.aot.trace_step(engine, *batch), without "
                        "running it")
    snapshot = engine.snapshot(with_tensors=inputs is None)  # a shape-only engine has nothing to execute
    step = StepCapture(engine, inputs if inputs is not None else snapshot.values)
    engine.capture_steps(step)
    try:
        yield step
    finally:
        engine.capture_steps(None)
        engine.restore_snapshot(snapshot)
