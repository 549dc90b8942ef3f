"""The engine's first ``TrainState``, and what it trains, from the module, the optimizer and the
plan: the trained parameters placed by the plan's parameter spec, fp32 masters under mixed
precision, the optimizer's initial states by its state spec, the frozen parameters and buffers
as constants, fp16's loss scaler. Why a module of its own: it is the one place that decides what
the devices hold at initialize (the memory ZeRO accounts for), read apart from the engine that
then steps it."""

from __future__ import annotations

from typing import NamedTuple

import torch

from spmdzero.optim.update import LossScale, init_loss_scale
from spmdzero.sharding.plan import replicated
from spmdzero.train.build import move_in_place
from spmdzero.backends.torchax.programs.train_state import TrainState


class Trained(NamedTuple):
    """What the engine trains, fixed at initialize: the names and the layouts the programs give
    each array (``NamedSharding``s from the plan's specs)."""

    names: tuple  # the trained parameters' plan names, in the module's order
    groups: tuple  # each param group's parameter names
    param_specs: dict  # name -> the parameter's layout
    grad_specs: dict  # name -> the gradient's layout (ZeRO-2's shards)
    master_specs: dict  # name -> the fp32 master's layout (empty without masters)
    state_specs: dict  # name -> {optimizer state key -> its layout}, without the shared states


def initial_state(module: torch.nn.Module, optimizer, plan, placement, precision,
                  torch_optimizer: bool) -> tuple[TrainState, Trained]:
    """The state the engine starts from, placed on the mesh, and what it trains (see the module
    docstring). Casts the module's parameters to the parameter dtype in place, as DeepSpeed
    does; the random key is the engine's to seed (``rng`` None here)."""
    spec = placement.sharding
    groups = [] if optimizer is None else optimizer.param_groups
    # Trainable parameters by plan name; frozen ones and buffers are inputs that are not trained.
    by_id = {id(p): n for n, p in module.named_parameters()}
    optimized = ({id(p) for g in groups for p in g["params"]} if optimizer is not None else
                 {id(p) for p in module.parameters()})  # no optimizer: backward still gives every gradient
    names = tuple(n for n, p in module.named_parameters() if p.requires_grad and id(p) in optimized)
    group_names = tuple(tuple(by_id[id(p)] for p in g["params"]) for g in groups)
    trained = set(names)
    param_specs = {n: spec(plan[n].param) for n in names}
    grad_specs = {n: spec(plan[n].grad) for n in names}
    # Under bf16 the optimizer updates fp32 master weights laid out like its states (plan.master)
    # and the module's parameters are their bf16 casts, as in the torch_xla engine.
    master_specs = {n: spec(plan[n].master) for n in names} if precision.master_weights else {}
    masters = {n: placement.put(p.float(), master_specs[n]) for n, p in module.named_parameters()
               if n in master_specs}
    if precision.param_dtype != torch.float32:  # with fp32 masters, or bf16 ones (the parameters)
        move_in_place(module, precision.param_dtype)
    params = {n: placement.put(p.detach(), param_specs[n]) for n, p in module.named_parameters() if n in trained}
    constants = {n: placement.put(t.detach(), placement.replicated)
                 for n, t in [*module.named_parameters(), *module.named_buffers()] if n not in trained}
    # a torch.optim optimizer's own step runs in the update (torch_optim): its first step
    # creates its states, as torch's does
    states, state_specs = {}, {}
    for group, names_of_group in zip(groups, group_names):
        for p, name in zip(group["params"], names_of_group):
            initial = {} if torch_optimizer else optimizer._initial_state(p.detach().float(), group)
            # bf16.bf16_optimizer_states: the per-element states in bf16 (step counters as they are)
            initial = {k: v.to(precision.state_dtype) if v.dim() and v.is_floating_point() else v
                       for k, v in initial.items()}
            state_specs[name] = {k: spec(plan[name].optimizer_state if tuple(v.shape) == tuple(p.shape)
                                         else replicated(v.dim())) for k, v in initial.items()}
            states[name] = {k: placement.put(v, state_specs[name][k]) for k, v in initial.items()}
    # Every parameter steps together here (one update, one overflow skip): the optimizer's step
    # counters are one array, not one per parameter, so fewer arrays pass through every update.
    first = states.get(names[0], {}) if names else {}
    shared_state = {"step": first["step"]} if "step" in first else {}
    opt_state = {n: {k: v for k, v in st.items() if k not in shared_state} for n, st in states.items()}
    state_specs = {n: {k: v for k, v in st.items() if k not in shared_state} for n, st in state_specs.items()}
    # fp16's loss scaler (DeepSpeed's DynamicLossScaler, or a static scale): device scalars that
    # the training program multiplies the loss by and the update program steps (optim/update.py)
    scaler = init_loss_scale(precision)
    loss_scale = None if scaler is None else LossScale(
        *(placement.put(torch.tensor(v, dtype=torch.float32), placement.replicated) for v in scaler))
    # draw_step: micro-steps the random stream has passed, folded into each forward's key:
    # micro_steps as counted here, saved as a checkpoint's rng.position and restored exactly (a
    # load puts micro_steps at the window's start instead, global_steps x gradient_accumulation_steps)
    state = TrainState(params=params, masters=masters, opt_state=opt_state, shared_state=shared_state,
                       skipped=placement.put(torch.zeros(()), placement.replicated), loss_scale=loss_scale,
                       constants=constants, accum=None, rng=None, draw_step=0)
    return state, Trained(names, group_names, param_specs, grad_specs, master_specs, state_specs)
