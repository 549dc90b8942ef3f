"""What the reports and monitors read of an engine, as a typed interface (``typing.Protocol``).

Why here: ``observe`` sits below the engines, so it names the face it reads instead of importing
an engine class; ``train/engine_protocol.py`` joins it with the other faces."""

from __future__ import annotations

from typing import Any, Optional, Protocol

import torch


class ReportedEngine(Protocol):
    """An engine as ``sharding_report``, the step log, the monitors and the throughput timer read it."""

    module: torch.nn.Module
    optimizer: Any
    plan: Any  # sharding.plan.ShardingPlan
    mesh: Any  # the device mesh (torch_xla's or JAX's)
    precision: Any  # optim.precision.PrecisionPolicy
    global_steps: int
    global_samples: int
    skipped_steps: int
    tput_timer: Any
    samples_last_step: int  # rows the last optimizer step trained on

    def state_tensors(self) -> dict[str, tuple[Any, tuple]]: ...

    def optimized_names(self) -> dict[torch.Tensor, str]: ...

    def get_global_grad_norm(self) -> Optional[float]: ...

    def step_loss(self) -> Optional[float]: ...

    def last_loss(self) -> Optional[float]: ...

    def current_loss_scale(self) -> float: ...

    def get_lr(self) -> list: ...
