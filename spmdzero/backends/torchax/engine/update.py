"""A torchax engine's ``step()`` at the accumulation boundary: one jitted update program
(DeepSpeed's global-norm clipping, fp16's overflow skip, the optimizer's math, parameters
replicated and states laid out by the plan, old buffers donated) with the hyperparameters as
traced inputs, so that a changing lr never recompiles. ``Updates`` is the engine's part that runs
it (``engine.updates``)."""

from __future__ import annotations

import warnings
import weakref
from typing import Optional

import numpy as np

from spmdzero.optim.ops import jax_ops
from spmdzero.optim.update import LossScale
from spmdzero.optim.schedules import LRSchedule
from spmdzero.backends.torchax.optim import torch_optim
from spmdzero.backends.torchax.engine.release import release_in_background
from spmdzero.backends.torchax.programs.train_state import Stepped
from spmdzero.backends.torchax.programs.update import UpdateSetup, build_update



class Updates:
    """The optimizer step's program: a part of ``TorchaxEngine`` (``engine.updates``). It builds
    the update (again when a torch optimizer's constant hyperparameters change), gives it the
    hyperparameters, runs it on the accumulated gradients and keeps what it reported. What it
    owns: the update programs (with and without clipping), how a torch optimizer's lr reaches
    them (``lr_mode``), the last step's skip flag, and the inputs a dispatched update still uses."""

    def __init__(self, engine, lr_scheduler):
        self._engine = weakref.proxy(engine)  # the engine holds this part; the part does not keep it alive
        optimizer, torch_optimizer = engine.basic_optimizer, engine.torch_optimizer
        self.static_hyper = torch_optim.static_hyperparameters(optimizer) if torch_optimizer else None
        # how the torch optimizer's step gets its lr (torch_optim.LR_MODES)
        self.lr_mode = torch_optim.initial_lr_mode(optimizer) if torch_optimizer else "traced"
        self._retired_inputs: tuple = ()  # the last update's inputs
        self.last_skip = None  # whether the last step was skipped for overflow (a device bool)
        self.program = self.build() if optimizer is not None else None
        self._unclipped_program = None  # engine.optimizer.step()'s at stage 0 in fp32 (``_unclipped``)
        # DeepSpeed does not step the schedule on a step skipped for overflow, which only the
        # devices know: DeepSpeed's schedules then count and compute their lr there (step_if)
        precision = engine.precision
        self.schedule_on_devices = precision.check_overflow and isinstance(lr_scheduler, LRSchedule)
        if precision.check_overflow and lr_scheduler is not None and not self.schedule_on_devices:
            warnings.warn(f"spmdzero: spmd.backend='torchax' steps the {type(lr_scheduler).__name__} schedule on "
                          "every boundary, including steps skipped for overflow (DeepSpeed does not step it then; "
                          "DeepSpeed's own schedules, from the config, do not either)", stacklevel=5)

    def _hyper_array(self, values: list):
        """One group's hyperparameters, the update's input: a host array, or a device one where
        a DeepSpeed schedule keeps its lr on the devices (JAX values: no host read)."""
        import jax

        if all(isinstance(v, (int, float)) for v in values):
            return np.array(values, dtype=np.float32)
        stacked = jax.numpy.stack([jax.numpy.asarray(v, dtype=jax.numpy.float32).reshape(()) for v in values])
        return jax.device_put(stacked, self._engine.placement.replicated)  # one layout every step: one trace

    def _device_count(self, value: float):
        """The schedule's step count as a replicated JAX scalar."""
        import jax

        return jax.device_put(jax.numpy.float32(value), self._engine.placement.replicated)

    def step_schedule(self, lr_kwargs: Optional[dict]) -> None:
        """The LR schedule's step after an update (on the devices where it must see the skip)."""
        import jax

        schedule = self._engine.lr_scheduler
        if schedule is None:
            return
        if self.schedule_on_devices and not lr_kwargs:
            schedule.step_if(jax.numpy.logical_not(self.last_skip))
        else:
            schedule.step(**(lr_kwargs or {}))

    def apply(self, lr_kwargs: Optional[dict], clipped: bool):
        """Run the update program (``clipped``: with the config's gradient clipping, else
        without) on the accumulated gradients, which it consumes: the parameters, master weights
        and optimizer states are its outputs. Returns the pre-clip global gradient norm (a
        device scalar)."""
        import jax

        engine = self._engine
        optimizer = engine.basic_optimizer

        def update(*args):
            return (self.program if clipped else self._unclipped())(*args)

        engine.gradients.settle()
        if self.schedule_on_devices and not lr_kwargs:  # as the previous step left it (a load: from the host)
            engine.lr_scheduler.keep_on_device(None, put=self._device_count, ops=jax_ops())
        if engine.torch_optimizer:
            constant = self.lr_mode == "constant"
            # lr None: an optimizer that sizes its own steps (Adafactor's relative_step) and reads none
            hyper = [] if constant else [self._hyper_array([0.0 if g["lr"] is None else g["lr"]])
                                         for g in optimizer.param_groups]
            static = torch_optim.static_hyperparameters(optimizer, with_lr=constant)
            if static != self.static_hyper:  # constants of the update program: built for the new ones
                self.static_hyper, self.program, self._unclipped_program = static, self.build(), None
        else:
            hyper = [self._hyper_array(list(optimizer._hyper_values(g).values())) for g in optimizer.param_groups]
        # The inputs, donated, are released at the next boundary: dropping the last reference to an
        # array that a dispatched program still uses blocks the host until that program has run.
        release_in_background(self._retired_inputs)
        stepped, grads = engine.state.stepped(), engine.state.accum
        self._retired_inputs = (stepped, grads)
        engine.gradients.new_window()
        engine.params_version += 1
        engine.runs["update"] += 1
        with warnings.catch_warnings():  # the gradients are donated to be freed, not to hold results
            warnings.filterwarnings("ignore", "Some donated buffers were not usable")
            try:
                stepped, report = update(stepped, grads, hyper)
            except jax.errors.ConcretizationTypeError:
                if not engine.torch_optimizer or self.lr_mode != "traced":
                    raise
                # its step reads the lr as a Python number (SGD's alpha=-lr); the trace failed
                # before anything ran, so the donated inputs are intact (torch_optim.LR_MODES)
                if self.fall_back_to_constant_lr():
                    hyper = []
                stepped, report = update(stepped, grads, hyper)
        engine.state = engine.state.with_stepped(stepped)
        self.last_skip = report.skip
        # the gradients are the one donated input no output reuses (JAX keeps such a buffer): released
        # now, off this thread, not held to the next boundary beside the next window's gradients
        release_in_background(grads)
        self._retired_inputs = (self._retired_inputs[0], None)
        return report.grad_norm

    def fall_back_to_constant_lr(self, warn: bool = True) -> bool:
        """A torch optimizer whose step read the lr as a Python number: its lr mode falls back
        (``torch_optim.LR_MODES``) and the update is built again. Returns whether the lr is now a
        constant of the program (said once: each new lr then compiles the update again)."""
        optimizer = self._engine.basic_optimizer
        self.lr_mode = torch_optim.fallback_lr_mode(optimizer)
        constant = self.lr_mode == "constant"
        if constant and warn:
            warnings.warn(f"spmdzero: {type(optimizer).__name__}'s step needs the lr as a Python number "
                          "on the torchax backend: each new lr compiles the update again (a schedule changing "
                          "it every step recompiles every step)", stacklevel=6)
        self.static_hyper = torch_optim.static_hyperparameters(optimizer, with_lr=constant)
        self.program, self._unclipped_program = self.build(), None
        return constant

    def _unclipped(self):
        """The update program without gradient clipping (``optimizer_step`` at stage 0 in fp32),
        built at its first use."""
        if self._unclipped_program is None:
            self._unclipped_program = self.build(clipping=0.0)
        return self._unclipped_program

    def build(self, clipping: Optional[float] = None):
        """The update program for the engine's optimizer, plan and precision (``build_update``)."""
        engine = self._engine
        return build_update(UpdateSetup(
            optimizer=engine.basic_optimizer, groups=engine.trained.groups, order=engine.trained.names,
            plan=engine.plan, sharding=engine.placement.sharding, policy=engine.precision,
            clipping=engine.gradient_clipping() if clipping is None else clipping,
            torch_optimizer=engine.torch_optimizer, lr_mode=self.lr_mode, env=engine.env,
            count_trace=engine.count_trace, stepped_shardings=self.stepped_shardings()))

    def stepped_shardings(self) -> Stepped:
        """The layouts the update gives its outputs: the plan's, replicated scalars; a torch
        optimizer's states appear at its first step and are laid out inside the program."""
        engine = self._engine
        rep, trained = engine.placement.replicated, engine.trained
        scaler = None if engine.state.loss_scale is None else LossScale(*(rep,) * len(LossScale._fields))
        return Stepped(params=trained.param_specs, masters=trained.master_specs,
                       opt_state=None if engine.torch_optimizer else trained.state_specs,
                       shared_state={k: rep for k in engine.state.shared_state}, skipped=rep, loss_scale=scaler)

    def abstract_hyper(self) -> list:
        """The update's hyperparameter input as ``jax.ShapeDtypeStruct``s: one float32 vector per
        param group, as ``apply`` gives it (none when a torch optimizer's lr is a constant of the
        program)."""
        import jax

        engine = self._engine
        optimizer, rep = engine.basic_optimizer, engine.placement.replicated
        if engine.torch_optimizer:
            return [] if self.lr_mode == "constant" else [
                jax.ShapeDtypeStruct((1,), np.float32, sharding=rep) for _ in optimizer.param_groups]
        return [jax.ShapeDtypeStruct((len(optimizer._hyper_values(g)),), np.float32, sharding=rep)
                for g in optimizer.param_groups]
