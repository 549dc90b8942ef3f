"""The engine's interface, typed: what every layer above and below may use of an engine,
whichever backend built it.

The faces the lower layers read are declared where they are read (``io/checkpointed_engine.py``,
``observe/reported_engine.py``, ``tpu/captured_engine.py``); this joins them with DeepSpeed's step API, which scripts and
``aot`` call. Both backends' engines implement it (``tests/train/test_engine_protocol.py``):
code that takes an ``Engine`` reads nothing else of it."""

from __future__ import annotations

from typing import Any, Protocol

from spmdzero.io.checkpointed_engine import CheckpointedEngine
from spmdzero.observe.reported_engine import ReportedEngine
from spmdzero.tpu.captured_engine import CapturedEngine


class Engine(CheckpointedEngine, ReportedEngine, CapturedEngine, Protocol):
    """A spmdzero engine (either backend)."""

    dp_world_size: int

    def forward(self, *inputs, **kwargs) -> Any: ...

    def backward(self, loss, retain_graph: bool = False, scale_wrt_gas: bool = True) -> Any: ...

    def step(self, lr_kwargs=None) -> None: ...

    def zero_grad(self) -> None: ...

    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True,  # noqa: B006 (DeepSpeed's)
                        exclude_frozen_parameters=False) -> Any: ...

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None) -> Any: ...

    def train_micro_batch_size_per_gpu(self) -> int: ...

    def grad_buffers(self) -> dict: ...

    def sharding_report(self) -> Any: ...

    def loss_scale(self) -> float: ...

    def was_step_applied(self) -> bool: ...

    def overflow(self) -> bool: ...
