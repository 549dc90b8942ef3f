"""The update program at an accumulation boundary: DeepSpeed's global-norm clipping, fp16's
overflow skip and loss scaler, the optimizer's math (``optim/update.py``, both backends'; or a
torch.optim optimizer's own step traced, ``optim/torch_optim.py``), the parameters gathered and
the states laid out by the plan. A plain function ``(Stepped, gradients, hyperparameters) ->
(Stepped, StepReport)`` of the engine's ``TrainState`` part, built by ``build_update`` from an
``UpdateSetup``; the hyperparameters are traced inputs, so a changing lr never recompiles."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from spmdzero.optim.ops import jax_ops
from spmdzero.optim.update import boundary_update, sum_of_squares, update_group
from spmdzero.sharding.plan import replicated
from spmdzero.backends.torchax.optim import torch_optim
from spmdzero.backends.torchax.lowering.values import jax_dtype
from spmdzero.backends.torchax.programs.train_state import StepReport, Stepped


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
