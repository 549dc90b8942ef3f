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
from spmdzero.optim.update import LossScale, boundary_update, sum_of_squares, update_group
from spmdzero.train.engine_base import NO_GRADIENTS
from spmdzero.backends.torchax.optim import torch_optim
from spmdzero.backends.torchax.engine.release import release_in_background
from spmdzero.backends.torchax.engine.placement import _jax_dtype
from spmdzero.runtime.out_of_memory import raises_torch_out_of_memory



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
            if self._accum is None:
                raise RuntimeError(NO_GRADIENTS)
            self._take_model_step(lr_kwargs)
        self.micro_steps += 1
        self._draw_step += 1
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
        return self._jax.device_put(stacked, self._replicated)  # one layout every step: one trace

    def _device_count(self, value: float):
        """The schedule's step count as a replicated JAX scalar."""
        return self._jax.device_put(self._jax.numpy.float32(value), self._replicated)

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
        self._retired_inputs = (self._params, self._masters, self._opt_state, self._shared_state, self._accum,
                                self._skipped, self._loss_scale)
        self._set_accum(None)
        self._window_reduced = False
        self._generation += 1
        self.runs["update"] += 1
        with warnings.catch_warnings():  # the gradients are donated to be freed, not to hold results
            warnings.filterwarnings("ignore", "Some donated buffers were not usable")
            try:
                updated = update(*self._retired_inputs, hyper)
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
                updated = update(*self._retired_inputs, hyper)
            (self._params, self._masters, self._opt_state, self._shared_state, self._global_grad_norm, self._skipped,
             self._last_skip, self._loss_scale) = updated
        # the gradients are the one donated input no output reuses (JAX keeps such a buffer): released
        # now, off this thread, not held to the next boundary beside the next window's gradients
        release_in_background(self._retired_inputs[4])
        self._retired_inputs = (*self._retired_inputs[:4], None, *self._retired_inputs[5:])
        self._module_stale = True
        self._step_loss, self._window_loss = self._window_loss, None

    def _unclipped(self):
        """The update program without gradient clipping (``optimizer_step`` at stage 0 in fp32),
        built at its first use."""
        if self._unclipped_update is None:
            self._unclipped_update = self._build_update(clipping=0.0)
        return self._unclipped_update

    def _build_update(self, clipping: Optional[float] = None):
        """``(params, masters, states, shared states, grads, skipped, loss scale, hyperparameters) ->
        (params, masters, states, shared states, norm, skipped, skip, loss scale)``, jitted, all but
        the hyperparameters donated: the engine's boundary step (clipping, the optimizer's math, the
        overflow skip under fp16 and bf16's check, fp16's loss scaler). The shared states (the step
        counter) are every parameter's."""
        import jax
        import jax.numpy as jnp

        optimizer, ops = self.basic_optimizer, jax_ops()
        clipping = self._config.gradient_clipping if clipping is None else clipping
        groups = [] if self._torch_optimizer else [
            (names, list(optimizer._hyper_values(g)), {k: v for k, v in g.items() if isinstance(v, bool)})
            for names, g in zip(self._groups, optimizer.param_groups)]
        order, policy = self._names, self.precision
        param_dtype = _jax_dtype(policy.param_dtype)
        # stages 1-2 on two fsdp axes: each parameter is gathered from its shard one axis at a
        # time (on v5p:4x4x8 libtpu all-reduced the 7B's whole parameters instead: ZeRO-2 sent
        # 1.52x the minimum)
        staged = {} if self.plan.stage >= 3 else {
            n: [self._sharding(self.plan[n].optimizer_state)] +
               [self._sharding(s) for s in self.plan[n].gather_layouts[:-1]]
            for n in order if len(self.plan[n].zero_stages) > 1}

        def gathered(name, value):
            for sharding in staged.get(name, ()):
                value = jax.lax.with_sharding_constraint(value, sharding)
            return value

        # bf16 master weights (policy.low_precision_masters): the math in fp32 on the bf16
        # parameters, gradients and states, as DeepSpeed's Adam kernels load and store them
        low = policy.low_precision_masters
        state_dtype = _jax_dtype(policy.state_dtype)

        def up(tree):
            return jax.tree.map(lambda a: a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a, tree)

        def stored(state):  # per-element states in the state dtype; step counters stay as they are
            return {k: v.astype(state_dtype) if v.ndim and jnp.issubdtype(v.dtype, jnp.floating) else v
                    for k, v in state.items()}

        def update(params, masters, states, shared, grads, skipped, loss_scale, hyper):
            self.traces["update"] += 1
            targets = masters if masters else params
            if low:
                targets, grads, states = up(targets), up(grads), up(states)

            def apply(scale):
                if self._torch_optimizer:
                    lrs = [[g["lr"]] for g in optimizer.param_groups] if self._lr_mode == "constant" else hyper
                    new_targets, new_states = torch_optim.traced_step(
                        optimizer, self._groups, targets, grads, states, lrs, scale.multiplier, scale.skip, self._env,
                        self._lr_mode)
                    new_states = {n: {k: jax.lax.with_sharding_constraint(v, self._state_spec(n, v))
                                      for k, v in st.items()} for n, st in new_states.items()}
                    return {**targets, **new_targets}, {**states, **new_states}, dict(shared)
                new_targets, new_states, new_shared = dict(targets), dict(states), dict(shared)
                for (names, keys, static), values in zip(groups, hyper):
                    hp = {k: values[i] for i, k in enumerate(keys)}
                    group_targets, group_states = update_group(
                        optimizer, [targets[n] for n in names], [grads[n] for n in names],
                        [{**states[n], **shared} for n in names], hp, static, scale, ops)
                    for name, new_target, new_state in zip(names, group_targets, group_states):
                        new_shared.update((k, new_state.pop(k)) for k in shared)  # the same value for every parameter
                        new_targets[name], new_states[name] = new_target, new_state
                return new_targets, new_states, new_shared

            # the torch_xla engine's global norm: fp32, in parameter order
            sum_sq = sum_of_squares([grads[name] for name in order], ops)
            result = boundary_update(sum_sq, loss_scale, clipping, policy, ops, apply)
            new_targets, new_states, new_shared = result.applied
            if low:
                new_targets = {n: t.astype(param_dtype) for n, t in new_targets.items()}
                new_states = {n: stored(st) for n, st in new_states.items()}
            norm, skip = result.scale.norm, result.scale.skip
            skip = jnp.zeros((), bool) if skip is None else skip
            if not masters:
                # each in its own dtype: a bf16 parameter of an fp32 model (Apertus' xIELU) took its
                # fp32 gradient's dtype, and the next step retraced on it
                new_targets = {n: gathered(n, t.astype(params[n].dtype)) for n, t in new_targets.items()}
                return new_targets, masters, new_states, new_shared, norm, skipped + skip, skip, result.loss_scale
            new_params = {n: gathered(n, t.astype(params[n].dtype if n in params else param_dtype))  # all-gathered
                          for n, t in new_targets.items()}  # in bf16/fp16
            return new_params, new_targets, new_states, new_shared, norm, skipped + skip, skip, result.loss_scale

        rep = self._replicated
        scaler = None if self._loss_scale is None else LossScale(*(rep,) * len(LossScale._fields))
        # a torch optimizer's states appear at its first step: laid out inside the program (_state_spec)
        states = None if self._torch_optimizer else self._state_specs
        shardings = (self._param_specs, self._master_specs, states, {k: rep for k in self._shared_state},
                     rep, rep, rep, scaler)
        self._update_shardings = shardings  # trace_step's outputs are laid out as the update's
        # keep_unused: under master weights the update reads no parameter, and an input jit prunes is
        # not donated: the old bf16 parameters stayed beside the new ones until the next boundary
        return jax.jit(update, out_shardings=shardings, donate_argnums=(0, 1, 2, 3, 4, 5, 6), keep_unused=True)

    def zero_grad(self) -> None:
        """DeepSpeed's ``engine.zero_grad()``: it sets the parameters' ``.grad`` to None, which
        drops the gradients accumulated since the last optimizer step only where the ZeRO stage
        still keeps them there (``zero_grad_keeps_gradients``): at stage 0, and at stage 1
        before the boundary's backward. A forward whose backward is still to come keeps its
        gradient: its backward takes it again without the dropped ones, as torch's would."""
        self._zero_grad(by_optimizer=False)

    def _zero_grad(self, by_optimizer: bool) -> None:
        if self._accum is not None and self.zero_grad_overwrites_next_backward(by_optimizer):
            self._overwrite_at_backward = True  # the next backward drops them (backward.py)
        elif self._accum is not None and not self.zero_grad_keeps_gradients(by_optimizer, self._window_reduced):
            release_in_background(self._accum)
            self._set_accum(None)
            self._window_reduced = False
