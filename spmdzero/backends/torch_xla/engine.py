"""The training engine: DeepSpeed's names and semantics over one traced SPMD step.

Why one module: it is the class scripts hold, with DeepSpeed's whole public surface (the step,
the counters' and config's accessors, checkpoints, reports, ``compile``), and the step's
orchestration, which owns the order of everything the step changes. What it orchestrates lives
in functions beside it, each over the state it needs: the gradient slots (``gradients``), the
update at the boundary and the client optimizer's step (``update``), and the state protocol
and snapshots (``state``). The DeepSpeed API shared with the torchax engine is
``train/engine_base.py``, the update's math ``optim/update.py``.

Each ``engine.step()`` call ends the trace with ``torch_xla.sync()``, so a run compiles
two programs: a micro-step (forward, backward, gradient accumulation) and a boundary
step (the same plus clipping, the optimizer update and the re-annotation of every
state). Nothing inside a step reads a device value on the host: overflow skipping, loss
scaling and the schedule's step count live on the device (see ``optim/update.py``).
"""

from __future__ import annotations

import functools
import time
import warnings
from typing import Any, Optional

import torch

from spmdzero import runtime
from spmdzero.backends.torch_xla import COMPILE_BACKEND, gradients, state, update
from spmdzero.backends.torch_xla.annotate import constrain
from spmdzero.backends.torch_xla.batches import to_device_sharded
from spmdzero.backends.torch_xla.checkpoint import XlaStateShards
from spmdzero.backends.torch_xla.gradients import Slot
from spmdzero.sharding.batch import BatchSizes
from spmdzero.config.schema import DeepSpeedConfig
from spmdzero.train import module_methods
from spmdzero.train.data import map_tensors, model_pad_id
from spmdzero.train.engine_base import EngineBase, check_loss_given, check_scalable, no_gradients
from spmdzero.observe.monitor import RecompileGuard, StepLogger, ThroughputTimer, compile_count, notice_nonfinite
from spmdzero.optim.optimizers import ZeroOptimizer, drop_state, is_lazy, placeholder_state
from spmdzero.sharding.plan import ShardingPlan
from spmdzero.optim.precision import PrecisionPolicy
from spmdzero.optim.update import LossScale, init_loss_scale
from spmdzero.train.scan_layers import scanned_parameters, stacked_layers
from spmdzero.io.save import save_checkpoint
from spmdzero.io.restore import load_checkpoint
from spmdzero.tpu.capture import capture
from spmdzero.runtime.out_of_memory import raises_torch_out_of_memory


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
        self._grad_orders: dict[tuple[str, str], Optional[tuple[int, ...]]] = {}  # see gradients.memory_orders
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
        state.keep_step_state_on_device(self)
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
        inputs, kwargs, cuts = self.padded_inputs(inputs, kwargs, self._pad_id)  # its outputs keep the padded length
        shapes = []
        map_tensors((inputs, kwargs), lambda t: shapes.append(tuple(t.shape)))
        self._input_shapes = tuple(shapes)
        self._inputs_bucketed = bool(cuts)  # padded to a shape bucket (new_shape_bucket)
        layout = self.batch_layout(self.module, inputs, kwargs)
        if self.module.training and torch.is_grad_enabled():
            self._count_training_rows(layout.rows, layout.on_device)
        else:
            self.recompile_guard.note_evaluation()
        inputs, kwargs = to_device_sharded((inputs, kwargs), self.mesh, self.plan.batch_spec,
                                           self._batch.dp_devices, self._batch.processes, layout)
        inputs, kwargs = self.in_model_dtype(inputs, kwargs)
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
        self.check_training_rows(global_rows)
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
        """Move the gradients autograd left in ``param.grad`` into the slots (divided by
        ``divisor``: ``gradients.take_param_grads``)."""
        gradients.take_param_grads(self._slots, self.plan, self.mesh, self.precision, self._scanned, divisor)
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
            self.run_post_step_hooks()

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
                                   warmup=warmup or self.new_shape_bucket())
        self.recompile_guard.check_graphs(self.global_steps, warmup=warmup)

    def _take_model_step(self, lr_kwargs: Optional[dict]) -> None:
        """The engine's optimizer step: the update, then the schedule (not after a skipped
        step) and the counters, as DeepSpeed's ``engine._take_model_step``."""
        overflow = update.update(self, self._config.gradient_clipping)
        if overflow is not None:
            self._skipped_on_device = overflow.float() + self._skipped_on_device
            update.step_scheduler_if(self, self._step_applied, lr_kwargs)
        elif self.lr_scheduler is not None:
            self.lr_scheduler.step(**(lr_kwargs or {}))
        self.global_steps += 1
        self.global_samples += self.consume_samples()

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
        update.optimizer_step(self)

    # ---- the state protocol: what checkpoints, the TPU capture and reports use -------------------
    def state_tensors(self) -> dict[str, tuple[torch.Tensor, tuple]]:
        """Every persistent device tensor of the training state, by checkpoint key, with
        the partition spec the plan gives it: ``model.*`` params, ``buffer.*`` module
        buffers, ``master.*`` fp32 masters, ``optim.<param>.<key>`` optimizer state,
        ``loss_scale.*``. Gradient buffers are not state: they are empty between steps."""
        return state.state_tensors(self.module, self.plan, self._slots, self.optimizer, self._target_names,
                                   self._loss_scale)

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
        state.keep_step_state_on_device(self)
        torch_xla.sync()

    def snapshot(self, with_tensors: bool = True) -> state.EngineSnapshot:
        """Everything a traced step changes, to be put back by ``restore_snapshot``: the state
        tensors' values (executed first) unless ``with_tensors`` is False (a shape-only engine
        has nothing to execute), the counters, the pending gradients, the param groups and the
        schedule."""
        return state.snapshot(self, with_tensors)

    def restore_snapshot(self, snapshot: state.EngineSnapshot) -> None:
        """Put the engine back as ``snapshot`` found it."""
        state.restore_snapshot(self, snapshot)

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

    def lay_out_state(self) -> None:
        """Params replicated, buffers, masters and states per the plan: after anything wrote
        the state (a checkpoint load, a captured step put back), and after an update, where
        output propagation would otherwise leave updated params sharded like the states they
        came from."""
        state.lay_out(self.state_tensors(), self.mesh)

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
        state.keep_step_state_on_device(self)

    def was_step_applied(self) -> bool:
        return bool(self._step_applied)

    def last_loss(self) -> Optional[float]:
        """The loss last passed to ``backward`` (before gas scaling); reads the device."""
        loss = None if self._last_loss is None else float(self._last_loss)
        notice_nonfinite(self, loss, "loss")
        return loss

    def current_loss_scale(self) -> float:
        """The loss scale in use (reads the device under dynamic fp16 scaling); 1.0 without one."""
        return 1.0 if self._loss_scale is None else float(self._loss_scale.scale)

    def overflow(self) -> bool:
        return bool(self._last_overflow)

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

