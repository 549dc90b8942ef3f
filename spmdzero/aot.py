"""Compile the real training step for a TPU topology on any machine.

    with spmdzero.aot.capture(engine) as step:   # in a process with as many devices as chips
        loss = engine(batch)
        engine.backward(loss)
        engine.step()                             # traced, not executed
    report = step.compile("v5e:2x2")              # per-chip HBM, collectives, roofline

The step is exported as StableHLO with its sharding annotations, its state donated (each
state tensor's input aliased to its updated output, as a training loop runs it), and
compiled by libtpu's compile-only client through JAX (``spmdzero.tpu_compile``, in a
subprocess). After the block the engine is as it was: the traced update is dropped.

``python -m spmdzero.aot --topology v5e:2x2 --deepspeed_config cfg.json --model M`` (or
``spmdzero aot``) does this for stages 0, 1 and 2 and prints them side by side. By default
the engine is built shape-only (``spmdzero.aot_shapes``): no parameter is materialized, so
the host needs memory for the graph, not for N copies of the model.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Optional

import torch

from .aot_retarget import check_same_plan, retarget, target_mesh_shape, trace_devices
from .tpu_chips import GIB, ChipSpec, chip_spec, topology_chips  # noqa: F401  (topology_chips: public here)
from .tpu_compile import LIBTPU_HINT

HLO_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}


@dataclass
class AotReport:
    """One compiled step on one topology: per-chip memory (or the compiler's out-of-memory
    numbers), collectives against the data-parallel minimum, and a roofline estimate."""

    topology: str
    chips: int
    device_kind: str
    compile_seconds: float
    memory: Optional[dict]
    collectives: dict
    cost: dict
    gradient_bytes: int  # trainable parameters x communication dtype: the all-reduce minimum's P x bytes
    model_flops: Optional[float] = None  # per chip, 6 x params x tokens, when the tokens are known
    out_of_memory: Optional[dict] = None
    stage: Optional[int] = None
    micro_batch: Optional[int] = None
    loops: list = field(default_factory=list)  # trip counts of the program's while loops (scanned layers, rings)
    all_reduces: list = field(default_factory=list)  # the largest all-reduced arrays (tpu_compile.largest_all_reduces)
    gradient_names: dict = field(default_factory=dict)  # HLO shape of a gradient -> the parameters of that shape
    libtpu_args: Optional[str] = None  # the LIBTPU_INIT_ARGS compiled with (spmdzero.libtpu_flags); None on CPU
    cost_per_step: Optional[dict] = None  # ``cost`` with loop bodies counted per trip (tpu_compile.per_step_cost)
    cost_per_step_error: Optional[str] = None  # why there is none for a looped program

    @property
    def chip(self) -> ChipSpec:
        return chip_spec(self.topology)

    @property
    def total_bytes(self) -> int:
        """Per chip: arguments and outputs (donated state counted once), temporaries, code;
        from an out-of-memory compile, what the compiler said the program needs."""
        if self.memory is None:
            return int(self.out_of_memory.get("used", 0))
        m = self.memory
        return m["argument"] + m["output"] - m["alias"] + m["temp"] + m["generated_code"]

    @property
    def fits(self) -> bool:
        return self.memory is not None and self.total_bytes <= self.chip.hbm_bytes

    @property
    def over_by(self) -> int:
        """Bytes per chip beyond HBM (0 when it fits)."""
        if self.memory is None:
            return int(self.out_of_memory.get("over_by", 0))
        return max(0, self.total_bytes - self.chip.hbm_bytes)

    @property
    def traffic(self) -> "CollectivesReport":
        return CollectivesReport(self.chips, self.collectives, self.gradient_bytes)

    def roofline(self) -> dict:
        """A lower bound on the step time with compute, HBM traffic and ICI traffic fully
        overlapped: max of FLOPs / peak, bytes accessed / HBM bandwidth and bytes sent per
        chip / ICI bandwidth (the compiler's cost analysis and the chip's published figures).
        A program with loops (scanned layers, a windowed einsum's ring) is costed per trip."""
        if not self.cost:
            return {}
        spec = self.chip
        looped = any(trips > 1 for trips in self.loops)
        cost = self.cost_per_step if looped and self.cost_per_step else self.cost
        flops = cost.get("flops", 0.0)
        unscaled = looped and not self.cost_per_step
        if unscaled and self.model_flops is not None:
            # the cost analysis counts a loop body once: 6 x params x tokens is the better floor
            flops = max(flops, self.model_flops)
        parts = {"compute_s": flops / spec.peak_bf16_flops,
                 "hbm_s": cost.get("bytes accessed", 0.0) / spec.hbm_bandwidth,
                 "ici_s": self.traffic.total_traffic / spec.ici_bandwidth}
        step = max(parts.values())
        useful = self.model_flops if self.model_flops is not None else flops
        parts.update(step_s=step, bound=max(parts, key=parts.get).removesuffix("_s"),
                     mfu=useful / (step * spec.peak_bf16_flops) if step and not unscaled else None,
                     mfu_flops="6 x params x tokens" if self.model_flops is not None else "compiled FLOPs")
        if looped and not unscaled:
            parts["note"] = (f"loop bodies counted per trip ({'; '.join(map(str, self.loops))} trips): "
                             "XLA's cost analysis of each body, times its trip count")
        elif unscaled:  # an MFU from a compute floor of 6PT would be 100% by construction
            parts["note"] = ("the program has a while loop (scanned layers, or a windowed einsum's ring of "
                             "collective-permutes) and the compiler's cost analysis counts a loop body once: "
                             "compute is floored at 6 x params x tokens, HBM bytes are under-stated, no MFU"
                             + (f" (per-trip costing failed: {self.cost_per_step_error})"
                                if self.cost_per_step_error else ""))
        return parts

    def verdict(self) -> str:
        if self.fits:
            return "fits"
        return f"DOES NOT FIT by {self.over_by / GIB:.2f} GiB"

    def to_dict(self) -> dict:
        traffic = self.traffic
        out = {"topology": self.topology, "chips": self.chips, "device_kind": self.device_kind,
               "stage": self.stage, "micro_batch": self.micro_batch, "compile_seconds": self.compile_seconds,
               "hbm_per_chip": self.chip.hbm_bytes, "memory": self.memory, "total_bytes": self.total_bytes,
               "fits": self.fits, "over_by": self.over_by, "out_of_memory": self.out_of_memory,
               "collectives": self.collectives, "cost": self.cost, "cost_per_step": self.cost_per_step,
               "gradient_bytes": self.gradient_bytes,
               "model_flops": self.model_flops, "loops": self.loops, "roofline": self.roofline(),
               "all_reduced_gradients": self.all_reduced_gradients(), "libtpu_args": self.libtpu_args}
        if self.memory is not None:
            out["traffic"] = {"sent_per_chip": traffic.total_traffic, "minimum": traffic.minimum_traffic,
                              "ratio": traffic.ratio}
        return out

    def all_reduced_gradients(self) -> list[dict]:
        """At ZeRO-2, the large all-reduces shaped like a gradient: gradients the compiler
        all-reduced in full instead of reduce-scattering (ZeRO-0/1 all-reduce by design)."""
        if self.stage is None or self.stage < 2:
            return []
        return [{**r, "parameters": self.gradient_names[r["shape"]]} for r in self.all_reduces
                if r["shape"] in self.gradient_names]

    def summary(self) -> str:
        head = f"{self.topology} ({self.chips} x {self.device_kind}), ZeRO stage {self.stage}"
        if self.micro_batch is not None:
            head += f", micro-batch {self.micro_batch}/chip"
        lines = [f"{head}: compiled in {self.compile_seconds:.1f} s"]
        if self.libtpu_args is not None:
            lines.append(f"  libtpu flags: {self.libtpu_args or '(none)'}")
        if self.memory is None:
            lines.append(f"  the compiler ran out of HBM: needs {_gib(self.total_bytes)} per chip of "
                         f"{_gib(self.out_of_memory.get('capacity', self.chip.hbm_bytes))} usable: {self.verdict()}")
            lines.append(f"  ({self.out_of_memory['message'][:300]})")
            largest = self.out_of_memory.get("largest_allocations") or []
            if largest:
                lines.append("  its largest allocations at the peak (libtpu's list):")
            for a in largest:
                where = ", ".join(x for x in (a["op"][-80:] or a["label"], a["source"], a["kind"]) if x)
                lines.append(f"    {_gib(a['bytes']):>10}  {a['shape']:<28} {where}")
            return "\n".join(lines)
        m = self.memory
        lines += [f"  per-chip HBM: arguments {_mb(m['argument'])}, outputs {_mb(m['output'])}, "
                  f"aliased {_mb(m['alias'])}, temporaries {_mb(m['temp'])}, code {_mb(m['generated_code'])}",
                  f"  total {_gib(self.total_bytes)} of {_gib(self.chip.hbm_bytes)}: {self.verdict()}"]
        traffic = self.traffic
        for kind, row in sorted(self.collectives.items()):
            lines.append(f"  {kind:<19}{row['count']:>5} ops {row['tensors']:>5} tensors {_mb(row['bytes']):>14}"
                         f"  sends {_mb(traffic.traffic(kind))}/chip")
        if traffic.gradient_bytes:
            lines.append(f"  sent per chip {_mb(traffic.total_traffic)} = {traffic.ratio:.2f} x the data-parallel "
                         f"minimum 2(N-1)/N x P x bytes ({_mb(traffic.minimum_traffic)})")
        full = self.all_reduced_gradients()
        if full:
            listed = "; ".join(f"{row['shape']} x{row['count']} ({', '.join(row['parameters'][:2])}"
                               f"{', ...' if len(row['parameters']) > 2 else ''})" for row in full[:3])
            lines.append(f"  all-reduced in full, not reduce-scattered: {listed}. libtpu 0.0.21 keeps a "
                         "reduce-scatter only under conditions docs/tpu.md lists (among them, shards of whole "
                         "TPU tiles)")
        r = self.roofline()
        if r:
            lines.append(f"  roofline estimate (perfect overlap, published peaks): step >= {r['step_s'] * 1e3:.1f} ms "
                         f"({r['bound']}-bound: compute {r['compute_s'] * 1e3:.1f} ms, HBM {r['hbm_s'] * 1e3:.1f} ms, "
                         f"ICI {r['ici_s'] * 1e3:.1f} ms)" + (f", MFU <= {r['mfu']:.0%} ({r['mfu_flops']})"
                                                             if r["mfu"] is not None else ""))
            if "note" in r:
                lines.append(f"  ({r['note']})")
        return "\n".join(lines)


def _mb(n: float) -> str:
    return f"{n / 2**20:,.2f} MiB"


def _gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


class StepCapture:
    """One traced step: its StableHLO and which arguments its outputs update in place."""

    def __init__(self, engine, inputs: dict):
        self.engine = engine
        self.inputs = inputs  # state key -> the tensor holding its value before the step
        self.mlir: Optional[str] = None
        self.donate: list[tuple[int, int]] = []
        self.loss: Optional[torch.Tensor] = None

    def record(self, lr_kwargs) -> None:
        import torch_xla
        import torch_xla.core.xla_model as xm

        self.engine._take_model_step(lr_kwargs)
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
            # moved onto the target mesh (spmdzero.aot_retarget)
            from .mesh import mesh_shape

            traced = mesh_shape(self.engine.mesh)
            target = target_mesh_shape(self.engine, chips)
            check_same_plan(self.engine.plan, target)
            mlir = retarget(mlir, traced, target)
            micro_batch //= chips // devices
        result = compile_mlir(mlir, topology, self.donate, timeout)
        return AotReport(stage=self.engine.plan.stage, gradient_bytes=self.gradient_bytes(),
                         micro_batch=micro_batch, gradient_names=self.gradient_names(), **result)

    def gradient_bytes(self) -> int:
        trainable = [s.param for s in self.engine._slots]
        return sum(p.numel() for p in trainable) * self.engine.precision.communication_dtype.itemsize

    def gradient_names(self) -> dict[str, list[str]]:
        """Each gradient's HLO shape (``f32[50257,768]``) -> the parameters with that shape."""
        dtype = HLO_DTYPES[self.engine.precision.communication_dtype]
        names: dict[str, list[str]] = {}
        for slot in self.engine._slots:
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
        return CollectivesReport(devices, result["collectives"], self.gradient_bytes())


@dataclass(frozen=True)
class CollectivesReport:
    """Collectives of a compiled training step, with the bytes each device sends under a ring
    algorithm, against the data-parallel minimum 2(N-1)/N x (gradient bytes)."""

    devices: int
    collectives: dict
    gradient_bytes: int

    def traffic(self, kind: str) -> float:
        """Bytes sent per device: all-reduce 2(N-1)/N x size; reduce-scatter and all-gather
        (N-1)/N x the full tensor; anything else its size. N is each op's replica group
        (``sent``, from the compiled program) where known, else the mesh."""
        n, row = self.devices, self.collectives[kind]
        if row.get("sent") is not None:
            return row["sent"]
        if kind.startswith("reduce-scatter"):
            full = row["bytes"] if "CPU" in kind else row["bytes"] * n  # CPU all-reduce output is full-size
            return (n - 1) / n * full
        if kind == "all-gather":
            return (n - 1) / n * row["bytes"]
        if kind == "all-reduce":
            return 2 * (n - 1) / n * row["bytes"]
        return row["bytes"]

    @property
    def total_traffic(self) -> float:
        return sum(self.traffic(k) for k in self.collectives)

    @property
    def minimum_traffic(self) -> float:
        return 2 * (self.devices - 1) / self.devices * self.gradient_bytes

    @property
    def ratio(self) -> float:
        return self.total_traffic / self.minimum_traffic if self.minimum_traffic else 0.0

    def __str__(self) -> str:
        lines = [f"collectives of one training step on {self.devices} devices"]
        for kind, row in sorted(self.collectives.items()):
            lines.append(f"  {kind:<40}{row['count']:>4} ops {row['tensors']:>5} tensors "
                         f"{_mb(row['bytes']):>12}  sends {_mb(self.traffic(kind))}/device")
        lines.append(f"  total sent per device {_mb(self.total_traffic)}; minimum 2(N-1)/N x gradients "
                     f"{_mb(self.minimum_traffic)} (ratio {self.ratio:.2f})")
        return "\n".join(lines)


def check_traceable(topology: str) -> int:
    """How many devices to trace ``topology`` on (``CPU_NUM_DEVICES``): its chips, or for 128
    and more (PyTorch's autograd engine counts devices in 8 bits) a quarter or sixteenth of
    them, the program then moved onto the whole topology (``spmdzero.aot_retarget``)."""
    return trace_devices(topology)


def compile_mlir(mlir: str, topology: str, donate=(), timeout: int = 3600) -> dict:
    """Run ``spmdzero.tpu_compile`` in a subprocess; raise its error here."""
    if not topology.startswith("cpu:") and importlib.util.find_spec("libtpu") is None:
        raise RuntimeError(f"libtpu is not installed; {LIBTPU_HINT}")
    with tempfile.TemporaryDirectory() as tmp:
        src, meta, out = (os.path.join(tmp, name) for name in ("step.mlir", "step.json", "report.json"))
        with open(src, "w") as f:
            f.write(mlir)
        with open(meta, "w") as f:
            json.dump({"donate": [list(pair) for pair in donate]}, f)
        env = {**os.environ, "SPMDZERO_NO_RUNTIME": "1"}
        proc = subprocess.run([sys.executable, "-m", "spmdzero.tpu_compile", src, topology, out, meta], env=env,
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
def capture(engine, inputs: Optional[dict] = None):
    """Trace one training step without executing it; restore the engine afterwards.
    ``inputs`` (from ``aot_shapes.shape_only_engine``) names the placeholders holding the
    state before the step; by default the engine's live state is."""
    import torch_xla

    if inputs is None:  # a shape-only engine has nothing to execute (and nothing it could)
        torch_xla.sync()
    tensors = {k: t for k, (t, _) in engine.state_tensors().items()}
    tensors.update({f"grad.{k}": b for k, b in engine.grad_buffers().items()})
    # A clone shares the state's device buffer and keeps pointing at it while the traced
    # step updates the tensor in place (``t.data`` would follow the update).
    saved = {k: t.clone() for k, t in tensors.items()} if inputs is None else None
    saved_attrs = {k: copy.copy(getattr(engine, k)) for k in (
        "global_steps", "global_samples", "micro_steps", "_step_applied", "_last_overflow", "_global_grad_norm",
        "_loss_scale", "_skipped_on_device", "_rows_since_step", "_backward_since_step", "samples_last_step")}
    # Rebound, never updated in place, by a traced backward or step: the objects are kept
    # (the gradients pending inside an accumulation window, the last loss read by last_loss()).
    saved_attrs.update(_last_loss=engine._last_loss, _window_loss=engine._window_loss, _step_loss=engine._step_loss,
                       _input_shapes=engine._input_shapes)
    pending = [slot.grad for slot in engine._slots]
    groups = [dict(g) for g in engine.optimizer.param_groups] if engine.optimizer else []
    # the schedule's own attributes, not its state_dict(): that reads a device step count back
    # as an int, which the next step sends as a new input and so compiles a new graph
    scheduler = {k: v if isinstance(v, torch.Tensor) else copy.copy(v)
                 for k, v in vars(engine.lr_scheduler).items()} if engine.lr_scheduler is not None else None
    step = StepCapture(engine, inputs if inputs is not None else saved)
    engine._capture = step
    try:
        yield step
    finally:
        engine._capture = None
        if saved is not None:
            # An in-place copy, not a swap of the XLA tensor under the functional wrapper: views
            # (a weight's transpose in the next forward) are rebuilt from the wrapper's base,
            # which a swap would leave at the traced update.
            with torch.no_grad():
                for key, t in tensors.items():
                    t.copy_(saved[key])
            # laid out by the plan and executed now, as a graph of its own (compiled once): left
            # pending, the copies would join the next training step's graph and make it a new
            # one to compile
            engine._reannotate()
            torch_xla.sync()
        for name, value in saved_attrs.items():
            setattr(engine, name, value)
        for slot, grad in zip(engine._slots, pending):
            slot.grad = grad
        if engine.optimizer:
            for group, kept in zip(engine.optimizer.param_groups, groups):
                group.update(kept)
        if scheduler is not None:
            vars(engine.lr_scheduler).update(scheduler)
        for p in engine.module.parameters():
            p.grad = None


# ---- stages side by side (the command) ------------------------------------------------------------

def _stage_config(config: dict, stage: int, micro_batch: Optional[int]) -> dict:
    cfg = copy.deepcopy(config)
    cfg.setdefault("zero_optimization", {})["stage"] = stage
    if micro_batch is not None:  # per chip; the global batch follows
        cfg["train_micro_batch_size_per_gpu"] = micro_batch
        cfg.pop("train_batch_size", None)
    return cfg


def capture_step(source, config: dict, stage: int, micro_batch: Optional[int] = None,
                 shape_only: bool = True, topology: Optional[str] = None) -> StepCapture:
    """Build the engine for ``stage`` (shape-only unless told) and trace one step of it."""
    import spmdzero

    from .aot_models import build_on_meta, checked_module
    from .aot_shapes import shape_only_engine

    from . import runtime

    ratio = topology_chips(topology) // runtime.device_count() if topology else 1
    if ratio > 1:  # traced on fewer devices than chips: the same global batch (spmdzero.aot_retarget)
        micro_batch = micro_batch or config.get("train_micro_batch_size_per_gpu")
        if micro_batch is None:
            raise ValueError(f"{topology} is traced on {runtime.device_count()} devices with {ratio} x the "
                             "micro-batch per chip: give it (--micro-batch or train_micro_batch_size_per_gpu)")
        micro_batch *= ratio
    cfg = _stage_config(config, stage, micro_batch)
    if shape_only:
        model = build_on_meta(source)
        engine, inputs = shape_only_engine(model, cfg)
    else:
        model, inputs = checked_module(source, source.build()), None
        engine, *_ = spmdzero.initialize(model=model, config=cfg)
    args, kwargs = source.inputs(model, engine.train_micro_batch_size_per_gpu() * engine.dp_world_size)
    with capture(engine, inputs) as step:
        loss = source.loss(engine(*args, **kwargs))
        engine.backward(loss)
        step.loss = loss
        engine.step()
    return step


def compile_step(source, config: dict, topology: str, stage: int, micro_batch: Optional[int] = None,
                 shape_only: bool = True) -> AotReport:
    step = capture_step(source, config, stage, micro_batch, shape_only, topology)
    report = step.compile(topology)
    if source.seq_len is not None:
        params = step.gradient_bytes() // step.engine.precision.communication_dtype.itemsize
        report.model_flops = 6 * params * report.micro_batch * source.seq_len
    return report


def compare_stages(make_model, config: dict, topology: str, stages=(0, 1, 2), micro_batch: Optional[int] = None,
                   shape_only: bool = False) -> list[AotReport]:
    """Capture and compile one step per ZeRO stage. ``make_model`` is a ``ModelSource``
    (``aot_models.load_model_source``) or a callable returning a model with an
    ``example_inputs(batch_size)`` method whose forward returns the loss."""
    from .aot_models import ModelSource

    source = make_model if isinstance(make_model, ModelSource) else ModelSource(
        getattr(make_model, "__name__", "model"), make_model, lambda m, b: (tuple(m.example_inputs(b)), {}),
        lambda output: output)
    return [compile_step(source, config, topology, stage, micro_batch, shape_only) for stage in stages]


SEARCH_LIMIT = 4096  # micro-batch per chip: find_max_batch doubles up to it


def find_max_batch(source, config: dict, topology: str, stage: int, shape_only: bool = True,
                   limit: int = SEARCH_LIMIT, known: Optional[dict] = None) -> tuple[int, list[AotReport]]:
    """The largest micro-batch per chip whose step fits: doubling from 1, then bisection.
    Returns it (0 if even 1 does not fit; ``limit`` if that fits: larger sizes are not tried)
    and every report on the way. ``known``: reports already compiled, by micro-batch."""
    reports: list[AotReport] = []

    def fits(batch: int) -> bool:
        report = (known or {}).get(batch)
        reports.append(report if report is not None else compile_step(source, config, topology, stage, batch,
                                                                      shape_only))
        return reports[-1].fits

    if not fits(1):
        return 0, reports
    low, high = 1, None
    while high is None:
        candidate = low * 2
        if candidate > limit:
            return low, reports
        if fits(candidate):
            low = candidate
        else:
            high = candidate
    while high - low > 1:
        mid = (low + high) // 2
        if fits(mid):
            low = mid
        else:
            high = mid
    return low, reports


def search_summary(best: int, tried: list[AotReport], seconds: float) -> dict:
    """What ``find_max_batch`` found, for the report: the answer, every size tried, the
    per-chip total at the answer, and for the next size, by how much it misses and libtpu's
    largest allocation there (what grows with the batch)."""
    by_batch = {r.micro_batch: r for r in tried}
    out = {"max_micro_batch": best, "compiles": len(tried), "seconds": seconds,
           "tried": {r.micro_batch: r.fits for r in tried}, "at_search_limit": best >= SEARCH_LIMIT}
    if best in by_batch:
        out["total_bytes"] = by_batch[best].total_bytes
    miss = by_batch.get(best + 1)
    if miss is not None and not miss.fits:
        largest = (miss.out_of_memory or {}).get("largest_allocations") or []
        out["next"] = {"micro_batch": best + 1, "over_by": miss.over_by,
                       "largest_allocation": largest[0] if largest else None}
    return out


def describe_search(stage: int, found: dict, hbm_bytes: int) -> str:
    best = found["max_micro_batch"]
    line = f"stage {stage}: largest micro-batch per chip that fits: " + (
        f">= {best} (the search limit; larger sizes were not tried)" if found.get("at_search_limit") else str(best))
    if "total_bytes" in found:
        line += f" ({_gib(found['total_bytes'])} of {_gib(hbm_bytes)})"
    following = found.get("next")
    if following:
        line += f"; {following['micro_batch']} misses by {_gib(following['over_by'])}"
        largest = following.get("largest_allocation")
        if largest:
            line += f", its largest allocation {_gib(largest['bytes'])} {largest['shape']}"
    return line + f" ({found['compiles']} compiles, {found['seconds']:.0f} s)"


def stages_table(reports: list[AotReport]) -> str:
    head = f"{'':<28}" + "".join(f"{'stage ' + str(r.stage):>18}" for r in reports)
    rows = [("arguments (model states)", lambda r: _mb(r.memory["argument"]) if r.memory else "-"),
            ("outputs", lambda r: _mb(r.memory["output"]) if r.memory else "-"),
            ("aliased (donated state)", lambda r: _mb(r.memory["alias"]) if r.memory else "-"),
            ("temporaries", lambda r: _mb(r.memory["temp"]) if r.memory else "-"),
            ("code", lambda r: _mb(r.memory["generated_code"]) if r.memory else "-"),
            ("total per chip", lambda r: _mb(r.total_bytes)),
            ("fits in HBM", lambda r: "yes" if r.fits else f"NO (+{r.over_by / GIB:.2f} GiB)"),
            ("traffic / minimum", lambda r: f"{r.traffic.ratio:.2f}" if r.memory else "-"),
            ("roofline step (ms)", lambda r: f"{r.roofline()['step_s'] * 1e3:.1f}" if r.roofline() else "-"),
            ("roofline MFU", lambda r: f"{r.roofline()['mfu']:.0%}" if r.roofline().get('mfu') is not None else "-")]
    kinds = sorted({k for r in reports for k in r.collectives})
    rows += [(f"{k} bytes", lambda r, k=k: _mb(r.collectives.get(k, {}).get("bytes", 0))) for k in kinds]
    lines = [head] + [f"{name:<28}" + "".join(f"{fn(r):>18}" for r in reports) for name, fn in rows]
    return "\n".join(lines)


def _stages(text: str) -> tuple[int, ...]:
    try:
        stages = tuple(int(s) for s in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ZeRO stages such as 0,1,2, got {text!r}") from None
    if any(s not in (0, 1, 2) for s in stages):
        raise argparse.ArgumentTypeError(f"ZeRO stages are 0, 1 and 2 (stage 3 is out of scope), got {text!r}")
    return stages


def default_model() -> str:
    """The repository's example model, wherever the command runs from."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples", "model.py")
    if not os.path.isfile(path):
        raise ValueError("no --model given and the example model (examples/model.py) is not next to this spmdzero "
                         "installation: pass --model PATH.py:NAME or a transformers config.json")
    return f"{path}:TinyGPT"


def _scan_layers_value(value: str) -> str:
    if value != "stacked":
        raise argparse.ArgumentTypeError(f"{value!r}: give no value (spmd.scan_layers=true) or 'stacked'")
    return value


def scan_layers_args(value: bool | str) -> list[str]:
    """``--scan-layers`` as a command line gives it (``spmd.scan_layers``: False, True or
    "stacked")."""
    return ["--scan-layers"] + ([value] if isinstance(value, str) else []) if value else []


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's options (shared with ``spmdzero aot``)."""
    parser.add_argument("--topology", required=True, help="e.g. v5e:2x2, v5e:4x4, v5e:16x16, v5p:2x4x4, v6e:2x2")
    parser.add_argument("--deepspeed_config", required=True)
    from .cli import positive_int

    parser.add_argument("--model", default=None,
                        help="PATH.py:NAME, a transformers config.json, or a directory with one (default: the "
                             "repository's examples/model.py:TinyGPT)")
    parser.add_argument("--stages", default=(0, 1, 2), type=_stages, help="ZeRO stages, comma-separated (default 0,1,2)")
    parser.add_argument("--seq-len", type=positive_int, default=None, help="tokens per sequence (transformers configs)")
    parser.add_argument("--micro-batch", type=positive_int, default=None,
                        help="sequences per chip per micro-step (default: the config's)")
    parser.add_argument("--materialize", action="store_true",
                        help="trace with real parameters instead of shape-only (needs N x the model in host RAM)")
    parser.add_argument("--scan-layers", nargs="?", const=True, default=False, type=_scan_layers_value,
                        metavar="stacked",
                        help="compile the step as the engine runs it with spmd.scan_layers: one loop over the layer "
                             "stack instead of every layer unrolled (needed for 7B-scale compiles on a small host); "
                             "'--scan-layers stacked' as with spmd.scan_layers='stacked' (one parameter per block "
                             "parameter name: the update around the loop does not grow with depth)")
    parser.add_argument("--find-max-batch", action="store_true",
                        help="also find the largest micro-batch per chip that fits (a few compiles per stage)")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of the tables")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="spmdzero aot", description="compile the training step for a TPU topology")
    add_arguments(parser)
    args = parser.parse_args(argv)
    from .aot_models import load_model_source
    from .config import read_config_file

    from .config import parse_config

    stages = args.stages
    shape_only = not args.materialize
    try:
        check_traceable(args.topology)
        config = read_config_file(args.deepspeed_config)
        parse_config(config, args.deepspeed_config)  # as given: a stage-3 config is refused, not compiled as 0-2
        if args.scan_layers:
            config.setdefault("spmd", {})["scan_layers"] = args.scan_layers
        source = load_model_source(args.model or default_model(), args.seq_len)
        reports = [compile_step(source, config, args.topology, stage, args.micro_batch, shape_only)
                   for stage in stages]
        searches = {}
        if args.find_max_batch:
            for stage in stages:
                start = time.perf_counter()
                known = {r.micro_batch: r for r in reports if r.stage == stage}
                best, tried = find_max_batch(source, config, args.topology, stage, shape_only, known=known)
                searches[stage] = search_summary(best, tried, time.perf_counter() - start)
    except (ValueError, RuntimeError) as err:
        print(f"spmdzero aot: {err}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"model": source.name, "topology": args.topology, "shape_only": shape_only,
                          "reports": [r.to_dict() for r in reports], "max_micro_batch": searches}, indent=1))
        return 0
    for report in reports:
        print(report.summary(), end="\n\n")
    print(stages_table(reports))
    for stage, found in searches.items():
        print("\n" + describe_search(stage, found, chip_spec(args.topology).hbm_bytes))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
