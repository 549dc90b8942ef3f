"""The training engine: DeepSpeed's names and semantics over one traced SPMD step.

Each ``engine.step()`` call ends the trace with ``torch_xla.sync()``, so a run compiles
two programs: a micro-step (forward, backward, gradient accumulation) and a boundary
step (the same plus clipping, the optimizer update and the re-annotation of every
state). Nothing inside a step reads a device value on the host.

Gradients live in persistent accumulation buffers, one per trainable parameter, laid
out by the plan (sharded at ZeRO-2). ``backward`` folds ``p.grad`` into them and drops
``p.grad``, as DeepSpeed's ZeRO does with its partitioned gradient buffers.
"""

from __future__ import annotations

import contextlib
from typing import Any, Optional

import torch

from . import runtime
from .annotate import annotate_grad_buffers, annotate_optimizer_state, annotate_params, shard
from .config import BatchSizes, DeepSpeedConfig
from .data import to_device_sharded
from .mesh import data_parallel_size, mesh_shape
from .optim import momentum_of
from .plan import ShardingPlan, replicated

CLIP_EPS = 1e-6  # DeepSpeed's: clip coefficient = max_norm / (norm + 1e-6)


class SpmdZeroEngine(torch.nn.Module):
    def __init__(self, *, module: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer], lr_scheduler: Any,
                 config: DeepSpeedConfig, batch: BatchSizes, mesh, plan: ShardingPlan,
                 training_dataloader: Any = None):
        super().__init__()
        self.module = module
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.training_dataloader = training_dataloader
        self.mesh = mesh
        self.plan = plan
        self.config = config
        self._batch = batch
        self.device = runtime.device()
        self.dp_world_size = batch.world_size
        self.world_size = int(mesh.size())
        self.global_steps = 0
        self.global_samples = 0
        self.micro_steps = 0
        self.skipped_steps = 0
        self._boundary_override: Optional[bool] = None
        self._global_grad_norm: Optional[torch.Tensor] = None
        self._step_applied = False

        self._names = {p: name for name, p in module.named_parameters()}
        optimized = {p for g in optimizer.param_groups for p in g["params"]} if optimizer else set()
        self._grad_buffers: dict[str, torch.Tensor] = {
            name: torch.zeros_like(p) for name, p in module.named_parameters() if p.requires_grad and p in optimized
        }
        self._params_with_buffers = [(p, self._grad_buffers[self._names[p]]) for p in optimized
                                     if self._names.get(p) in self._grad_buffers]
        self._reannotate()
        import torch_xla

        torch_xla.sync()  # materialize sharded states and buffers before the first step

    # ---- DeepSpeed batch numbers -------------------------------------------------
    def train_batch_size(self) -> int:
        return self._batch.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._batch.micro_batch_per_device

    def gradient_accumulation_steps(self) -> int:
        return self._batch.gradient_accumulation_steps

    def zero_optimization_stage(self) -> int:
        return self.plan.stage

    def gradient_clipping(self) -> float:
        return self.config.gradient_clipping

    # ---- the training step -----------------------------------------------------------
    def forward(self, *inputs, **kwargs):
        """Move batch tensors to the device, split along the batch axes, and run the module."""
        shape = mesh_shape(self.mesh)
        move = lambda x: to_device_sharded(x, self.mesh, self.plan.batch_spec, data_parallel_size(shape))  # noqa: E731
        return self.module(*move(inputs), **move(kwargs))

    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True):
        """Backprop ``loss / gradient_accumulation_steps`` and accumulate into the ZeRO buffers."""
        if not isinstance(loss, torch.Tensor):
            raise TypeError(f"engine.backward expects the loss tensor, got {type(loss).__name__}")
        gas = self.gradient_accumulation_steps()
        if scale_wrt_gas and gas > 1:
            loss = loss / gas
        try:
            loss.backward(retain_graph=retain_graph)
        except RuntimeError as err:
            explained = runtime.explain_backward_trap(err)
            if explained is None:
                raise
            raise explained from err
        with torch.no_grad():
            for p, buf in self._params_with_buffers:
                if p.grad is not None:
                    # Pin the freshly reduced gradient replicated: otherwise GSPMD pushes the
                    # buffer's ZeRO-2 sharding back into the backward pass (activations get
                    # odd shardings and are rematerialized). The compiler still turns
                    # all-reduce + slice into a reduce-scatter.
                    shard(p.grad, self.mesh, replicated(p.dim()))
                    buf.add_(p.grad)
                    p.grad = None
        annotate_grad_buffers(self._grad_buffers, self.plan, self.mesh)
        return loss

    def step(self, lr_kwargs: Optional[dict] = None) -> None:
        """Apply the update at an accumulation boundary; count every call; end the trace."""
        import torch_xla

        if self.is_gradient_accumulation_boundary():
            if self.optimizer is None:
                raise RuntimeError("engine.step() needs an optimizer: pass optimizer= to initialize() "
                                   "or add an 'optimizer' section to the config")
            self._take_model_step(lr_kwargs)
        self.micro_steps += 1
        torch_xla.sync()

    def _take_model_step(self, lr_kwargs: Optional[dict]) -> None:
        buffers = [buf for _, buf in self._params_with_buffers]
        with torch.no_grad():
            norm = torch.sqrt(sum(torch.sum(b.float() * b.float()) for b in buffers)) if buffers \
                else torch.zeros((), device=self.device)
            max_norm = self.config.gradient_clipping
            if max_norm > 0:
                coef = torch.clamp(max_norm / (norm + CLIP_EPS), max=1.0)
                for b in buffers:
                    b.mul_(coef)
            for p, buf in self._params_with_buffers:
                p.grad = buf
            self.optimizer.step()
            for p, buf in self._params_with_buffers:
                p.grad = None
                buf.zero_()
        self._reannotate()
        self._global_grad_norm = norm
        self._step_applied = True
        if self.lr_scheduler is not None:
            self.lr_scheduler.step(**(lr_kwargs or {}))
        self.global_steps += 1
        self.global_samples += self.train_batch_size()

    def _reannotate(self) -> None:
        """Params replicated, states and buffers per the plan: output propagation would
        otherwise leave updated params sharded like the states they were computed from."""
        annotate_params(self.module.named_parameters(), self.plan, self.mesh)
        annotate_grad_buffers(self._grad_buffers, self.plan, self.mesh)
        if self.optimizer is not None:
            annotate_optimizer_state(self.optimizer, self._names, self.plan, self.mesh)

    def zero_grad(self) -> None:
        """Drop accumulated gradients (DeepSpeed sets them to None)."""
        with torch.no_grad():
            for p, buf in self._params_with_buffers:
                p.grad = None
                buf.zero_()
        annotate_grad_buffers(self._grad_buffers, self.plan, self.mesh)

    # ---- accumulation boundary -----------------------------------------------------
    def is_gradient_accumulation_boundary(self) -> bool:
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        self._boundary_override = is_boundary

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate without communication. Refused at ZeRO-2, as in DeepSpeed; under
        SPMD the compiler owns communication, so at stages 0/1 this changes nothing."""
        if self.plan.stage >= 2:
            raise AssertionError("no_sync context manager is incompatible with gradient partitioning "
                                 "logic of ZeRO stage 2")
        yield

    # ---- reporting -------------------------------------------------------------------------
    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups] if self.optimizer else []

    def get_mom(self) -> list:
        return [momentum_of(g) for g in self.optimizer.param_groups] if self.optimizer else []

    def get_global_grad_norm(self) -> Optional[float]:
        """Pre-clip global gradient norm of the last boundary step (reads the device)."""
        return None if self._global_grad_norm is None else float(self._global_grad_norm)

    def was_step_applied(self) -> bool:
        return self._step_applied

    def grad_buffers(self) -> dict[str, torch.Tensor]:
        """The ZeRO gradient accumulation buffers, by parameter name."""
        return dict(self._grad_buffers)
