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

from .config import ConfigError, SchedulerConfig, check_params

LOG, LINEAR = "log", "linear"


def _per_group(optimizer, value, name: str) -> list[float]:
    groups = optimizer.param_groups
    values = list(value) if isinstance(value, (list, tuple)) else [value] * len(groups)
    if len(values) != len(groups):
        raise ConfigError(f"scheduler.params.{name}: expected {len(groups)} values (one per param group), "
                          f"got {len(values)}")
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
        raise ConfigError(f"scheduler.params.{name} must be a number or one number per param group, got {value!r}")
    return [float(v) for v in values]


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


class OneCycle(LRSchedule):
    """1cycle: lr climbs min -> max over cycle_first_step_size steps and back over
    cycle_second_step_size (optionally in stairs), then decays. When the optimizer has
    ``betas`` the first beta cycles the opposite way (max -> min -> max) and, as in
    DeepSpeed, the second beta is written as 0.99."""

    SECOND_BETA = 0.99  # DeepSpeed's fixed value

    def __init__(self, optimizer, cycle_min_lr, cycle_max_lr, decay_lr_rate=0.0, cycle_first_step_size=2000,
                 cycle_second_step_size=None, cycle_first_stair_count=0, cycle_second_stair_count=None,
                 decay_step_size=0, cycle_momentum=True, cycle_min_mom=0.8, cycle_max_mom=0.9, decay_mom_rate=0.0,
                 last_batch_iteration=-1):
        first = float(cycle_first_step_size)
        second = float(cycle_second_step_size) if cycle_second_step_size is not None else first
        if first <= 0:
            raise ConfigError(f"scheduler.params.cycle_first_step_size must be positive, got {cycle_first_step_size!r}")
        if second < 0:
            raise ConfigError(f"scheduler.params.cycle_second_step_size must be >= 0, got {cycle_second_step_size!r}")
        self.first_step_size, self.second_step_size = first, second
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = cycle_first_stair_count if cycle_second_stair_count is None else cycle_second_stair_count
        self.decay_step_size = decay_step_size
        self.min_lrs = _per_group(optimizer, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(optimizer, cycle_max_lr, "cycle_max_lr")
        self.decay_lr_rate = decay_lr_rate
        self.skip_lr_decay = math.isclose(decay_step_size, 0) or math.isclose(decay_lr_rate, 0)
        self.cycle_momentum = cycle_momentum and "betas" in optimizer.defaults
        if cycle_momentum and not self.cycle_momentum:
            import warnings

            warnings.warn(f"OneCycle: cycle_momentum is disabled because {type(optimizer).__name__} has no betas",
                          stacklevel=2)
        if self.cycle_momentum:
            self.min_moms = _per_group(optimizer, cycle_min_mom, "cycle_min_mom")
            self.max_moms = _per_group(optimizer, cycle_max_mom, "cycle_max_mom")
            self.decay_mom_rate = decay_mom_rate
            self.skip_mom_decay = math.isclose(decay_step_size, 0) or math.isclose(decay_mom_rate, 0)
        self.optimizer = optimizer
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = None
        if last_batch_iteration == -1:  # DeepSpeed writes the minima without recording a last lr
            for group, lr in zip(optimizer.param_groups, self.min_lrs):
                group["lr"] = lr
            if self.cycle_momentum:
                self._write_momentum(self.min_moms)

    def _scale(self, t: int) -> float:
        iteration = t + 1
        cycle = math.floor(1 + iteration / self.total_size)
        x = 1.0 + iteration / self.total_size - cycle
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:  # quantise from the integer offset, as DeepSpeed does
            in_cycle = iteration % self.total_size
            if in_cycle <= self.first_step_size:
                position = in_cycle * stairs / self.first_step_size
            else:
                position = (self.total_size - in_cycle) * stairs / self.second_step_size
            scale = math.floor(position) / stairs
        return scale

    def lr_at(self, t):
        if t < self.total_size:
            scale = self._scale(t)
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        interval = (t - self.total_size + 1) / self.decay_step_size
        factor = 1 + self.decay_lr_rate * interval
        return [lo / factor for lo in self.min_lrs]

    def momentum_at(self, t) -> list[float]:
        if t < self.total_size:
            scale = self._scale(t)
            return [hi - (hi - lo) * scale for lo, hi in zip(self.min_moms, self.max_moms)]
        if self.skip_mom_decay:
            return list(self.max_moms)
        interval = (t - self.total_size + 1) / self.decay_step_size
        factor = 1 + self.decay_mom_rate * interval
        return [hi * factor for hi in self.max_moms]

    def get_mom(self):
        return [(m, self.SECOND_BETA) for m in self.momentum_at(self.last_batch_iteration)] if self.cycle_momentum else None

    def _write_momentum(self, moms) -> None:
        for group, mom in zip(self.optimizer.param_groups, moms):
            group["betas"] = (mom, self.SECOND_BETA)

    def step(self, last_batch_iteration=None):
        super().step(last_batch_iteration)
        if self.cycle_momentum:
            self._write_momentum(self.momentum_at(self.last_batch_iteration))


SCHEDULES = {cls.__name__: cls for cls in (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest)}


def build_scheduler(sched_cfg: SchedulerConfig, optimizer) -> Any:
    """DeepSpeed's schedule by name, else a torch.optim.lr_scheduler class by exact name."""
    cls = SCHEDULES.get(sched_cfg.type) or getattr(torch.optim.lr_scheduler, sched_cfg.type, None)
    if cls is None or not isinstance(cls, type):
        import difflib

        known = sorted(SCHEDULES) + [n for n in dir(torch.optim.lr_scheduler) if n.endswith("LR")]
        close = difflib.get_close_matches(sched_cfg.type, known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else f" (known: {', '.join(sorted(SCHEDULES))})"
        raise ConfigError(f"scheduler.type {sched_cfg.type!r} is not a known schedule{hint}")
    check_params(cls, sched_cfg.params, f"scheduler.params for {sched_cfg.type!r}", skip=("optimizer",))
    try:
        return cls(optimizer, **sched_cfg.params)
    except ConfigError:
        raise
    except (TypeError, ValueError) as err:
        raise ConfigError(f"scheduler.params for {sched_cfg.type!r}: {err}") from None
