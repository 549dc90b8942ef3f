"""A torchax engine's ``step()`` at the accumulation boundary: one jitted update program
(DeepSpeed's global-norm clipping, fp16's overflow skip, the optimizer's math, parameters
replicated and states laid out by the plan, old buffers donated) with the hyperparameters as
traced inputs, so that a changing lr never recompiles; and ``zero_grad``. A mixin of
``TorchaxEngine``."""

from __future__ import annotations

import warnings
from typing import Optional

import numpy as np

from spmdzero.optim.ops import jax_ops
from spmdzero.optim.update import LossScale
from spmdzero.train.engine_base import NO_GRADIENTS
from spmdzero.backends.torchax.optim import torch_optim
from spmdzero.backends.torchax.engine.release import release_in_background
from spmdzero.backends.torchax.programs.train_state import Stepped
from spmdzero.runtime.out_of_memory import raises_torch_out_of_memory
from spmdzero.backends.torchax.programs.update import UpdateSetup, build_update



class UpdateProgram:
    """The update part of ``TorchaxEngine`` (see the module docstring)."""

    @raises_torch_out_of_memory
    def step(self, lr_kwargs: Optional[dict] = None) -> None:
        """Apply the update at an accumulation boundary; count every call; hold the step's
        traces to the recompile guard."""
        boundary = self.is_gradient_accumulation_boundary()
        self._settle()  # a forward that no backward followed adds nothing
        if boundary:
            if self.optimizer is None:
                raise RuntimeError("engine.step() needs an optimizer: pass optimizer= to initialize() or add an "
                                   "'optimizer' section to the config")
            if self.state.accum is None:
                raise RuntimeError(NO_GRADIENTS)
            self._take_model_step(lr_kwargs)
        self.micro_steps += 1
        self.state = self.state._replace(draw_step=self.state.draw_step + 1)
        # the training programs traced since the last step (a trace is a compile); an evaluation
        # forward's program is not the step's
        traces = sum(n for kind, n in self.traces.items() if kind != "forward")
        self.recompile_guard.check(traces - self._traces_at_step, self.global_steps, boundary, self._input_shapes,
                                   warmup=self._new_shape_bucket())
        self._traces_at_step = traces

    def _hyper_array(self, values: list):
        """One group's hyperparameters, the update's input: a host array, or a device one where
        a DeepSpeed schedule keeps its lr on the devices (JAX values: no host read)."""
        if all(isinstance(v, (int, float)) for v in values):
            return np.array(values, dtype=np.float32)
        jnp = self._jax.numpy
        stacked = jnp.stack([jnp.asarray(v, dtype=jnp.float32).reshape(()) for v in values])
        return self._jax.device_put(stacked, self.placement.replicated)  # one layout every step: one trace

    def _device_count(self, value: float):
        """The schedule's step count as a replicated JAX scalar."""
        return self._jax.device_put(self._jax.numpy.float32(value), self.placement.replicated)

    def _take_model_step(self, lr_kwargs: Optional[dict]) -> None:
        """The engine's optimizer step: the update, then the schedule, the counters and the step
        log, as DeepSpeed's ``engine._take_model_step``."""
        self._apply_update(lr_kwargs, clipped=True)
        if self.lr_scheduler is not None:
            if self._schedule_on_devices and not lr_kwargs:
                self.lr_scheduler.step_if(self._jax.numpy.logical_not(self._last_skip))
            else:
                self.lr_scheduler.step(**(lr_kwargs or {}))
        self.global_steps += 1
        self.global_samples += self._consume_samples()
        self._step_logger.after_boundary(self)  # reads the device at print steps only
        self.tput_timer.after_boundary()
        self._run_post_step_hooks()

    def _apply_update(self, lr_kwargs: Optional[dict], clipped: bool) -> None:
        """Run the update program (``_build_update``; ``clipped``: with the config's gradient
        clipping, else without) on the accumulated gradients, which it consumes: the parameters,
        master weights and optimizer states are its outputs."""
        def update(*args):
            return (self._update if clipped else self._unclipped())(*args)

        self._settle()
        if self._schedule_on_devices and not lr_kwargs:  # as the previous step left it (a load: from the host)
            self.lr_scheduler.keep_on_device(None, put=self._device_count, ops=jax_ops())
        if self._torch_optimizer:
            constant = self._lr_mode == "constant"
            # lr None: an optimizer that sizes its own steps (Adafactor's relative_step) and reads none
            hyper = [] if constant else [self._hyper_array([0.0 if g["lr"] is None else g["lr"]])
                                         for g in self.basic_optimizer.param_groups]
            static = torch_optim.static_hyperparameters(self.basic_optimizer, with_lr=constant)
            if static != self._static_hyper:  # constants of the update program: built for the new ones
                self._static_hyper, self._update, self._unclipped_update = static, self._build_update(), None
        else:
            hyper = [self._hyper_array(list(self.basic_optimizer._hyper_values(g).values()))
                     for g in self.basic_optimizer.param_groups]
        # The inputs, donated, are released at the next boundary: dropping the last reference to an
        # array that a dispatched program still uses blocks the host until that program has run.
        release_in_background(self._retired_inputs)
        stepped, grads = self.state.stepped(), self.state.accum
        self._retired_inputs = (stepped, grads)
        self._set_accum(None)
        self._window_reduced = False
        self._generation += 1
        self.runs["update"] += 1
        with warnings.catch_warnings():  # the gradients are donated to be freed, not to hold results
            warnings.filterwarnings("ignore", "Some donated buffers were not usable")
            try:
                stepped, report = update(stepped, grads, hyper)
            except self._jax.errors.ConcretizationTypeError:
                if not self._torch_optimizer or self._lr_mode != "traced":
                    raise
                # its step reads the lr as a Python number (SGD's alpha=-lr); the trace failed
                # before anything ran, so the donated inputs are intact (torch_optim.LR_MODES)
                self._lr_mode = torch_optim.fallback_lr_mode(self.basic_optimizer)
                if self._lr_mode == "constant":
                    warnings.warn(f"spmdzero: {type(self.basic_optimizer).__name__}'s step needs the lr as a Python number "
                                  "on the torchax backend: each new lr compiles the update again (a schedule changing "
                                  "it every step recompiles every step)", stacklevel=4)
                    hyper = []
                self._static_hyper = torch_optim.static_hyperparameters(self.basic_optimizer,
                                                                        with_lr=self._lr_mode == "constant")
                self._update, self._unclipped_update = self._build_update(), None
                stepped, report = update(stepped, grads, hyper)
        self.state = self.state.with_stepped(stepped)
        self._global_grad_norm, self._last_skip = report
        # the gradients are the one donated input no output reuses (JAX keeps such a buffer): released
        # now, off this thread, not held to the next boundary beside the next window's gradients
        release_in_background(grads)
        self._retired_inputs = (self._retired_inputs[0], None)
        self._module_stale = True
        self._step_loss, self._window_loss = self._window_loss, None

    def _unclipped(self):
        """The update program without gradient clipping (``optimizer_step`` at stage 0 in fp32),
        built at its first use."""
        if self._unclipped_update is None:
            self._unclipped_update = self._build_update(clipping=0.0)
        return self._unclipped_update

    def _build_update(self, clipping: Optional[float] = None):
        """The update program for this engine's optimizer, plan and precision (``build_update``)."""
        return build_update(UpdateSetup(
            optimizer=self.basic_optimizer, groups=self._groups, order=self._names, plan=self.plan,
            sharding=self.placement.sharding, policy=self.precision,
            clipping=self._config.gradient_clipping if clipping is None else clipping,
            torch_optimizer=self._torch_optimizer, lr_mode=self._lr_mode, env=self._env, count_trace=self._count_trace,
            stepped_shardings=self._stepped_shardings()))

    def _stepped_shardings(self) -> Stepped:
        """The layouts the update gives its outputs: the plan's, replicated scalars; a torch
        optimizer's states appear at its first step and are laid out inside the program."""
        rep = self.placement.replicated
        scaler = None if self.state.loss_scale is None else LossScale(*(rep,) * len(LossScale._fields))
        return Stepped(params=self._param_specs, masters=self._master_specs,
                       opt_state=None if self._torch_optimizer else self._state_specs,
                       shared_state={k: rep for k in self.state.shared_state}, skipped=rep, loss_scale=scaler)

    def zero_grad(self) -> None:
        """DeepSpeed's ``engine.zero_grad()``: it sets the parameters' ``.grad`` to None, which
        drops the gradients accumulated since the last optimizer step only where the ZeRO stage
        still keeps them there (``zero_grad_keeps_gradients``): at stage 0, and at stage 1
        before the boundary's backward. A forward whose backward is still to come keeps its
        gradient: its backward takes it again without the dropped ones, as torch's would."""
        self._zero_grad(by_optimizer=False)

    def _zero_grad(self, by_optimizer: bool) -> None:
        if self.state.accum is not None and self.zero_grad_overwrites_next_backward(by_optimizer):
            self._overwrite_at_backward = True  # the next backward drops them (backward.py)
        elif self.state.accum is not None and not self.zero_grad_keeps_gradients(by_optimizer, self._window_reduced):
            release_in_background(self.state.accum)
            self._set_accum(None)
            self._window_reduced = False

