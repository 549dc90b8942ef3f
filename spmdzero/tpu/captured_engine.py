"""What the TPU compile path reads of an engine, as typed interfaces (``typing.Protocol``).

Why here: ``tpu`` sits below the engines, so it names the faces it reads instead of importing an
engine class; ``train/engine_protocol.py`` joins the common one with the other faces. Each
backend's step reaches the compiler its own way, so each has a face of its own on top: the
torchax engine traces its step (``TracedEngine``), the torch_xla engine's step is intercepted
while it runs (``InterceptedEngine``)."""

from __future__ import annotations

from typing import Any, Protocol


class CapturedEngine(Protocol):
    """An engine as a captured step's report reads it, on either backend."""

    plan: Any  # sharding.plan.ShardingPlan
    mesh: Any
    precision: Any  # optim.precision.PrecisionPolicy

    @property
    def validated_config(self) -> Any: ...

    def state_tensors(self) -> dict[str, tuple[Any, tuple]]: ...

    def grad_buffers(self) -> dict: ...

    def train_micro_batch_size_per_gpu(self) -> int: ...


class TracedEngine(CapturedEngine, Protocol):
    """The torchax engine: its whole step traced as one program (``TorchaxEngine.trace_step``)."""

    attention_kernels: Any  # which SDPA kernel the step runs
    expert_matmuls: Any  # how the experts' grouped matmuls split their rows

    def trace_step(self, *inputs, **kwargs) -> Any: ...


class InterceptedEngine(CapturedEngine, Protocol):
    """The torch_xla engine: its ``step()`` traced inside ``capture`` and its state restored after."""

    def snapshot(self, with_tensors: bool = True) -> Any: ...

    def restore_snapshot(self, snapshot) -> None: ...

    def capture_steps(self, step) -> None: ...

    def trained_parameters(self) -> Any: ...

    def step(self, lr_kwargs=None) -> None: ...
