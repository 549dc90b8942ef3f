"""Watching the training loop without slowing it: a recompilation guard and DeepSpeed-style
step logs.

The guard counts XLA compilations that happen while ``engine.step()`` executes the step
(torch_xla's ``CompileTime`` metric, read on the host: no device sync). A run compiles a
fixed set of programs during warm-up; a compile after that means something in the traced
step changed. It warns once, or raises past ``spmd.max_recompiles``.

Step logs follow ``steps_per_print``. Only those steps read device values (loss, grad norm,
loss scale); the others touch nothing on the device.
"""

from __future__ import annotations

import logging
import time
import warnings
from typing import Optional

logger = logging.getLogger("spmdzero")
WARMUP_STEPS = 3  # optimizer steps whose compiles are expected (first boundary, schedules moving to the device)


def _ensure_handler() -> None:
    """Like DeepSpeed, show INFO step logs on our own handler, unless the application
    configured the "spmdzero" logger itself."""
    if not logger.handlers and logger.level == logging.NOTSET:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[spmdzero] %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False


def compile_count() -> int:
    import torch_xla.debug.metrics as met

    data = met.metric_data("CompileTime")
    return data[0] if data else 0


class RecompileGuard:
    def __init__(self, max_recompiles: Optional[int]):
        self.max_recompiles = max_recompiles
        self.recompiles = 0
        self._warned = False

    def check(self, compiled: int, global_steps: int, boundary: bool) -> None:
        if compiled == 0 or global_steps <= WARMUP_STEPS:
            return
        self.recompiles += compiled
        where = "an optimizer (boundary) step" if boundary else "a gradient-accumulation micro-step"
        message = (f"the training step recompiled after warm-up (global step {global_steps}, {where}; "
                   f"{self.recompiles} so far). Something in the traced step changed: a tensor shape (a smaller "
                   "last batch?), a Python number baked into the graph, or a host read such as .item() splitting "
                   "the step. PT_XLA_DEBUG_LEVEL=2 prints the cause of each compilation.")
        if self.max_recompiles is not None and self.recompiles > self.max_recompiles:
            raise RuntimeError(f"spmdzero: {message} This exceeds spmd.max_recompiles={self.max_recompiles}.")
        if not self._warned:
            self._warned = True
            warnings.warn(f"spmdzero: {message} (warned once; set spmd.max_recompiles to make it an error)",
                          stacklevel=3)


class StepLogger:
    """DeepSpeed's steps_per_print line, plus throughput."""

    def __init__(self, steps_per_print: Optional[int]):
        self.steps_per_print = steps_per_print
        self._since = time.perf_counter()
        self._samples = 0

    def after_boundary(self, engine) -> None:
        if not self.steps_per_print:
            return
        self._samples += engine.train_batch_size()
        if engine.global_steps % self.steps_per_print:
            return
        _ensure_handler()
        elapsed = time.perf_counter() - self._since
        throughput = self._samples / elapsed if elapsed > 0 else float("nan")
        loss = engine.last_loss()
        lr = ", ".join(f"{v:.4e}" for v in engine.get_lr())
        parts = [f"step={engine.global_steps}", f"skipped={engine.skipped_steps}", f"lr=[{lr}]"]
        if loss is not None:
            parts.append(f"loss={loss:.4f}")
        norm = engine.get_global_grad_norm()
        if norm is not None:
            parts.append(f"grad_norm={norm:.4f}")
        if engine.precision.scales_loss:
            parts.append(f"loss_scale={engine.loss_scale():g}")
        parts.append(f"samples/sec={throughput:.1f}")
        # 6 FLOPs per parameter per sample (forward 2, backward 4): a rough model-FLOPs figure
        params = sum(p.numel() for p in engine.module.parameters())
        parts.append(f"est. model TFLOP/s={6 * params * throughput / 1e12:.3g}")
        logger.info(", ".join(parts))
        self._since, self._samples = time.perf_counter(), 0
