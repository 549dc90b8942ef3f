"""A torchax engine's ``step()`` at the accumulation boundary: one jitted update program
(DeepSpeed's global-norm clipping, fp16's overflow skip, the optimizer's math, parameters
replicated and states laid out by the plan, old buffers donated) with the hyperparameters as
traced inputs, so that a changing lr never recompiles; and ``zero_grad``. A mixin of
``TorchaxEngine``."""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable, Optional

import numpy as np

from spmdzero.optim.ops import jax_ops
from spmdzero.optim.update import LossScale, boundary_update, sum_of_squares, update_group
from spmdzero.sharding.plan import replicated
from spmdzero.train.engine_base import NO_GRADIENTS
from spmdzero.backends.torchax.optim import torch_optim
from spmdzero.backends.torchax.engine.release import release_in_background
from spmdzero.backends.torchax.lowering.values import jax_dtype
from spmdzero.backends.torchax.engine.train_state import StepReport, Stepped
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
            sharding=self._sharding, policy=self.precision,
            clipping=self._config.gradient_clipping if clipping is None else clipping,
            torch_optimizer=self._torch_optimizer, lr_mode=self._lr_mode, env=self._env, count_trace=self._count_trace,
            stepped_shardings=self._stepped_shardings()))

    def _stepped_shardings(self) -> Stepped:
        """The layouts the update gives its outputs: the plan's, replicated scalars; a torch
        optimizer's states appear at its first step and are laid out inside the program."""
        rep = self._replicated
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


@dataclasses.dataclass(frozen=True)
class UpdateSetup:
    """What the update program is built from: the optimizer and its groups, the plan's layouts,
    the precision policy and the clipping."""

    optimizer: Any  # spmdzero's optimizer (its math), or a torch.optim one (its traced step)
    groups: list  # each param group's parameter names
    order: list  # the trained parameter names, in the order the global norm sums them
    plan: Any  # the sharding plan
    sharding: Callable  # partition spec -> NamedSharding on the engine's mesh
    policy: Any  # the precision policy
    clipping: float  # DeepSpeed's gradient_clipping (0: none)
    torch_optimizer: bool
    lr_mode: str  # how a torch optimizer's step gets its lr (torch_optim.LR_MODES)
    env: Any  # torchax's environment (a torch optimizer's step runs in it)
    count_trace: Callable[[str], None]  # counts a trace of a program kind on the engine
    stepped_shardings: Stepped  # the outputs' layouts


def build_update(setup: UpdateSetup):
    """``(stepped, grads, hyperparameters) -> (stepped, StepReport)``, jitted, the state and the
    gradients donated: the engine's boundary step (clipping, the optimizer's math, the overflow
    skip under fp16 and bf16's check, fp16's loss scaler). ``stepped`` is the ``Stepped`` part of
    the engine's ``TrainState``; its shared states (the step counter) are every parameter's."""
    import jax
    import jax.numpy as jnp

    optimizer, ops, plan, sharding, policy = setup.optimizer, jax_ops(), setup.plan, setup.sharding, setup.policy
    groups = [] if setup.torch_optimizer else [
        (names, list(optimizer._hyper_values(g)), {k: v for k, v in g.items() if isinstance(v, bool)})
        for names, g in zip(setup.groups, optimizer.param_groups)]
    order = setup.order
    param_dtype = jax_dtype(policy.param_dtype)
    # stages 1-2 on two fsdp axes: each parameter is gathered from its shard one axis at a
    # time (on v5p:4x4x8 libtpu all-reduced the 7B's whole parameters instead: ZeRO-2 sent
    # 1.52x the minimum)
    staged = {} if plan.stage >= 3 else {
        n: [sharding(plan[n].optimizer_state)] + [sharding(s) for s in plan[n].gather_layouts[:-1]]
        for n in order if len(plan[n].zero_stages) > 1}

    def gathered(name, value):
        for layout in staged.get(name, ()):
            value = jax.lax.with_sharding_constraint(value, layout)
        return value

    def state_layout(name, value):  # a torch optimizer's state: the plan's if parameter-shaped, else replicated
        planned = plan[name]
        return sharding(planned.optimizer_state if tuple(value.shape) == tuple(planned.shape)
                        else replicated(value.ndim))

    # bf16 master weights (policy.low_precision_masters): the math in fp32 on the bf16
    # parameters, gradients and states, as DeepSpeed's Adam kernels load and store them
    low = policy.low_precision_masters
    state_dtype = jax_dtype(policy.state_dtype)

    def up(tree):
        return jax.tree.map(lambda a: a.astype(jnp.float32) if a.dtype == jnp.bfloat16 else a, tree)

    def stored(state):  # per-element states in the state dtype; step counters stay as they are
        return {k: v.astype(state_dtype) if v.ndim and jnp.issubdtype(v.dtype, jnp.floating) else v
                for k, v in state.items()}

    def update(stepped: Stepped, grads, hyper):
        setup.count_trace("update")
        params, masters, states, shared = stepped.params, stepped.masters, stepped.opt_state, stepped.shared_state
        targets = masters if masters else params
        if low:
            targets, grads, states = up(targets), up(grads), up(states)

        def apply(scale):
            if setup.torch_optimizer:
                lrs = [[g["lr"]] for g in optimizer.param_groups] if setup.lr_mode == "constant" else hyper
                new_targets, new_states = torch_optim.traced_step(
                    optimizer, setup.groups, targets, grads, states, lrs, scale.multiplier, scale.skip, setup.env,
                    setup.lr_mode)
                new_states = {n: {k: jax.lax.with_sharding_constraint(v, state_layout(n, v)) for k, v in st.items()}
                              for n, st in new_states.items()}
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
        result = boundary_update(sum_sq, stepped.loss_scale, setup.clipping, policy, ops, apply)
        new_targets, new_states, new_shared = result.applied
        if low:
            new_targets = {n: t.astype(param_dtype) for n, t in new_targets.items()}
            new_states = {n: stored(st) for n, st in new_states.items()}
        skip = result.scale.skip
        skip = jnp.zeros((), bool) if skip is None else skip
        report = StepReport(grad_norm=result.scale.norm, skip=skip)
        if not masters:
            # each in its own dtype: a bf16 parameter of an fp32 model (Apertus' xIELU) took its
            # fp32 gradient's dtype, and the next step retraced on it
            new_params, new_masters = {n: gathered(n, t.astype(params[n].dtype)) for n, t in new_targets.items()}, masters
        else:
            new_params = {n: gathered(n, t.astype(params[n].dtype if n in params else param_dtype))  # all-gathered
                          for n, t in new_targets.items()}  # in bf16/fp16
            new_masters = new_targets
        return Stepped(new_params, new_masters, new_states, new_shared, stepped.skipped + skip,
                       result.loss_scale), report

    rep = sharding(())
    # keep_unused: under master weights the update reads no parameter, and an input jit prunes is
    # not donated: the old bf16 parameters stayed beside the new ones until the next boundary
    return jax.jit(update, out_shardings=(setup.stepped_shardings, StepReport(rep, rep)), donate_argnums=(0, 1),
                   keep_unused=True)
