"""The training engine: DeepSpeed's names and semantics over one traced SPMD step.

Why one module: the step core (forward, backward, the boundary update) and the state it
keeps between steps (gradient slots, the loss scale and counters on the device) are one unit,
and so is the public state protocol over that state (``state_tensors``, ``lay_out_state``,
``snapshot``/``restore_snapshot``, ``loaded``), which must change whenever the state does;
the DeepSpeed API around it is ``train/engine_base.py``, the update's math ``optim/update.py``.

Each ``engine.step()`` call ends the trace with ``torch_xla.sync()``, so a run compiles
two programs: a micro-step (forward, backward, gradient accumulation) and a boundary
step (the same plus clipping, the optimizer update and the re-annotation of every
state). Nothing inside a step reads a device value on the host: overflow skipping, loss
scaling and the schedule's step count live on the device (see ``optim/update.py``).

Every trainable parameter has a slot: its accumulated gradient, laid out by the plan
(sharded at ZeRO-2), and the tensor the optimizer updates (the parameter itself in fp32,
its fp32 master weight under mixed precision). ``backward`` annotates the fresh ``p.grad``
with the plan's gradient spec, so the compiler reduce-scatters it, folds it into the slot
and drops it, as DeepSpeed's ZeRO does with its partitioned gradients. The slot holds no
buffer between accumulation boundaries: the first micro-step's gradient *is* the
accumulator, so without accumulation the reduced shard goes straight to clipping and the
optimizer, with no zero-fill, add or copy of a full-size buffer.
"""

from __future__ import annotations

import copy
import functools
import time
import warnings
from dataclasses import dataclass
from typing import Any, Optional

import torch

from spmdzero import runtime
from spmdzero.backends.torch_xla import fused
from spmdzero.backends.torch_xla import COMPILE_BACKEND
from spmdzero.backends.torch_xla.annotate import constrain, shard, sharding_text
from spmdzero.backends.torch_xla.checkpoint import XlaStateShards
from spmdzero.sharding.batch import BatchSizes
from spmdzero.config.schema import DeepSpeedConfig
from spmdzero.train import module_methods
from spmdzero.train.data import map_tensors, model_pad_id
from spmdzero.backends.torch_xla.batches import to_device_sharded
from spmdzero.train.engine_base import EngineBase, check_loss_given, check_scalable, no_gradients
from spmdzero.observe.monitor import RecompileGuard, StepLogger, ThroughputTimer, compile_count, notice_nonfinite
from spmdzero.optim.ops import TORCH_OPS
from spmdzero.optim.optimizers import SpmdOptimizer, ZeroOptimizer, drop_state, is_lazy, placeholder_state
from spmdzero.sharding.plan import ShardingPlan, replicated
from spmdzero.optim.precision import PrecisionPolicy, keep_unless
from spmdzero.optim.update import GradScale, LossScale, boundary_update, init_loss_scale
from spmdzero.train.scan_layers import scanned_parameters, stacked_layers
from spmdzero.optim.schedules import LRSchedule
from spmdzero.io.save import save_checkpoint
from spmdzero.io.restore import load_checkpoint
from spmdzero.observe.reports import sharding_report
from spmdzero.tpu.capture import capture
from spmdzero.runtime.out_of_memory import raises_torch_out_of_memory



@dataclass(eq=False)
class Slot:
    name: str
    param: torch.Tensor  # the module's parameter (replicated, model dtype)
    target: torch.Tensor  # what the optimizer updates: the param, or its fp32 master weight
    grad: Optional[torch.Tensor] = None  # gradients accumulated since the last boundary (plan's grad spec,
    #                                      grad_accum dtype); None when there are none
    summed: bool = False  # grad is a sum of micro-steps' gradients, not one backward's


# What a traced step changes on the engine besides its tensors (``snapshot``): copied values,
# and objects that a step rebinds rather than updates in place.
_STEP_ATTRIBUTES = ("global_steps", "global_samples", "micro_steps", "_step_applied", "_last_overflow",
                    "_global_grad_norm", "_loss_scale", "_skipped_on_device", "_rows_since_step",
                    "_backward_since_step", "_window_reduced", "_creating_state", "samples_last_step")
_REBOUND_ATTRIBUTES = ("_last_loss", "_window_loss", "_step_loss", "_input_shapes")


@dataclass
class EngineSnapshot:
    """What ``SpmdZeroEngine.snapshot`` kept; only ``restore_snapshot`` reads it."""

    tensors: dict  # state key -> the live tensor
    values: Optional[dict]  # state key -> a clone holding its value (None: not kept)
    attrs: dict
    pending: list  # each slot's pending gradient
    groups: list  # copies of the optimizer's param groups
    scheduler: Optional[dict]
    optimizer_state: dict  # target -> a copy of its state dict (which keys it has: torch's are created lazily)
    host_values: dict  # (target, key) -> a clone of a host tensor of its state (torch increments Adam's in place)


class SpmdZeroEngine(EngineBase, torch.nn.Module):
    def __init__(self, *, module: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer], lr_scheduler: Any,
                 config: DeepSpeedConfig, batch: BatchSizes, mesh, plan: ShardingPlan, precision: PrecisionPolicy,
                 master_weights: Optional[dict] = None, training_dataloader: Any = None,
                 config_dict: Optional[dict] = None, shape_only: bool = False):
        super().__init__()
        self.module = module
        self.basic_optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.training_dataloader = training_dataloader
        self.mesh = mesh
        self.plan = plan
        self._config = config  # typed; ``self.config`` is DeepSpeed's: the config as a dict
        self.config = dict(config_dict) if config_dict is not None else config.model_dump(exclude_none=True)
        self.precision = precision
        self._batch = batch
        self.device = runtime.device()
        # DeepSpeed's world size by the batch rule (spmd.rank); the batch itself is split over
        # the mesh's data-parallel devices (batch.dp_devices).
        self.dp_world_size = batch.ranks
        self.world_size = batch.ranks
        self.global_steps = 0
        self.global_samples = 0
        self.samples_last_step = 0
        self._rows_since_step = 0
        self._warned_fewer_rows = False
        self._pad_id = model_pad_id(module)
        self.micro_steps = 0
        self._skipped_on_host = 0
        self._skipped_on_device: Optional[torch.Tensor] = None
        self._boundary_override: Optional[bool] = None
        self._global_grad_norm: Optional[torch.Tensor] = None
        self._step_applied: Any = False
        self._last_overflow: Any = False
        initial = init_loss_scale(precision)
        self._loss_scale = None if initial is None else LossScale(
            *torch.tensor(initial, dtype=torch.float32).to(self.device).unbind())
        self._capture = None  # a spmdzero.tpu.capture.StepCapture while a step is being captured
        self._last_loss: Optional[torch.Tensor] = None
        # the mean of the micro-batch losses: of the window in progress, and of the last optimizer step's
        self._window_loss: Optional[torch.Tensor] = None
        self._step_loss: Optional[torch.Tensor] = None
        self._backward_since_step = False  # an optimizer step needs gradients from a backward since the last one
        self._overwrite_at_backward = False  # zero_grad_overwrites_next_backward
        # the last backward was at an accumulation boundary: the window's gradients are complete,
        # and DeepSpeed has reduced them into its ZeRO optimizer (see zero_grad_keeps_gradients)
        self._window_reduced = False
        self._creating_state = False  # this step's torch optimizer creates its state: warm-up (_end_step)
        self._input_shapes: tuple = ()
        self._grad_orders: dict[tuple[str, str], Optional[tuple[int, ...]]] = {}  # see _memory_orders
        self.recompile_guard = RecompileGuard(config.spmd.max_recompiles)
        self._step_logger = StepLogger(config, process_index=self.global_rank)
        self.tput_timer = ThroughputTimer(self)
        self._is_compiled = False

        masters = master_weights or {}
        optimized = {id(p) for g in optimizer.param_groups for p in g["params"]} if optimizer else set()
        self._slots = [
            Slot(name, p, masters.get(p, p))
            for name, p in module.named_parameters()
            if p.requires_grad and id(masters.get(p, p)) in optimized
        ]
        self._target_names = {s.target: s.name for s in self._slots}
        self._scanned = scanned_parameters(module)  # gradients laid out inside the layer loop (spmdzero.backends.torch_xla.scan)
        if optimizer is not None:  # optimized tensors that are not module parameters get positional names
            params = [p for g in optimizer.param_groups for p in g["params"]]
            self._target_names.update({p: f"param{i}" for i, p in enumerate(params) if p not in self._target_names})
        self.optimizer = ZeroOptimizer(optimizer, self) if optimizer is not None else None
        self.lay_out_state()
        self._keep_step_state_on_device()
        if not shape_only:  # placeholders (spmdzero.aot.shapes) have nothing to execute
            import torch_xla

            torch_xla.sync()  # materialize sharded states, masters and buffers before the first step

    # ---- the training step -----------------------------------------------------------
    @raises_torch_out_of_memory
    def forward(self, *inputs, **kwargs):
        """Move batch tensors to the device, split along the batch axes, cast floating
        inputs to the model dtype (as DeepSpeed's ``fp16.auto_cast``; not the targets named in
        ``TARGET_NAMES``: an fp16 cast can overflow a regression target), and run the module. A
        training forward's rows (read from host-side shapes) are checked against the batch rule
        and counted in ``global_samples``."""
        return self._run(self.module, inputs, kwargs)

    def _run(self, call, inputs: tuple, kwargs: dict):
        """``call`` (the module, or one of its methods: ``module_methods``) on the inputs as
        ``forward`` prepares them."""
        if torch.is_inference_mode_enabled():
            # under inference mode torch_xla refuses a view of a tensor made outside it ("Cannot
            # set version_counter for inference tensor"): the module's weights' in the forward, and
            # the outputs' in the script after it (TRL scores with its reward engine under
            # inference_mode, ``reward(**inputs).logits[:, 0]``). So the forward runs as under
            # no_grad, which computes the same, and the outputs come back as inference copies
            with torch.inference_mode(False), torch.no_grad():
                output = self._run(call, inputs, kwargs)
            return map_tensors(output, torch.clone)
        start = time.perf_counter()
        self.recompile_guard.step_started()
        inputs, kwargs, cuts = self._padded(inputs, kwargs, self._pad_id)  # its outputs keep the padded length
        shapes = []
        map_tensors((inputs, kwargs), lambda t: shapes.append(tuple(t.shape)))
        self._input_shapes = tuple(shapes)
        self._inputs_bucketed = bool(cuts)  # padded to a shape bucket (_new_shape_bucket)
        layout = self._batch_layout(self.module, inputs, kwargs)
        if self.module.training and torch.is_grad_enabled():
            self._count_training_rows(layout.rows, layout.on_device)
        else:
            self.recompile_guard.note_evaluation()
        inputs, kwargs = to_device_sharded((inputs, kwargs), self.mesh, self.plan.batch_spec,
                                           self._batch.dp_devices, self._batch.processes, layout)
        inputs, kwargs = self._in_model_dtype(inputs, kwargs)
        autocast = self.precision.autocast_dtype  # the config's torch_autocast, as DeepSpeed's forward
        try:
            with torch.autocast("xla", dtype=autocast, enabled=autocast is not None):
                return call(*inputs, **kwargs)
        finally:
            self._step_logger.timers.add("forward", time.perf_counter() - start)

    def _count_training_rows(self, rows: Optional[int], on_device: bool) -> None:
        """Hold a training forward to the batch rule: more rows than a micro-step has is an
        error, fewer (an epoch's partial last batch) a one-time warning; either way the rows
        actually fed are what ``global_samples`` and samples/s count."""
        if rows is None:
            return
        global_rows = rows if on_device else rows * self._batch.processes
        self._check_training_rows(global_rows)
        self._rows_since_step += global_rows

    @raises_torch_out_of_memory
    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True):
        """Backprop ``loss / gradient_accumulation_steps`` (times the loss scale) and
        accumulate into the ZeRO buffers. Returns the gas-scaled loss, as DeepSpeed does."""
        check_loss_given(loss)
        if self._overwrite_at_backward:  # DeepSpeed's stage-3 optimizer.zero_grad() came since the last one
            self._drop_gradients()
        self._last_loss = loss.detach()
        self._backward_since_step = True
        gas = self.gradient_accumulation_steps()
        term = self._last_loss.float() / gas if gas > 1 else self._last_loss.float()  # in the graph: no host read
        self._window_loss = term if self._window_loss is None else self._window_loss + term
        if scale_wrt_gas and gas > 1:
            loss = loss / gas
        scaled = loss * self._loss_scale.scale if self._loss_scale is not None else loss
        start = time.perf_counter()
        try:
            scaled.backward(retain_graph=retain_graph)
        except RuntimeError as err:
            explained = runtime.explain_backward_trap(err)
            if explained is None:
                raise
            raise explained from err
        self._take_param_grads()
        self._step_logger.timers.add("backward", time.perf_counter() - start)
        return loss

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """DeepSpeed's ``engine.scale(loss)``, for a backward the script runs itself
        (``engine.scale(loss).backward()``, then ``engine.step()``): ``loss`` times fp16's loss
        scale, which the update divides out; ``loss`` itself in bf16 and fp32. The step divides
        the gradients the script's backward left by the accumulation steps, as DeepSpeed divides
        the outputs' gradients (``_take_gradients``)."""
        check_scalable(self, loss)
        return loss * self._loss_scale.scale if self._loss_scale is not None else loss

    def _take_param_grads(self, divisor: int = 1) -> None:
        """Move the gradients autograd left in ``param.grad`` into the ZeRO buffers (divided by
        ``divisor``, reduced in ``communication_data_type``, laid out as the plan says, summed in
        ``grad_accum_dtype``)."""
        comm, accum = self.precision.communication_dtype, self.precision.grad_accum_dtype
        with torch.no_grad():
            for slot in self._slots:
                grad = slot.param.grad
                if grad is None:
                    continue
                slot.param.grad = None
                if divisor != 1:
                    grad = grad / divisor
                planned = self.plan[slot.name]
                spec = planned.grad
                reduced = grad.to(comm)
                if planned.grad_stages and slot.name in self._scanned:
                    # Laid out through its stages inside the layer loop (spmdzero.backends.torch_xla.scan): a replicated
                    # pin here would all-gather the reduce-scattered gradient again.
                    shard(reduced, self.mesh, spec)
                    stages = ()
                else:
                    # The first layout as the gradient's own (see TensorPlan.grad_layouts), the
                    # rest as sharded copies.
                    first, *stages = planned.grad_layouts
                    shard(reduced, self.mesh, first)
                for stage in stages:
                    reduced = constrain(reduced, self.mesh, stage)
                grad = reduced.to(accum)
                slot.summed = slot.grad is not None
                if slot.grad is not None:
                    # In place: the sum's output takes the accumulator's own buffer (torch_xla
                    # donates a tensor updated in place), not a second shard-sized allocation.
                    grad = slot.grad.add_(grad)
                    fused.settle([grad])
                if grad is not reduced:  # a micro-step's output takes the compiler's layout unless annotated
                    shard(grad, self.mesh, spec)
                slot.grad = grad
        self._window_reduced = self.is_gradient_accumulation_boundary()

    @raises_torch_out_of_memory
    def step(self, lr_kwargs: Optional[dict] = None) -> None:
        """Apply the update at an accumulation boundary; count every call; end the trace."""
        if self._capture is not None:  # trace the update for the TPU compiler; execute nothing
            self._require_optimizer("engine.step() in spmdzero.aot.capture")
            self._take_model_step(lr_kwargs)
            self._capture.record()
            return
        start = time.perf_counter()
        boundary = self.is_gradient_accumulation_boundary()
        if boundary:
            self._take_gradients("engine.step() at a gradient accumulation boundary")
            self._take_model_step(lr_kwargs)
        self.micro_steps += 1
        self._end_step(boundary)
        self._step_logger.timers.add("step", time.perf_counter() - start)
        if boundary:
            self._step_logger.after_boundary(self)
            self.tput_timer.after_boundary()
            self._run_post_step_hooks()

    def _require_optimizer(self, call: str) -> None:
        if self.optimizer is None:
            raise RuntimeError(f"{call} needs an optimizer: pass optimizer= to initialize() "
                               "or add an 'optimizer' section to the config")

    def _take_gradients(self, call: str) -> None:
        """Check that an optimizer step has gradients to apply, and mark them taken."""
        self._require_optimizer(call)
        if not self._backward_since_step and any(slot.param.grad is not None for slot in self._slots):
            # DeepSpeed's PyTorch-style backward: the script ran loss.backward() itself (through
            # engine.scale(loss) under fp16), and autograd summed the window's gradients in
            # param.grad. DeepSpeed divides each backward's output gradients by the accumulation
            # steps (its output hooks): the sum divided once is the same
            self._take_param_grads(self.gradient_accumulation_steps())
            self._backward_since_step = True
        if not self._backward_since_step:
            # DeepSpeed's ZeRO-1/2 optimizer has no gradients then and fails (its
            # averaged_gradients are None after a step); an update would still apply weight
            # decay and count a step, so refuse it clearly instead
            raise RuntimeError(no_gradients(call, "the last optimizer step (or since a checkpoint load, or a "
                                                  "zero_grad() that dropped the gradients)"))
        self._backward_since_step = False
        self._overwrite_at_backward = False

    def _end_step(self, boundary: bool) -> None:
        """End the trace: execute the step's graph, and hold it to the recompile guard."""
        import torch_xla

        compiles = compile_count()
        torch_xla.sync()
        warmup, self._creating_state = self._creating_state, False
        self.recompile_guard.check(compile_count() - compiles, self.global_steps, boundary, self._input_shapes,
                                   warmup=warmup or self._new_shape_bucket())
        self.recompile_guard.check_graphs(self.global_steps, warmup=warmup)

    def _take_model_step(self, lr_kwargs: Optional[dict]) -> None:
        """The engine's optimizer step: the update, then the schedule (not after a skipped
        step) and the counters, as DeepSpeed's ``engine._take_model_step``."""
        overflow = self._update(self._config.gradient_clipping)
        if overflow is not None:
            self._skipped_on_device = overflow.float() + self._skipped_on_device
            self._step_scheduler_if(self._step_applied, lr_kwargs)
        elif self.lr_scheduler is not None:
            self.lr_scheduler.step(**(lr_kwargs or {}))
        self.global_steps += 1
        self.global_samples += self._consume_samples()

    def _update(self, clipping: float) -> Optional[torch.Tensor]:
        """The optimizer's update with the gradients accumulated since the last one, which it
        consumes (the next micro-step starts a new sum): the global norm, clipping to
        ``clipping``, the overflow skip and the loss scale's update, the masters cast back
        into the parameters, every updated state laid out by the plan. Returns the device
        bool "this step overflowed" under overflow checks, else None."""
        policy = self.precision
        with torch.no_grad():
            grads = [self._gradient(s) for s in self._slots]
            sum_sq = fused.sum_of_squares(grads, self._memory_orders(grads)) if grads else torch.zeros((), device=self.device)
            result = boundary_update(sum_sq, self._loss_scale, clipping, policy, TORCH_OPS,
                                     functools.partial(self._apply_optimizer, grads))
            laid_out = result.applied
            for slot in self._slots:
                slot.grad = None
            self._window_reduced = False
            self._step_loss, self._window_loss = self._window_loss, None
            if policy.master_weights:  # the compiler all-gathers the cast master shards
                params = [s.param for s in self._slots]
                torch._foreach_copy_(params, [self._gathered_in_stages(s) for s in self._slots])
                fused.settle(params)
        self._global_grad_norm = result.scale.norm
        overflow = None
        if policy.check_overflow:
            overflow = result.scale.skip
            self._loss_scale = result.loss_scale
            self._last_overflow, self._step_applied = overflow, ~overflow
        else:
            self._step_applied = True
        self._annotate_updated(laid_out)
        return overflow

    def optimizer_step(self) -> None:
        """``engine.optimizer.step()``: DeepSpeed's ZeRO optimizer stepped by the caller. As its
        ``step()`` (DeepSpeed 0.19.8, runtime/zero/stage_1_and_2.py), the update with the
        gradients reduced at the accumulation boundary's backward (its ``averaged_gradients``),
        clipped to ``gradient_clipping``, skipped on overflow with the loss scale updated, and
        the gradients then dropped. What its caller, the engine's ``_take_model_step``, adds is
        left out: ``global_steps``, ``global_samples``, the LR schedule and the skipped-step
        count stay; ``micro_steps`` is ``engine.step()``'s. At stage 0 in fp32 DeepSpeed's
        optimizer is the torch optimizer itself, which does not clip (the engine clips before
        calling it). Ends the trace like ``engine.step()``.

        Refused inside an accumulation window (the last backward not at a boundary): the
        window's gradients are incomplete, and DeepSpeed's ZeRO optimizer then has no reduced
        gradients and fails."""
        if self._capture is not None:  # trace the update for the TPU compiler; execute nothing
            self._update(self._optimizer_clipping())
            self._capture.record()
            return
        call = "engine.optimizer.step()"
        if self._backward_since_step and not self._window_reduced:
            gas = self.gradient_accumulation_steps()
            raise RuntimeError(
                f"{call} inside a gradient accumulation window (micro-step {self.micro_steps % gas + 1} of {gas}): the "
                "last engine.backward() was not at the accumulation boundary, so the window's gradients are "
                "incomplete (DeepSpeed's ZeRO optimizer has none reduced then). Call engine.step() after every "
                "micro-step; call engine.optimizer.step() only after the backward of a micro-step where "
                "engine.is_gradient_accumulation_boundary() is True")
        start = time.perf_counter()
        self._take_gradients(call)
        self._update(self._optimizer_clipping())
        self._end_step(boundary=True)
        self._step_logger.timers.add("step", time.perf_counter() - start)

    def _optimizer_clipping(self) -> float:
        """The clipping of DeepSpeed's optimizer (see ``optimizer_step``)."""
        if self.plan.stage == 0 and self.precision.param_dtype == torch.float32:
            return 0.0
        return self._config.gradient_clipping

    def _apply_optimizer(self, grads: list[torch.Tensor], scale: GradScale) -> set[int]:
        """The optimizer's math for ``boundary_update``; returns the ids of the parameters whose
        new values already carry their shardings (set inside the fused op)."""
        if not isinstance(self.optimizer.optimizer, SpmdOptimizer):
            self._client_optimizer_step(grads, scale.multiplier, scale.skip)
            return set()
        # scale, update and overflow select: one op per group. Old buffers are reused only by a
        # step that the sync after it executes, and not under engine.compile(): dynamo's cached
        # graphs keep reading the old ones.
        donate = self._capture is None and not self._is_compiled
        self.optimizer.optimizer.step(grads={s.target: g for s, g in zip(self._slots, grads)},
                                      grad_scale=scale.multiplier, skip=scale.skip, donate=donate,
                                      group_update=functools.partial(fused.update, gather=self._gather_text))
        return self.optimizer.optimizer.laid_out

    def _keep_step_state_on_device(self) -> None:
        """Under overflow checks (fp16, bf16's check_grad_overflow) every optimizer step but
        the first reads the skipped-step count and a DeepSpeed schedule's step count and lrs
        from the device, as the previous step left them. Put them there from the start, and
        the first step traces the same graph as the rest: the step compiles once, not twice.
        The caller's next sync materializes them."""
        if not self.precision.check_overflow:
            return
        if self._skipped_on_device is None:
            self._skipped_on_device = torch.zeros((), dtype=torch.float32, device=self.device)
        if isinstance(self.lr_scheduler, LRSchedule):
            self.lr_scheduler.keep_on_device(self.device)

    def _client_optimizer_step(self, grads: list, inverse: Optional[torch.Tensor],
                               overflow: Optional[torch.Tensor]) -> None:
        """A torch.optim optimizer reads ``.grad``; an overflowed step is undone afterwards.

        Its first step creates its state (torch's lazy state: nothing is made up before, see
        ``spmdzero.optim.optimizers``); ``_annotate_updated`` then lays the new tensors out
        by the plan, and from the next step on the graph is the same every step. An
        overflowed step must not leave state it created: the next step must be torch's first
        again (SGD's momentum buffer is the first applied gradient, not one derived from
        inf), and whether a key exists is decided on the host. So a step that creates state
        under overflow checks (fp16, bf16's ``check_grad_overflow``) reads its overflow flag:
        only the steps before the first applied one (warm-up), never after."""
        grads = [g.float() if inverse is None else g.float() * inverse for g in grads]
        state = self.optimizer.optimizer.state
        keys_before = {s.target: set(state[s.target]) if s.target in state else None for s in self._slots}
        updated = [s.target for s in self._slots] + [t for k, (t, _) in self.state_tensors().items()
                                                      if k.startswith("optim.")]
        before = [t.clone() for t in updated] if overflow is not None else None
        for slot, grad in zip(self._slots, grads):
            slot.target.grad = grad
        self.optimizer.optimizer.step()
        for slot in self._slots:
            slot.target.grad = None
        created = {t: keys for t, keys in keys_before.items() if set(state.get(t, ())) != (keys or set())}
        self._creating_state = bool(created)
        if overflow is None:
            return
        keep_unless(overflow, updated, before)
        if created and self._capture is None:  # a captured step is put back as a whole (restore_snapshot)
            import torch_xla

            torch_xla.sync()  # the step so far, executed: its overflow flag is then read without a second run
            if bool(overflow):
                for target, keys in created.items():
                    if keys is None:
                        state.pop(target, None)
                    else:
                        for key in set(state[target]) - keys:
                            del state[target][key]

    def _step_scheduler_if(self, applied: torch.Tensor, lr_kwargs: Optional[dict]) -> None:
        """DeepSpeed does not step the schedule on a skipped step. DeepSpeed's schedules do
        that in the graph; other schedulers step on the host every boundary (warned)."""
        if self.lr_scheduler is None:
            return
        if isinstance(self.lr_scheduler, LRSchedule) and not lr_kwargs:
            self.lr_scheduler.step_if(applied)
            return
        if not getattr(self, "_warned_host_scheduler", False):
            self._warned_host_scheduler = True
            warnings.warn(f"spmdzero: {type(self.lr_scheduler).__name__} steps on every boundary, including steps "
                          "skipped for overflow (DeepSpeed does not step it then); use a DeepSpeed schedule from the "
                          "config for the exact behaviour", stacklevel=3)
        self.lr_scheduler.step(**(lr_kwargs or {}))

    def _memory_orders(self, grads: list[torch.Tensor]) -> list[Optional[tuple[int, ...]]]:
        """Each gradient's dims in memory order (``fused.memory_order``), for the global norm to
        read them that way. Asked once per parameter and kind of gradient (one backward's, a
        sum of micro-steps', zeros): the step's graph, and so its layouts, are the same every
        time."""
        orders = []
        for slot, grad in zip(self._slots, grads):
            key = (slot.name, "zeros" if slot.grad is None else "sum" if slot.summed else "one")
            if key not in self._grad_orders:
                self._grad_orders[key] = fused.memory_order(grad)
            orders.append(self._grad_orders[key])
        return orders

    def _gradient(self, slot: Slot) -> torch.Tensor:
        """The slot's accumulated gradient; zeros (laid out by the plan) for a parameter that
        took no part in any backward since the last boundary, which the optimizer still steps."""
        if slot.grad is not None:
            return slot.grad
        zeros = torch.zeros(slot.param.shape, dtype=self.precision.grad_accum_dtype, device=slot.param.device)
        shard(zeros, self.mesh, self.plan[slot.name].grad)
        return zeros

    def state_tensors(self) -> dict[str, tuple[torch.Tensor, tuple]]:
        """Every persistent device tensor of the training state, by checkpoint key, with
        the partition spec the plan gives it: ``model.*`` params, ``buffer.*`` module
        buffers, ``master.*`` fp32 masters, ``optim.<param>.<key>`` optimizer state,
        ``loss_scale.*``. Gradient buffers are not state: they are empty between steps."""
        out: dict[str, tuple[torch.Tensor, tuple]] = {}
        for name, p in self.module.named_parameters():
            planned = self.plan.get(name)
            out[f"model.{name}"] = (p, planned.param if planned else replicated(p.dim()))
        for name, b in self.module.named_buffers():
            if b is not None and b.device.type == "xla":
                out[f"buffer.{name}"] = (b, replicated(b.dim()))
        for slot in self._slots:
            if slot.target is not slot.param:
                out[f"master.{slot.name}"] = (slot.target, self.plan[slot.name].master)
        if self.optimizer is not None:
            for target, state in self.optimizer.optimizer.state.items():
                name = self._target_names[target]
                for key, (value, spec) in self._optimizer_state(name, target, state):
                    out[f"optim.{name}.{key}"] = (value, spec)
        if self._loss_scale is not None:
            for field, value in zip(self._loss_scale._fields, self._loss_scale):
                out[f"loss_scale.{field}"] = (value, ())
        return out

    # ---- the state protocol: what checkpoints, the TPU capture and reports use -------------------
    def trained_parameters(self) -> list[Slot]:
        """The parameters this engine trains, in order, each with its name, its optimizer target
        (the fp32 master under mixed precision, else the parameter) and its pending gradient.
        For reading: the engine owns them."""
        return list(self._slots)

    def optimized_names(self) -> dict[torch.Tensor, str]:
        """{optimizer target: its name in checkpoints}: a module parameter's name, ``param<i>``
        for an optimized tensor that is not one."""
        return dict(self._target_names)

    @property
    def scales_loss(self) -> bool:
        """Whether the loss is scaled (fp16): the loss scaler is then part of the state."""
        return self._loss_scale is not None

    def loaded(self, new_window: bool) -> None:
        """A checkpoint load has written the state (``lay_out_state`` done): drop the gradients
        accumulated before it, start a new accumulation window when the counters were restored,
        put the step state the next step reads where it reads it, and execute the copies now.

        The gradients go with the weights they were computed at: a step after ``forward,
        backward, load, forward, backward`` applies only the second gradient, as after a clean
        load (DeepSpeed, at one micro-step a window, gets there because the boundary's backward
        rebuilds its ``averaged_gradients`` from that backward alone)."""
        import torch_xla

        self._drop_gradients()
        if new_window:
            self._window_loss = None  # its mean loss starts again
        self._keep_step_state_on_device()
        torch_xla.sync()

    def snapshot(self, with_tensors: bool = True) -> "EngineSnapshot":
        """Everything a traced step changes, to be put back by ``restore_snapshot``: the state
        tensors' values (executed first) unless ``with_tensors`` is False (a shape-only engine
        has nothing to execute), the counters, the pending gradients, the param groups and the
        schedule."""
        import torch_xla

        if with_tensors:
            torch_xla.sync()
        tensors = {k: t for k, (t, _) in self.state_tensors().items()}
        tensors.update({f"grad.{k}": b for k, b in self.grad_buffers().items()})
        # A clone shares the state's device buffer and keeps pointing at it while the traced
        # step updates the tensor in place (``t.data`` would follow the update).
        values = {k: t.clone() for k, t in tensors.items()} if with_tensors else None
        attrs = {k: copy.copy(getattr(self, k)) for k in _STEP_ATTRIBUTES}
        # Rebound, never updated in place, by a traced backward or step: the objects are kept
        # (the gradients pending inside an accumulation window, the last loss read by last_loss()).
        attrs.update({k: getattr(self, k) for k in _REBOUND_ATTRIBUTES})
        groups = [dict(g) for g in self.optimizer.param_groups] if self.optimizer else []
        optimizer_state = {t: dict(s) for t, s in self.optimizer.state.items()} if self.optimizer else {}
        host_values = {(t, k): v.clone() for t, s in optimizer_state.items() for k, v in s.items()
                       if isinstance(v, torch.Tensor) and v.device.type != "xla"}
        # the schedule's own attributes, not its state_dict(): that reads a device step count back
        # as an int, which the next step sends as a new input and so compiles a new graph
        scheduler = {k: v if isinstance(v, torch.Tensor) else copy.copy(v)
                     for k, v in vars(self.lr_scheduler).items()} if self.lr_scheduler is not None else None
        return EngineSnapshot(tensors, values, attrs, [slot.grad for slot in self._slots], groups, scheduler,
                              optimizer_state, host_values)

    def restore_snapshot(self, snapshot: "EngineSnapshot") -> None:
        """Put the engine back as ``snapshot`` found it."""
        import torch_xla

        if snapshot.values is not None:
            # An in-place copy, not a swap of the XLA tensor under the functional wrapper: views
            # (a weight's transpose in the next forward) are rebuilt from the wrapper's base,
            # which a swap would leave at the traced update.
            with torch.no_grad():
                for key, t in snapshot.tensors.items():
                    t.copy_(snapshot.values[key])
            # laid out by the plan and executed now, as a graph of its own (compiled once): left
            # pending, the copies would join the next training step's graph and make it a new
            # one to compile
            self.lay_out_state()
            torch_xla.sync()
        for name, value in snapshot.attrs.items():
            setattr(self, name, value)
        for slot, grad in zip(self._slots, snapshot.pending):
            slot.grad = grad
        if self.optimizer:
            for group, kept in zip(self.optimizer.param_groups, snapshot.groups):
                group.update(kept)
            # which state exists (a torch optimizer's first step creates it), and its host
            # tensors' values (torch counts Adam's steps in a CPU tensor, in place)
            state = self.optimizer.state
            for target in [t for t in state if t not in snapshot.optimizer_state]:
                del state[target]
            for target, kept in snapshot.optimizer_state.items():
                state[target] = dict(kept)
            with torch.no_grad():
                for (target, key), value in snapshot.host_values.items():
                    state[target][key].copy_(value)
        if snapshot.scheduler is not None:
            vars(self.lr_scheduler).update(snapshot.scheduler)
        for p in self.module.parameters():
            p.grad = None

    def capture_steps(self, capture: Any) -> None:
        """Trace, not execute, the next ``step()`` calls into ``capture`` (a
        ``spmdzero.tpu.capture.StepCapture``: ``capture.record()`` after the traced update), or
        execute them again (``None``)."""
        self._capture = capture

    def state_shards(self) -> XlaStateShards:
        """The device side of checkpoints (``spmdzero.io.shards.StateShards``)."""
        return XlaStateShards(self)

    def stacked_layers(self) -> dict[str, str]:
        """{stacked parameter name: its stack's name} under ``spmd.scan_layers='stacked'`` (else
        empty): checkpoints record it so that they load into either form of the model."""
        return stacked_layers(self.module)

    def _optimizer_state(self, name: str, target: torch.Tensor, state: dict):
        """(key, (tensor, spec)) for each device tensor of one target's optimizer state."""
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.device.type == "xla":
                like_param = tuple(value.shape) == tuple(target.shape)
                yield key, (value, self.plan[name].optimizer_state if like_param else replicated(value.dim()))

    def lay_out_state(self) -> None:
        """Params replicated, buffers, masters and states per the plan: after anything wrote
        the state (a checkpoint load, a captured step put back), and after an update, where
        output propagation would otherwise leave updated params sharded like the states they
        came from."""
        for tensor, spec in self.state_tensors().values():
            shard(tensor, self.mesh, spec)

    @property
    def lazy_optimizer_state(self) -> bool:
        """Whether the optimizer creates its state at its first step (a torch.optim optimizer;
        spmdzero's make theirs up front)."""
        return self.optimizer is not None and is_lazy(self.optimizer.optimizer)

    def placeholder_optimizer_state(self) -> list[torch.Tensor]:
        """Give each optimized tensor without optimizer state the state a torch optimizer's first
        step creates, laid out by the plan, with values that mean nothing: for a checkpoint load
        to write into. Returns those tensors, for ``drop_optimizer_state``."""
        if self.optimizer is None:
            return []
        created = placeholder_state(self.optimizer.optimizer)
        if created:
            self.lay_out_state()
        return created

    def drop_optimizer_state(self, targets) -> None:
        """Take the optimizer state of ``targets`` back to none (torch's next step creates it)."""
        if self.optimizer is not None:
            drop_state(self.optimizer.optimizer, targets)

    def _gathered_in_stages(self, slot) -> torch.Tensor:
        """The updated master, cast to the parameter's dtype and laid out through its ZeRO stages
        backwards on two fsdp axes (``TensorPlan.gather_layouts``), so that the compiler gathers
        it one axis at a time: over both at once, libtpu 0.0.21 all-reduced the parameters on
        v5p:4x4x8 (a 2-layer Llama at ZeRO-2: 1.73x the minimum, no all-gather). Else the master."""
        planned = self.plan[slot.name]
        if self.plan.stage >= 3 or len(planned.zero_stages) < 2:
            return slot.target
        value = slot.target.to(slot.param.dtype)
        for spec in planned.gather_layouts[:-1]:
            value = constrain(value, self.mesh, spec)
        return value

    def _gather_text(self, target: torch.Tensor) -> tuple[str, ...]:
        """For the fused update (``fused.update``'s ``gather``): the layouts, as HLO sharding text,
        that an updated parameter passes through between its state's layout and its own
        (``TensorPlan.gather_layouts``, less the last): one fsdp axis at a time on two fsdp axes,
        none on one. (A master's layout is its state's: its cast is gathered by
        ``_gathered_in_stages``.)"""
        planned = self.plan.get(self._target_names.get(target, ""))
        if planned is None or self.plan.stage >= 3 or len(planned.zero_stages) < 2:
            return ()
        return tuple(sharding_text(self.mesh, spec) for spec in planned.gather_layouts[:-1])

    def _annotate_updated(self, laid_out: set[int]) -> None:
        """``lay_out_state`` for what an update changed, less the targets (by id) whose new values
        and states already carry their shardings (the fused update sets them inside its op):
        ~20 us per annotation, which for 700 tensors was most of the update's tracing."""
        mesh, state = self.mesh, self.optimizer.optimizer.state
        for slot in self._slots:
            planned = self.plan[slot.name]
            if slot.target is not slot.param:  # the param is a fresh cast of the master
                shard(slot.param, mesh, planned.param)
            if id(slot.target) in laid_out:
                continue
            shard(slot.target, mesh, planned.param if slot.target is slot.param else planned.master)
            for _, (value, spec) in self._optimizer_state(slot.name, slot.target, state[slot.target]):
                shard(value, mesh, spec)
        if self._loss_scale is not None:
            for value in self._loss_scale:
                shard(value, mesh, ())

    def zero_grad(self) -> None:
        """DeepSpeed's ``engine.zero_grad()``: it sets the parameters' ``.grad`` to None, which
        drops the gradients accumulated since the last optimizer step only where the ZeRO
        stage still keeps them there (``zero_grad_keeps_gradients``): at stage 0, and at
        stage 1 before the boundary's backward. At ZeRO-2 a window's micro-batches all count
        whatever zero_grad calls come between them, as in DeepSpeed."""
        self._zero_grad(by_optimizer=False)

    def optimizer_zero_grad(self) -> None:
        """DeepSpeed's ZeRO ``optimizer.zero_grad()`` (``engine.optimizer.zero_grad()``)."""
        self._zero_grad(by_optimizer=True)

    def _zero_grad(self, by_optimizer: bool) -> None:
        for slot in self._slots:
            slot.param.grad = None
        if self.zero_grad_overwrites_next_backward(by_optimizer):
            self._overwrite_at_backward = self._backward_since_step  # the next backward drops them
        elif not self.zero_grad_keeps_gradients(by_optimizer, self._window_reduced):
            self._drop_gradients()

    def _drop_gradients(self) -> None:
        """Forget the gradients accumulated since the last optimizer step: an optimizer step
        then needs a backward first (``_take_gradients``)."""
        for slot in self._slots:
            slot.param.grad = None
            slot.grad = None
        self._backward_since_step = False
        self._window_reduced = False
        self._overwrite_at_backward = False

    # ---- checkpoints (spmdzero.checkpoint) ------------------------------------------------------
    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True,  # noqa: B006 (DeepSpeed's)
                        exclude_frozen_parameters=False) -> bool:
        return save_checkpoint(self, save_dir, tag, client_state, save_latest, exclude_frozen_parameters)

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False, trust_client_state=None):
        return load_checkpoint(self, load_dir, tag, load_module_strict, load_optimizer_states,
                               load_lr_scheduler_states, load_module_only, trust_client_state)

    # ---- reporting (these read device values only when called) ----------------------------
    @property
    def skipped_steps(self) -> int:
        on_device = 0 if self._skipped_on_device is None else int(self._skipped_on_device)
        return self._skipped_on_host + on_device

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self._skipped_on_host, self._skipped_on_device = int(value), None
        self._keep_step_state_on_device()

    def get_global_grad_norm(self) -> Optional[float]:
        """Pre-clip, unscaled global gradient norm of the last boundary step (reads the device;
        a non-finite fp32 norm is told once, as at print steps)."""
        norm = None if self._global_grad_norm is None else float(self._global_grad_norm)
        notice_nonfinite(self, norm, "gradient norm of the last step")
        return norm

    def was_step_applied(self) -> bool:
        return bool(self._step_applied)

    def step_loss(self) -> Optional[float]:
        """The mean of the losses passed to ``backward`` in the last optimizer step's
        accumulation window (what the monitors log as ``train_loss``); reads the device."""
        loss = None if self._step_loss is None else float(self._step_loss)
        notice_nonfinite(self, loss, "loss")
        return loss

    def last_loss(self) -> Optional[float]:
        """The loss last passed to ``backward`` (before gas scaling); reads the device."""
        loss = None if self._last_loss is None else float(self._last_loss)
        notice_nonfinite(self, loss, "loss")
        return loss

    def loss_scale(self) -> float:
        """DeepSpeed's: the configured static fp16 loss scale (0 for dynamic scaling), 1.0 under
        bf16, 0 in fp32. The scale in use is ``optimizer.cur_scale``."""
        if self.fp16_enabled():
            return self._config.fp16.loss_scale
        return 1.0 if self.bfloat16_enabled() else 0

    def current_loss_scale(self) -> float:
        """The loss scale in use (reads the device under dynamic fp16 scaling); 1.0 without one."""
        return 1.0 if self._loss_scale is None else float(self._loss_scale.scale)

    def overflow(self) -> bool:
        return bool(self._last_overflow)

    def sharding_report(self):
        """Per parameter: the layout and per-device bytes of the param, its gradient buffer,
        master weight and optimizer states, read from the live tensors; totals against stage 0
        and ZeRO's accounting. Prints as a table, renders as HTML in Jupyter, ``.to_dict()``."""
        return sharding_report(self)

    def collectives_report(self, *inputs, loss_fn=None, **kwargs):
        """Trace one training step on these inputs (``loss_fn(output)``, or the output itself,
        is the loss), compile it for XLA:CPU in a subprocess, and report its collectives against
        the data-parallel minimum. The engine is left as it was."""
        with capture(self) as step:
            output = self(*inputs, **kwargs)
            loss = loss_fn(output) if loss_fn is not None else output
            self.backward(loss)
            step.loss = loss
            self.step()
        return step.collectives_report()

    def grad_buffers(self) -> dict[str, torch.Tensor]:
        """The gradients accumulated since the last boundary (laid out by the plan: the ZeRO-2
        shards), by parameter name. Empty after a boundary step or ``zero_grad()``."""
        return {s.name: s.grad for s in self._slots if s.grad is not None}

    def refresh_fp32_params(self) -> None:
        """The fp32 master weights take the module's current weights (after they were changed by
        hand): DeepSpeed's ``optimizer.refresh_fp32_params()``. Nothing to do in fp32."""
        with torch.no_grad():
            for slot in self._slots:
                if slot.target is not slot.param:  # laid out as the master first: copy_ keeps a layout
                    value = constrain(slot.param.to(slot.target.dtype), self.mesh, self.plan[slot.name].master)
                    slot.target.copy_(value)
        self.lay_out_state()

    def master_weights(self) -> dict[str, torch.Tensor]:
        """The fp32 master weights by parameter name (empty in fp32 training)."""
        return {s.name: s.target for s in self._slots if s.target is not s.param}

    # ---- DeepSpeed engine API: what scripts reach for besides the training step --------------
    def __getattr__(self, name: str):
        """Attributes the engine lacks come from the module, as in DeepSpeed
        (``engine.gradient_checkpointing_enable()``, ``engine.model`` of a Hugging Face model)."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")
            if module is None or name.startswith("__"):
                raise
            if module_methods.routed(module, name):  # DeepSpeed-Chat's critic_engine.forward_value(seq, mask)
                return functools.partial(self._module_method, name)
            try:
                return getattr(module, name)
            except AttributeError:
                raise AttributeError(f"neither the engine nor its module ({type(module).__name__}) has an attribute "
                                     f"{name!r}") from None

    def _module_method(self, name: str, *args, **kwargs):
        """``engine.<name>(...)``: with a tensor, the method on inputs placed as the forward's
        are; without one, as the module's attribute."""
        method = getattr(self.module, name)
        return self._run(method, args, kwargs) if module_methods.computes(args, kwargs) else method(*args, **kwargs)

    def compile(self, backend: Optional[str] = None, compile_kwargs: Optional[dict] = None, schedule=None,
                compiled_autograd_enabled: bool = False) -> None:
        """``torch.compile`` the module's forward with torch_xla's dynamo backend ("openxla",
        the accelerator's compile backend). Backends that do not target XLA (inductor, the CUDA
        default) are replaced by it, with a warning."""
        if self._is_compiled:
            return
        kwargs = dict(compile_kwargs or {})
        kwargs.pop("backend", None)
        if backend not in (None, COMPILE_BACKEND):
            warnings.warn(f"spmdzero: compile backend {backend!r} does not target XLA; using {COMPILE_BACKEND!r}",
                          stacklevel=2)
        self.module.compile(backend=COMPILE_BACKEND, **kwargs)
        self._is_compiled = True

    @property
    def is_compiled(self) -> bool:
        return self._is_compiled

