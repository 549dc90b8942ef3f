"""What checkpoints need of an engine, as a typed interface (``typing.Protocol``): the state
protocol both backends implement, and the counters a checkpoint saves and restores.

Why here, not on the engine: ``io`` sits below the engines (``pyproject.toml``'s layers), so it
names the face it reads instead of importing an engine class; ``train/engine_protocol.py`` joins
this face with the others into the engine's whole interface, which a test holds both backends'
engines to."""

from __future__ import annotations

from typing import Any, Optional, Protocol

import torch

from spmdzero.io.shards import StateShards


class CheckpointedEngine(Protocol):
    """An engine as ``save_checkpoint``/``load_checkpoint`` (and consolidation) read it."""

    module: torch.nn.Module
    optimizer: Any  # DeepSpeed's ZeRO optimizer face (None without an optimizer)
    basic_optimizer: Any  # the optimizer the engine steps
    lr_scheduler: Any
    plan: Any  # sharding.plan.ShardingPlan
    precision: Any  # optim.precision.PrecisionPolicy
    global_steps: int
    global_samples: int
    micro_steps: int
    skipped_steps: int

    def state_tensors(self) -> dict[str, tuple[Any, tuple]]:
        """Every device tensor of the training state by checkpoint key, with its plan layout."""

    def optimized_names(self) -> dict[torch.Tensor, str]:
        """{optimizer target: its name in checkpoints}."""

    def stacked_layers(self) -> dict[str, str]:
        """{stacked parameter name: its stack's name} under ``spmd.scan_layers='stacked'``."""

    def state_shards(self) -> StateShards:
        """The backend's side of torch.distributed.checkpoint: each process's own shards."""

    def loaded(self, new_window: bool) -> None:
        """A load has written the state: the engine takes it up."""

    @property
    def scales_loss(self) -> bool:
        """Whether the loss scaler is part of the state (fp16)."""

    @property
    def lazy_optimizer_state(self) -> bool:
        """Whether the optimizer creates its states at its first step."""

    def placeholder_optimizer_state(self) -> list:
        """States for a load to write into, where the optimizer has none yet."""

    def drop_optimizer_state(self, targets) -> None:
        """The states of ``targets`` back to none."""

    def validated_config(self) -> Any:
        """The parsed config."""

    def gradient_accumulation_steps(self) -> int: ...

    def is_gradient_accumulation_boundary(self) -> bool: ...

    def get_global_grad_norm(self) -> Optional[float]: ...
