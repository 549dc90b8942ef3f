"""DeepSpeed's LR schedules, with DeepSpeed's step semantics.

Each schedule is a pure function of ``last_batch_iteration`` (t). A schedule starts at
t = -1 and writes that lr into the optimizer when it is built, so the first optimizer
step uses the t = -1 lr; every ``step()`` increments t and writes the new lr. The lr is
a Python float in ``param_group['lr']``; spmdzero's optimizers move it to the device as
data, so changing it never recompiles.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from .config import ConfigError, SchedulerConfig

LOG, LINEAR = "log", "linear"


def _per_group(optimizer, value, name: str) -> list[float]:
    groups = optimizer.param_groups
    if isinstance(value, (list, tuple)):
        if len(value) != len(groups):
            raise ConfigError(f"scheduler.params.{name}: expected {len(groups)} values (one per param group), "
                              f"got {len(value)}")
        return [float(v) for v in value]
    return [float(value)] * len(groups)


def _warmup_fraction(t: int, warmup_steps: int, warmup_type: str) -> float:
    if warmup_type == LOG:
        return math.log(t + 1) / math.log(warmup_steps)
    return t / warmup_steps


class LRSchedule:
    """Base: DeepSpeed's scheduler interface over a per-group ``lr_at(t)``."""

    def __init__(self, optimizer, last_batch_iteration: int = -1):
        self.optimizer = optimizer
        self.last_batch_iteration = last_batch_iteration
        self._last_lr: list[float] | None = None
        if last_batch_iteration == -1:
            self._write(self.get_lr())

    def lr_at(self, t: int) -> list[float]:
        raise NotImplementedError

    def get_lr(self) -> list[float]:
        return self.lr_at(self.last_batch_iteration)

    def get_last_lr(self) -> list[float]:
        if self._last_lr is None:
            raise RuntimeError("need to call step() first")
        return self._last_lr

    def step(self, last_batch_iteration: int | None = None) -> None:
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._write(self.get_lr())

    def _write(self, lrs: Sequence[float]) -> None:
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        self._last_lr = [g["lr"] for g in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, sd: dict) -> None:
        self.last_batch_iteration = sd["last_batch_iteration"]


def _check_warmup(warmup_num_steps, warmup_type) -> tuple[int, str]:
    if not isinstance(warmup_num_steps, int) or isinstance(warmup_num_steps, bool) or warmup_num_steps <= 0:
        raise ConfigError(f"scheduler.params.warmup_num_steps must be a positive integer, got {warmup_num_steps!r}")
    if warmup_type not in (LOG, LINEAR):
        raise ConfigError(f"scheduler.params.warmup_type must be 'log' or 'linear', got {warmup_type!r}")
    return max(2, warmup_num_steps), warmup_type


class WarmupLR(LRSchedule):
    """min_lr -> max_lr over warmup_num_steps (log or linear), then constant."""

    def __init__(self, optimizer, warmup_min_lr=0.0, warmup_max_lr=None, warmup_num_steps=1000,
                 warmup_type=LOG, last_batch_iteration=-1):
        if warmup_max_lr is None:
            warmup_max_lr = [g["lr"] for g in optimizer.param_groups]
        self.min_lrs = _per_group(optimizer, warmup_min_lr, "warmup_min_lr")
        self.max_lrs = _per_group(optimizer, warmup_max_lr, "warmup_max_lr")
        self.warmup_num_steps, self.warmup_type = _check_warmup(warmup_num_steps, warmup_type)
        super().__init__(optimizer, last_batch_iteration)

    def _gamma(self, t: int) -> float:
        if t < self.warmup_num_steps:
            return _warmup_fraction(t, self.warmup_num_steps, self.warmup_type)
        return 1.0

    def lr_at(self, t):
        if t < 0:
            return list(self.min_lrs)
        gamma = self._gamma(t)
        return [lo + (hi - lo) * gamma for lo, hi in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay to 0 at total_num_steps."""

    def __init__(self, optimizer, total_num_steps, warmup_min_lr=0.0, warmup_max_lr=0.001,
                 warmup_num_steps=1000, warmup_type=LOG, last_batch_iteration=-1):
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_batch_iteration)

    def _gamma(self, t):
        if t < self.warmup_num_steps:
            return _warmup_fraction(t, self.warmup_num_steps, self.warmup_type)
        return max(0.0, (self.total_num_steps - t) / max(1.0, self.total_num_steps - self.warmup_num_steps))


class WarmupCosineLR(LRSchedule):
    """A ratio of each group's base lr: warmup from warmup_min_ratio to 1, then cosine
    decay to cos_min_ratio at total_num_steps."""

    def __init__(self, optimizer, total_num_steps, warmup_min_ratio=0.0, warmup_num_steps=1000,
                 cos_min_ratio=0.0001, warmup_type=LOG, last_batch_iteration=-1):
        self.total_num_steps = total_num_steps
        self.warmup_min_ratio = warmup_min_ratio
        self.cos_min_ratio = cos_min_ratio
        self.warmup_num_steps, self.warmup_type = _check_warmup(warmup_num_steps, warmup_type)
        self.base_lrs = [float(g["lr"]) for g in optimizer.param_groups]
        super().__init__(optimizer, last_batch_iteration)

    def ratio_at(self, t: int) -> float:
        if t < 0:
            return 0.0
        if t < self.warmup_num_steps:
            frac = _warmup_fraction(t, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + frac * (1.0 - self.warmup_min_ratio)
        progress = min(1.0, (t - self.warmup_num_steps + 1) / max(1, self.total_num_steps - self.warmup_num_steps))
        cosine = (1 + math.cos(math.pi * progress)) / 2
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)

    def lr_at(self, t):
        ratio = self.ratio_at(t)
        return [lr * ratio for lr in self.base_lrs]


class LRRangeTest(LRSchedule):
    """lr = min_lr * (1 + rate * interval), interval = (t + 1) / step_size, floored when staircase."""

    def __init__(self, optimizer, lr_range_test_min_lr=1e-3, lr_range_test_step_size=2000,
                 lr_range_test_step_rate=1.0, lr_range_test_staircase=False, last_batch_iteration=-1):
        self.min_lrs = _per_group(optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size = lr_range_test_step_size
        self.step_rate = lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        super().__init__(optimizer, last_batch_iteration)

    def lr_at(self, t):
        interval = (t + 1) / self.step_size
        if self.staircase:
            interval = math.floor(interval)
        return [lr * (1 + self.step_rate * interval) for lr in self.min_lrs]


SCHEDULES = {cls.__name__: cls for cls in (WarmupLR, WarmupDecayLR, WarmupCosineLR, LRRangeTest)}


def build_scheduler(sched_cfg: SchedulerConfig, optimizer) -> Any:
    """DeepSpeed's schedule by name, else a torch.optim.lr_scheduler class by exact name."""
    cls = SCHEDULES.get(sched_cfg.type) or getattr(torch.optim.lr_scheduler, sched_cfg.type, None)
    if cls is None or not isinstance(cls, type):
        import difflib

        known = sorted(SCHEDULES) + [n for n in dir(torch.optim.lr_scheduler) if n.endswith("LR")]
        close = difflib.get_close_matches(sched_cfg.type, known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(sorted(SCHEDULES))})"
        raise ConfigError(f"scheduler.type {sched_cfg.type!r} is not a known schedule{hint}")
    try:
        return cls(optimizer, **sched_cfg.params)
    except TypeError as err:
        raise ConfigError(f"scheduler.params for {sched_cfg.type!r}: {err}") from None
