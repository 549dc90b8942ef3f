"""Watching the training loop without slowing it: a recompilation guard and DeepSpeed-style
step logs.

The guard counts XLA compilations that happen while ``engine.step()`` executes the step
(torch_xla's ``CompileTime`` metric, read on the host: no device sync). A run compiles a
fixed set of programs during warm-up; a compile after that means something in the traced
step changed. It warns once, or raises past ``spmd.max_recompiles``.

It also counts the graphs a step runs, from the first ``forward`` to the end of
``engine.step()`` (torch_xla's ``TensorsGraphSize`` metric: one sample per graph cut, taken
on the host). A step is one graph; a second one means the step read a device value on the
host, which cuts the trace and makes the device wait for the host. That warns once too.

Step logs follow ``steps_per_print``, with the wall-clock breakdown and DeepSpeed's monitor
events (csv_monitor, tensorboard, wandb, comet; written by process 0, as DeepSpeed does). Only
those steps read device values (loss, grad norm, loss scale); the others touch nothing on the
device. The logs go to the console of ``observe.console``.
"""

from __future__ import annotations

import importlib
import math
import os
import time
import warnings
import weakref
from typing import Callable, Optional

from spmdzero.observe.console import ensure_handler, logger
from spmdzero.observe.reported_engine import ReportedEngine

WARMUP_STEPS = 3  # optimizer steps whose compiles are expected (first boundary, schedules moving to the device)


def compile_count() -> int:
    import torch_xla.debug.metrics as met

    data = met.metric_data("CompileTime")
    return data[0] if data else 0


def graph_count() -> int:
    """Graphs cut so far, by ``torch_xla.sync()`` or by a host read of a lazy tensor."""
    import torch_xla.debug.metrics as met

    data = met.metric_data("TensorsGraphSize")
    return data[0] if data else 0


def host_read_counters(names: Optional[list[str]] = None) -> dict[str, int]:
    """torch_xla's counters of CPU fallbacks, ``aten::*`` (``aten::_local_scalar_dense`` is
    ``.item()``, ``bool()``, an ``if`` on a tensor). In torch_xla 2.9 ``xla::_to_cpu`` moves with
    each of those (their inputs' transfer), not with ``.cpu()``, ``.tolist()``, ``.numpy()`` or
    ``print()``, which move no counter: so it is left out. ``names``: read only these (listing
    every counter costs the host about 1 ms)."""
    import torch_xla.debug.metrics as met

    if names is None:
        names = [n for n in met.counter_names() if n.startswith("aten::")]
    return {n: met.counter_value(n) or 0 for n in names}


_READ_NAMES = {"aten::_local_scalar_dense": ".item(), bool() or an `if` on a tensor"}


class RecompileGuard:
    def __init__(self, max_recompiles: Optional[int],
                 debug_hint: str = "PT_XLA_DEBUG_LEVEL=2 prints the cause of each compilation."):
        self.max_recompiles = max_recompiles
        self.debug_hint = debug_hint  # how to see why a program compiled, on this backend
        self.recompiles = 0
        self._warned = False
        self._warned_graphs = False
        self._graphs_at_start: Optional[int] = None
        self._reads_at_start: dict[str, int] = {}
        self._read_names: Optional[list[str]] = None  # the host-read counters that exist, listed once
        # Warm-up is counted in the optimizer steps this engine ran, not in global_steps: a run
        # resumed from a checkpoint at step 1000 compiles its programs afresh all the same.
        self._boundaries_seen = 0
        self._evaluated = False  # an evaluation forward since the last step (note_evaluation)

    def note_evaluation(self) -> None:
        """Called by an evaluation forward: a recompile at the next step may be its graph."""
        self._evaluated = True

    def _warming_up(self) -> bool:
        return self._boundaries_seen <= WARMUP_STEPS

    def step_started(self) -> None:
        """Called by ``forward``: the step's graph count starts here. Counters are read
        only until the multi-graph warning has fired."""
        if not self._warned_graphs:
            self._graphs_at_start = graph_count()
            if self._read_names is None or self._warming_up():
                self._read_names = list(host_read_counters())
            # counters that first appear after warm-up count from 0 in the warning's figures
            self._reads_at_start = host_read_counters(self._read_names)

    def check_graphs(self, global_steps: int, warmup: bool = False) -> None:
        """After the step's sync: warn once if the step ran more than one graph. ``warmup``:
        the step is known to be warm-up (see ``check``)."""
        start, self._graphs_at_start = self._graphs_at_start, None
        if self._warned_graphs or start is None or self._warming_up() or warmup:
            return
        graphs = graph_count() - start
        if graphs <= 1:
            return
        self._warned_graphs = True
        reads = {n: c - self._reads_at_start.get(n, 0) for n, c in host_read_counters().items()}
        named = [f"{count} x {n} ({_READ_NAMES.get(n, 'an op torch_xla runs on the CPU')})"
                 for n, count in sorted(reads.items()) if count > 0]
        cause = ("torch_xla counted " + ", ".join(named) + " in the step." if named else
                 "torch_xla counted no .item() or bool() read and no op run on the CPU: something called .cpu(), "
                 ".tolist(), .numpy() or print() on a tensor (torch_xla counts none of them), or torch_xla.sync(), "
                 "inside the step.")
        warnings.warn(
            f"spmdzero: a training step ran {graphs} graphs instead of one (global step {global_steps}): a value "
            f"was read back to the host inside the step, which cuts the graph and makes the device wait. {cause} "
            "Remove the read, or move it after engine.step(). transformers models read their masks: with sdpa "
            "attention an attention_mask is checked for all ones, and with no mask and no KV cache the position_ids "
            "are checked for packed sequences (find_packed_sequence_indices); encoders' bidirectional masks "
            "(BERT, T5) are checked for all ones under eager attention too. A decoder (GPT-2, Llama) built with "
            "attn_implementation='eager' and given an attention_mask reads nothing; an encoder given no attention_mask "
            "when every row is full length reads nothing. "
            "PT_XLA_DEBUG_LEVEL=2 prints the Python frame of each graph cut. (warned once)", stacklevel=3)

    def check(self, compiled: int, global_steps: int, boundary: bool, input_shapes: tuple = (),
              warmup: bool = False) -> None:
        """``input_shapes``: the shapes of this step's forward inputs, to name a shape change.
        ``warmup``: the step is known to be warm-up whenever it comes (a torch optimizer creating
        its state, which a skipped step under overflow checks leaves to the next): neither
        checked nor counted among the warm-up steps, so the step after it may compile too."""
        previous, self._last_shapes = getattr(self, "_last_shapes", None), input_shapes
        evaluated, self._evaluated = self._evaluated, False  # this step's, compiled or not
        self._boundaries_seen += boundary and not warmup
        if compiled == 0 or self._warming_up() or warmup:
            return
        self.recompiles += compiled
        where = "an optimizer (boundary) step" if boundary else "a gradient-accumulation micro-step"
        if previous is not None and previous != input_shapes:
            cause = f"The forward's input shapes changed: {list(previous)} -> {list(input_shapes)}. " + (
                "Only the rows changed: a last, smaller batch? DataLoader(..., drop_last=True) keeps every "
                "batch whole; otherwise each new batch size compiles once." if _only_rows_changed(previous, input_shapes)
                else "Variable sequence lengths? Set \"spmd\": {\"shape_buckets\": true} (powers of two) or "
                "{\"pad_to_multiple_of\": 64} in the config to pad dict inputs with an attention_mask (input_ids, "
                "labels, ...) to a few shapes (docs/config.md, Shape buckets; the torchax backend's default).")
        elif evaluated:
            cause = ("An evaluation forward (engine.eval() or torch.no_grad()) ran since the last step: if its "
                     "results were not read before training went on, its pending graph ran together with this "
                     "step's, as another program. Read them (loss.item()) or call torch_xla.sync() after evaluating.")
        else:
            cause = ("Something in the traced step changed: a tensor shape, a Python number baked into the graph "
                     "(or an image grid, image_grid_thw: one program per set of grids, so resize images to one size), "
                     "or a host read such as .item() splitting the step.")
        message = (f"the training step recompiled after warm-up (global step {global_steps}, {where}; "
                   f"{self.recompiles} so far). {cause} {self.debug_hint}")
        if self.max_recompiles is not None and self.recompiles > self.max_recompiles:
            raise RuntimeError(f"spmdzero: {message} This exceeds spmd.max_recompiles={self.max_recompiles}.")
        if not self._warned:
            self._warned = True
            warnings.warn(f"spmdzero: {message} (warned once; set spmd.max_recompiles to make it an error)",
                          stacklevel=3)


def _only_rows_changed(previous: tuple, current: tuple) -> bool:
    """Every input kept its shape but for its first dimension (the batch's rows)."""
    return len(previous) == len(current) and all(
        len(a) == len(b) and len(a) > 0 and tuple(a[1:]) == tuple(b[1:]) for a, b in zip(previous, current))


class Timers:
    """Host time spent in forward/backward/step (tracing and dispatch: execution is
    asynchronous) and the device execution time torch_xla records, per logging window."""

    PHASES = ("forward", "backward", "step")

    def __init__(self, device_clock: Optional[Callable[[], float]] = None):
        self._device_clock = device_clock  # None: no device time (the torchax backend)
        self.reset()

    def reset(self) -> None:
        self.seconds = dict.fromkeys(self.PHASES, 0.0)
        self.calls = dict.fromkeys(self.PHASES, 0)
        self._device_start = self._device_clock() if self._device_clock else 0.0

    def add(self, phase: str, seconds: float) -> None:
        self.seconds[phase] += seconds
        self.calls[phase] += 1

    def summary_ms(self) -> dict[str, float]:
        out = {p: 1e3 * self.seconds[p] / max(1, self.calls[p]) for p in self.PHASES}
        if self._device_clock:
            out["device"] = 1e3 * (self._device_clock() - self._device_start) / max(1, self.calls["step"])
        return out


def xla_execute_seconds() -> float:
    """torch_xla's device execution time so far (``ExecuteReplicatedTime``), read on the host."""
    import torch_xla.debug.metrics as met

    data = met.metric_data("ExecuteReplicatedTime")
    return data[1] / 1e9 if data else 0.0  # the accumulator is in nanoseconds


class Monitors:
    """DeepSpeed's monitor sections: csv_monitor, tensorboard, wandb and comet, with DeepSpeed's
    event names, steps (global samples) and files. As DeepSpeed's MonitorMaster, only process 0
    makes and writes them (wandb.init / comet_ml.start happen here, when the engine is built).
    A backend package that is missing is named in one warning, and training goes on."""

    SECTIONS = ("csv_monitor", "tensorboard", "wandb", "comet")

    def __init__(self, config, process_index: int = 0):
        # configured on any process: every process then reads the same device values at the
        # same steps (StepLogger.interval), whichever of them writes
        self.enabled = any(getattr(config, name).enabled for name in self.SECTIONS)
        self.writers = []
        if process_index != 0:
            return
        makers = {"csv_monitor": _CsvWriter, "tensorboard": _TensorBoardWriter, "wandb": _WandbWriter,
                  "comet": _CometWriter}
        for name in self.SECTIONS:
            section = getattr(config, name)
            if section.enabled:
                writer = makers[name].make(section)
                if writer is not None:
                    self.writers.append(writer)

    def write(self, events: list[tuple[str, float, int]]) -> None:
        """``events``: (name, value, global samples), DeepSpeed's event tuples."""
        for writer in self.writers:
            writer.write(events)


def _import_backend(module: str, key: str, pip: str, what: str):
    """``module``, or None after one warning that names it and the config key that asked."""
    try:
        return importlib.import_module(module)
    except ImportError:
        warnings.warn(f"spmdzero: {key}.enabled needs the {module!r} package (pip install {pip}); not writing "
                      f"{what}. Training goes on", stacklevel=5)
        return None


class _CsvWriter:
    def __init__(self, log_dir: str):
        self.log_dir = log_dir
        os.makedirs(log_dir, exist_ok=True)

    @classmethod
    def make(cls, section) -> "_CsvWriter":
        return cls(os.path.join(section.output_path or "", section.job_name))

    def write(self, events) -> None:
        import csv

        for name, value, step in events:
            path = os.path.join(self.log_dir, name.replace("/", "_").replace(" ", "_") + ".csv")
            new = not os.path.exists(path)
            with open(path, "a", newline="") as f:
                writer = csv.writer(f)
                if new:
                    writer.writerow(["step", name.split("/")[-1]])
                writer.writerow([step, value])


class _TensorBoardWriter:
    def __init__(self, summary_writer):
        self.summary_writer = summary_writer

    @classmethod
    def make(cls, section) -> "Optional[_TensorBoardWriter]":
        # torch's SummaryWriter imports tensorboard: a missing package shows here
        if _import_backend("tensorboard", "tensorboard", "tensorboard", "TensorBoard events") is None:
            return None
        from torch.utils.tensorboard import SummaryWriter

        return cls(SummaryWriter(log_dir=os.path.join(section.output_path or "", section.job_name)))

    def write(self, events) -> None:
        for name, value, step in events:
            self.summary_writer.add_scalar(name, value, step)
        self.summary_writer.flush()


class _WandbWriter:
    """A Weights & Biases run: ``wandb.init(project, group, entity=team)`` as DeepSpeed calls it
    (outside notebooks wandb returns a run already started instead of making another), then each
    event at ``step=`` its global samples. The events of one print step go in one ``wandb.log``
    call, which wandb records as DeepSpeed's one call per event at the same step."""

    def __init__(self, wandb):
        self.wandb = wandb

    @classmethod
    def make(cls, section) -> "Optional[_WandbWriter]":
        wandb = _import_backend("wandb", "wandb", "wandb", "to Weights & Biases")
        if wandb is None:
            return None
        wandb.init(project=section.project, group=section.group, entity=section.team)
        return cls(wandb)

    def write(self, events) -> None:
        by_step: dict[int, dict[str, float]] = {}
        for name, value, step in events:
            by_step.setdefault(step, {})[name] = value
        for step, values in by_step.items():
            self.wandb.log(values, step=step)


class _CometWriter:
    """A Comet experiment from ``comet_ml.start`` with the section's keys (offline with
    ``online: false``), named ``experiment_name``. As DeepSpeed, an event is logged the first
    time its name is seen, then once at least ``samples_log_interval`` samples have passed
    since it was last logged."""

    def __init__(self, experiment, samples_log_interval: int):
        self.experiment = experiment
        self.samples_log_interval = samples_log_interval
        self._logged_at: dict[str, int] = {}  # event name -> the global samples it was last logged at

    @classmethod
    def make(cls, section) -> "Optional[_CometWriter]":
        comet_ml = _import_backend("comet_ml", "comet", "comet_ml", "to Comet")
        if comet_ml is None:
            return None
        experiment = comet_ml.start(api_key=section.api_key, project=section.project, workspace=section.workspace,
                                    experiment_key=section.experiment_key, mode=section.mode, online=section.online)
        if section.experiment_name is not None:
            experiment.set_name(section.experiment_name)
        return cls(experiment, section.samples_log_interval)

    def write(self, events) -> None:
        for name, value, step in events:
            last = self._logged_at.get(name)
            if last is None or step - last >= self.samples_log_interval:
                self._logged_at[name] = step
                self.experiment.log_metric(name, value, step=step)


# the engines told (weakly held: an engine that is gone is forgotten)
_TOLD_NONFINITE: "weakref.WeakSet" = weakref.WeakSet()


def notice_nonfinite(engine: ReportedEngine, value: Optional[float], what: str) -> None:
    """Say once that an fp32 run went non-finite. Only called where the value was read from
    the device anyway (print steps, checkpoint saves): no host sync of its own."""
    if value is None or math.isfinite(value) or engine.precision.check_overflow or engine in _TOLD_NONFINITE:
        return
    _TOLD_NONFINITE.add(engine)
    warnings.warn(f"spmdzero: the {what} is {value} at global step {engine.global_steps}. In fp32 there is no loss "
                  "scaler to skip such a step, so the parameters it updated are no longer finite; restart from a "
                  "checkpoint with a lower lr or gradient_clipping (bf16/fp16 runs skip these steps)", stacklevel=3)


class StepLogger:
    """Every steps_per_print optimizer steps: DeepSpeed's step line with throughput, the
    wall-clock breakdown when asked, and the monitors' events (every 10 steps when
    steps_per_print is unset). These are the only steps that read the device."""

    def __init__(self, config, device_clock: Optional[Callable[[], float]] = xla_execute_seconds,
                 process_index: int = 0):
        self.steps_per_print = config.steps_per_print
        self.wall_clock_breakdown = config.wall_clock_breakdown
        self.monitors = Monitors(config, process_index)
        self.interval = self.steps_per_print or (10 if self.monitors.enabled else None)
        self.timers = Timers(device_clock)
        self._since = time.perf_counter()
        self._samples = 0

    def after_boundary(self, engine) -> None:
        if not self.interval:
            return
        self._samples += engine.samples_last_step
        if engine.global_steps % self.interval:
            return
        elapsed = time.perf_counter() - self._since
        throughput = self._samples / elapsed if elapsed > 0 else float("nan")
        # the mean over the step's accumulation window (tells once of a non-finite fp32 loss)
        loss = engine.step_loss() if hasattr(engine, "step_loss") else engine.last_loss()
        if self.steps_per_print:
            self._log_line(engine, loss, throughput)
            if self.wall_clock_breakdown:
                ms = self.timers.summary_ms()
                logger.info("time (ms) | " + " | ".join(f"{k}: {v:.2f}" for k, v in ms.items()))
        events = [("Train/Samples/lr", engine.get_lr()[0], engine.global_samples)]
        if loss is not None:
            events.append(("Train/Samples/train_loss", loss, engine.global_samples))
        if engine.precision.scales_loss:
            events.append(("Train/Samples/loss_scale", engine.current_loss_scale(), engine.global_samples))
        if self.wall_clock_breakdown:
            events += [(f"Train/Samples/elapsed_time_ms_{k}", v, engine.global_samples)
                       for k, v in self.timers.summary_ms().items()]
        self.monitors.write(events)
        self.timers.reset()
        self._since, self._samples = time.perf_counter(), 0

    @staticmethod
    def _log_line(engine: ReportedEngine, loss: Optional[float], throughput: float) -> None:
        ensure_handler()
        lr = ", ".join(f"{v:.4e}" for v in engine.get_lr())
        parts = [f"step={engine.global_steps}", f"skipped={engine.skipped_steps}", f"lr=[{lr}]"]
        if loss is not None:
            parts.append(f"loss={loss:.4f}")
        norm = engine.get_global_grad_norm()
        if norm is not None:
            parts.append(f"grad_norm={norm:.4f}")
        if engine.precision.scales_loss:
            parts.append(f"loss_scale={engine.current_loss_scale():g}")
        parts.append(f"samples/sec={throughput:.1f}")
        # 6 FLOPs per parameter per sample (forward 2, backward 4): a rough model-FLOPs figure
        params = sum(p.numel() for p in engine.module.parameters())
        parts.append(f"est. model TFLOP/s={6 * params * throughput / 1e12:.3g}")
        logger.info(", ".join(parts))


class ThroughputTimer:
    """DeepSpeed's ``engine.tput_timer``: samples per second over optimizer steps, from the
    wall time between step boundaries after the first ``start_step`` steps (which compile).
    The boundary is a device sync (``engine.step()`` ends the trace), so host time is fair."""

    def __init__(self, engine: ReportedEngine, start_step: int = 2):
        self._engine = engine
        self.start_step = start_step
        self.epoch_count = 0
        self.micro_step_count = 0
        self.total_elapsed_time = 0.0
        self._last: Optional[float] = None
        self._timed_steps = 0

    @property
    def batch_size(self) -> int:
        return self._engine.train_batch_size()

    @property
    def global_step_count(self) -> int:
        return self._engine.global_steps

    def update_epoch_count(self) -> None:
        self.epoch_count += 1
        self.micro_step_count = 0

    def after_boundary(self) -> None:
        now = time.perf_counter()
        self.micro_step_count += self._engine.gradient_accumulation_steps()
        if self._last is not None and self._engine.global_steps > self.start_step:
            self.total_elapsed_time += now - self._last
            self._timed_steps += 1
        self._last = now

    def avg_samples_per_sec(self) -> float:
        if not self._timed_steps:
            return float("-inf")  # DeepSpeed's value before any timed step
        return self.batch_size * self._timed_steps / self.total_elapsed_time
