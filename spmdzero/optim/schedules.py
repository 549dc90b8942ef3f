"""DeepSpeed's LR schedules, with DeepSpeed's step semantics.

Each schedule is a pure function of ``last_batch_iteration`` (t). A schedule starts at
t = -1 and writes that lr into the optimizer when it is built, so the first optimizer
step uses the t = -1 lr; every ``step()`` increments t and writes the new lr. The lr is
a Python float in ``param_group['lr']``; spmdzero's optimizers move it to the device as
data, so changing it never recompiles.

When a step can be skipped inside the graph (mixed precision overflow), the engine calls
``step_if(applied)`` instead: t becomes a device counter and the same formulas run as
graph ops (``optim/ops.py``'s ``TORCH_OPS``; ``HOST_OPS`` on the host), so the schedule does not advance on skipped steps, as in
DeepSpeed, without reading the overflow flag on the host.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch

from spmdzero.config.errors import ConfigError
from spmdzero.config.schema import SchedulerConfig
from spmdzero.config.checks import check_params
from spmdzero.optim.ops import HOST_OPS, TORCH_OPS

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


# The formulas below are written branch-free (both sides of a `where` are evaluated), with
# guards so that the side not taken stays finite, so one formula serves the host and the device.


def _warmup_fraction(t, warmup_steps: int, warmup_type: str, M):
    t_seen = M.maximum(t, 0)
    if warmup_type == LOG:
        return M.log(t_seen + 1) / math.log(warmup_steps)
    return t_seen / warmup_steps


class LRSchedule:
    """Base: DeepSpeed's scheduler interface over a per-group ``lr_at(t, M)``.

    ``t`` is a Python int, or (after ``step_if``) a device tensor counting applied steps."""

    def __init__(self, optimizer, last_batch_iteration: int = -1):
        self.optimizer = optimizer
        self.last_batch_iteration = last_batch_iteration
        self._last_lr = None
        self._device_ops = None  # the math for a step count kept as a JAX array (keep_on_device's ops)
        if last_batch_iteration == -1:
            self._write(self.get_lr())

    def lr_at(self, t, M=HOST_OPS) -> list:
        raise NotImplementedError

    def _math(self):
        t = self.last_batch_iteration
        if isinstance(t, torch.Tensor):
            return TORCH_OPS
        return HOST_OPS if isinstance(t, (int, float)) else self._device_ops  # a JAX count (the torchax engine)

    def get_lr(self) -> list:
        return self.lr_at(self.last_batch_iteration, self._math())

    def get_last_lr(self) -> list[float]:
        if self._last_lr is None:
            raise RuntimeError("need to call step() first")
        return [float(lr) for lr in self._last_lr]  # reads the device in device mode

    def step(self, last_batch_iteration: int | None = None) -> None:
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        self.last_batch_iteration = last_batch_iteration
        self._write(self.get_lr())

    def step_if(self, applied: torch.Tensor) -> None:
        """Advance only where ``applied`` (a device bool) holds, inside the graph: DeepSpeed
        does not step the schedule on a skipped (overflow) step."""
        if isinstance(applied, torch.Tensor):
            self.keep_on_device(applied.device)
        self.last_batch_iteration = self.last_batch_iteration + self._math().float32(applied)
        self._write(self.get_lr())

    def keep_on_device(self, device, put=None, ops=None) -> None:
        """Hold the step count as a device scalar, as ``step_if`` leaves it, and the lrs as
        computed from it: the graph that steps the schedule with ``step_if`` then reads the
        same inputs at its first step as at every later one (one compile, not two). The
        torchax engine keeps it as a JAX array instead: ``put`` makes that from the count, and
        ``ops`` (``optim.ops.jax_ops()``) is the math on it."""
        t = self.last_batch_iteration
        if not isinstance(t, (int, float)):
            return
        if put is not None:
            self._device_ops = ops
            self.last_batch_iteration = put(float(t))
        else:
            # sent as a 1-element array: torch_xla turns a 0-dim transfer of 0 or 1 (the count
            # right after a resume) into a graph constant, which would change the graph
            self.last_batch_iteration = torch.tensor([float(t)], dtype=torch.float32).to(device).reshape(())
        self._write(self.get_lr())

    def _write(self, lrs: Sequence) -> None:
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        self._last_lr = [g["lr"] for g in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        return {"last_batch_iteration": int(self.last_batch_iteration)}

    def load_state_dict(self, sd: dict) -> None:
        self.last_batch_iteration = sd["last_batch_iteration"]


def _check_warmup(warmup_num_steps, warmup_type) -> tuple[int, str]:
    """DeepSpeed's warmup length, at least 2 steps as DeepSpeed makes it. 0 is accepted: it is what
    transformers' Trainer fills an "auto" ``warmup_num_steps`` with when no warmup is asked."""
    if not isinstance(warmup_num_steps, int) or isinstance(warmup_num_steps, bool) or warmup_num_steps < 0:
        raise ConfigError(f"scheduler.params.warmup_num_steps must be a non-negative integer, got {warmup_num_steps!r}")
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

    def _after_warmup(self, t, M):
        return 1.0

    def lr_at(self, t, M=HOST_OPS):
        warm = _warmup_fraction(t, self.warmup_num_steps, self.warmup_type, M)
        gamma = M.where(t < self.warmup_num_steps, warm, self._after_warmup(t, M))
        return [M.where(t < 0, lo, lo + (hi - lo) * gamma) for lo, hi in zip(self.min_lrs, self.max_lrs)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then linear decay to 0 at total_num_steps."""

    def __init__(self, optimizer, total_num_steps, warmup_min_lr=0.0, warmup_max_lr=0.001,
                 warmup_num_steps=1000, warmup_type=LOG, last_batch_iteration=-1):
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_batch_iteration)

    def _after_warmup(self, t, M):
        return M.maximum(0.0, (self.total_num_steps - t) / max(1.0, self.total_num_steps - self.warmup_num_steps))


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

    def ratio_at(self, t, M=HOST_OPS):
        frac = _warmup_fraction(t, self.warmup_num_steps, self.warmup_type, M)
        warm = self.warmup_min_ratio + frac * (1.0 - self.warmup_min_ratio)
        progress = M.minimum(1.0, (t - self.warmup_num_steps + 1) / max(1, self.total_num_steps - self.warmup_num_steps))
        cosine = (1 + M.cos(math.pi * progress)) / 2
        after = M.maximum(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * cosine)
        return M.where(t < 0, 0.0, M.where(t < self.warmup_num_steps, warm, after))

    def lr_at(self, t, M=HOST_OPS):
        ratio = self.ratio_at(t, M)
        return [lr * ratio for lr in self.base_lrs]


class LRRangeTest(LRSchedule):
    """lr = min_lr * (1 + rate * interval), interval = (t + 1) / step_size, floored when staircase."""

    def __init__(self, optimizer, lr_range_test_min_lr=1e-3, lr_range_test_step_size=2000,
                 lr_range_test_step_rate=1.0, lr_range_test_staircase=False, last_batch_iteration=-1):
        if not lr_range_test_step_size > 0:  # it divides the step count
            raise ValueError(f"lr_range_test_step_size must be > 0, got {lr_range_test_step_size!r}")
        self.min_lrs = _per_group(optimizer, lr_range_test_min_lr, "lr_range_test_min_lr")
        self.step_size = lr_range_test_step_size
        self.step_rate = lr_range_test_step_rate
        self.staircase = lr_range_test_staircase
        super().__init__(optimizer, last_batch_iteration)

    def lr_at(self, t, M=HOST_OPS):
        interval = (t + 1) / self.step_size
        if self.staircase:
            interval = M.floor(interval)
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
        self._device_ops = None  # the math for a step count kept as a JAX array (keep_on_device's ops)
        if last_batch_iteration == -1:  # DeepSpeed writes the minima without recording a last lr
            for group, lr in zip(optimizer.param_groups, self.min_lrs):
                group["lr"] = lr
            if self.cycle_momentum:
                self._write_momentum(self.min_moms)

    def _scale(self, t, M):
        iteration = t + 1
        cycle = M.floor(1 + iteration / self.total_size)
        x = 1.0 + iteration / self.total_size - cycle
        in_first_half = x <= self.step_ratio
        rising = x / self.step_ratio
        falling = (x - 1) / ((self.step_ratio - 1) or 1.0)  # a zero-length second half never falls
        scale = M.where(in_first_half, rising, falling)
        if not (self.first_stair_count or self.second_stair_count):
            return scale
        # Stairs: quantise from the integer offset in the cycle, as DeepSpeed does.
        stairs = M.where(in_first_half, float(self.first_stair_count), float(self.second_stair_count))
        in_cycle = M.remainder(iteration, self.total_size)
        position = M.where(in_cycle <= self.first_step_size, in_cycle * stairs / self.first_step_size,
                           (self.total_size - in_cycle) * stairs / (self.second_step_size or 1.0))
        quantised = M.floor(position) / M.maximum(stairs, 1.0)
        return M.where(stairs > 0, quantised, scale)

    def _decay_factor(self, t, rate, M):
        interval = M.maximum(t - self.total_size + 1, 0) / self.decay_step_size
        return 1 + rate * interval

    def lr_at(self, t, M=HOST_OPS):
        scale = self._scale(t, M)
        in_cycle = t < self.total_size
        lrs = []
        for lo, hi in zip(self.min_lrs, self.max_lrs):
            decayed = lo if self.skip_lr_decay else lo / self._decay_factor(t, self.decay_lr_rate, M)
            lrs.append(M.where(in_cycle, lo + (hi - lo) * scale, decayed))
        return lrs

    def momentum_at(self, t, M=HOST_OPS) -> list:
        scale = self._scale(t, M)
        in_cycle = t < self.total_size
        moms = []
        for lo, hi in zip(self.min_moms, self.max_moms):
            decayed = hi if self.skip_mom_decay else hi * self._decay_factor(t, self.decay_mom_rate, M)
            moms.append(M.where(in_cycle, hi - (hi - lo) * scale, decayed))
        return moms

    def get_mom(self):
        if not self.cycle_momentum:
            return None
        return [(m, self.SECOND_BETA) for m in self.momentum_at(self.last_batch_iteration, self._math())]

    def _write_momentum(self, moms) -> None:
        for group, mom in zip(self.optimizer.param_groups, moms):
            group["betas"] = (mom, self.SECOND_BETA)

    def _write(self, lrs) -> None:  # only step() and step_if() write: the constructor sets the minima
        super()._write(lrs)
        if self.cycle_momentum:
            self._write_momentum(self.momentum_at(self.last_batch_iteration, self._math()))


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
