"""A torchax engine's state as checkpoints and reports read it (``train.engine_base``'s state
protocol): the names of the optimized tensors, the states as shards, the optimizer states made
lazily or as placeholders before the first step, and loading a checkpoint's values back onto
the devices. ``save_checkpoint``/``load_checkpoint`` are ``spmdzero.io``'s. Functions of the
engine, which answers the protocol with them (``TorchaxEngine.optimized_names`` and the rest)."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from spmdzero.sharding.plan import replicated
from spmdzero.backends.torchax.optim import torch_optim



def optimized_names(engine) -> dict[torch.Tensor, str]:
    """{optimizer target: its name in checkpoints}: the module's host parameters, which the
    optimizer's param groups hold (their values and states live on the devices)."""
    params = dict(engine.host.wrapped.named_parameters())
    return {params[name]: name for name in engine.trained.names}


def state_tensors(engine) -> dict[str, tuple[Any, tuple]]:
    """Every device array of the training state by checkpoint key, with the partition spec
    the plan gives it: the torch_xla engine's keys (``model.*``, ``buffer.*``, ``master.*``,
    ``optim.<param>.<key>``), so that both backends' state reads the same. Reading only: a
    change made on the host since the last forward is not in it yet."""
    out: dict[str, tuple[Any, tuple]] = {}
    parameters = {name for name, _ in engine.host.wrapped.named_parameters()}
    for name, _ in engine.host.named_tensors():
        if name in engine.state.params:
            out[f"model.{name}"] = (engine.state.params[name], tuple(engine.plan[name].param))
        elif name in engine.state.constants:
            kind = "model" if name in parameters else "buffer"
            out[f"{kind}.{name}"] = (engine.state.constants[name], replicated(engine.state.constants[name].ndim))
    for name, master in engine.state.masters.items():
        out[f"master.{name}"] = (master, tuple(engine.plan[name].master))
    for name, states in engine.optimizer_states().items():
        shape = tuple(engine.state.params[name].shape)
        for key, value in states.items():
            if engine.torch_optimizer and key in torch_optim.HOST_KEYS:
                continue  # in the host state (save_checkpoint), as torch_xla's torch optimizer keeps it
            spec = engine.plan[name].optimizer_state if tuple(value.shape) == shape else replicated(value.ndim)
            out[f"optim.{name}.{key}"] = (value, tuple(spec))
    if engine.state.loss_scale is not None:
        for field, value in zip(engine.state.loss_scale._fields, engine.state.loss_scale):
            out[f"loss_scale.{field}"] = (value, ())
    return out


def _state_spec(engine, name: str, value):
    """An optimizer state's layout: the plan's for a parameter-shaped one, else replicated."""
    planned = engine.plan[name]
    return engine.placement.sharding(planned.optimizer_state if tuple(value.shape) == tuple(planned.shape)
                                     else replicated(value.ndim))


def placeholder_optimizer_state(engine) -> list:
    """Give each trained parameter without optimizer states (a torch optimizer before its
    first step) the states that step creates, laid out by the plan, values meaning nothing,
    for a checkpoint load to write into; the host-kept ones (``torch_optim.HOST_KEYS``) go
    in ``optimizer.state``, as the torch_xla backend keeps them. On a shape-only engine each
    is a ``jax.ShapeDtypeStruct`` among the device states, where a later step has them all
    (what ``trace_step`` traces). Returns those parameters."""
    import jax

    if not engine.torch_optimizer:
        return []
    pending = [n for n in engine.trained.names if not engine.state.opt_state[n]]
    if not pending:
        return []
    optimizer = engine.basic_optimizer
    shapes = torch_optim.state_shapes(optimizer, engine.trained.groups, engine.state.masters or engine.state.params,
                                      engine.env, engine.updates.lr_mode)
    hosts = {name: p for p, name in optimized_names(engine).items()}
    for name in pending:
        device, host = {}, {}
        for key, shape in shapes[name].items():
            if engine.shape_only:  # the states of a later step, all on the devices: what trace_step takes
                device[key] = jax.ShapeDtypeStruct(shape.shape, shape.dtype, sharding=_state_spec(engine, name, shape))
            elif key in torch_optim.HOST_KEYS:
                host[key] = torch.zeros(shape.shape, dtype=getattr(torch, str(shape.dtype)))
            else:
                device[key] = jax.jit(functools.partial(jax.numpy.zeros, shape.shape, shape.dtype),
                                      out_shardings=_state_spec(engine, name, shape))()
        engine.state = engine.state._replace(opt_state={**engine.state.opt_state, name: device})
        if host:
            optimizer.state[hosts[name]] = host
    return [hosts[name] for name in pending]


def drop_optimizer_state(engine, targets) -> None:
    """Take the optimizer states of ``targets`` back to none (the next step creates them)."""
    names = optimized_names(engine)
    for target in targets:
        engine.state = engine.state._replace(opt_state={**engine.state.opt_state, names[target]: {}})
        engine.basic_optimizer.state.pop(target, None)


def host_optimizer_state(engine) -> None:
    """A torch optimizer's host-kept states (``torch_optim.HOST_KEYS``) copied into
    ``optimizer.state``, where a checkpoint saves them (a device read)."""
    for target, name in optimized_names(engine).items():
        kept = {k: torch.tensor(np.asarray(v)) for k, v in engine.state.opt_state[name].items()
                if k in torch_optim.HOST_KEYS}
        if kept:
            engine.basic_optimizer.state[target] = kept


def take_host_optimizer_state(engine) -> None:
    """After a load: the host-kept states it wrote into ``optimizer.state`` go to the devices."""
    placement = engine.placement
    for target, name in optimized_names(engine).items():
        kept = engine.basic_optimizer.state.pop(target, {})
        values = {k: placement.put(torch.as_tensor(v, dtype=torch.float32), placement.replicated)
                  for k, v in kept.items() if k in torch_optim.HOST_KEYS}
        if values:
            engine.state = engine.state._replace(opt_state={**engine.state.opt_state,
                                                            name: {**engine.state.opt_state[name], **values}})


def load_state(engine, values: dict[str, Any]) -> None:
    """Put loaded values (JAX arrays by checkpoint key, any dtype and layout) in place of the
    live ones, in the live dtype and layout: the programs see the same inputs as before and
    are not traced again."""
    import jax

    def like(live, value):
        return jax.device_put(value.astype(live.dtype), live.sharding)

    state = engine.state
    for key, value in values.items():
        kind, _, rest = key.partition(".")
        if kind == "model" and rest in state.params:
            state = state._replace(params={**state.params, rest: like(state.params[rest], value)})
            engine.host.params_changed()
        elif kind in ("model", "buffer") and rest in state.constants:
            state = state._replace(constants={**state.constants, rest: like(state.constants[rest], value)})
            engine.host.buffers_changed([rest])
        elif kind == "loss_scale" and state.loss_scale is not None:
            state = state._replace(loss_scale=state.loss_scale._replace(
                **{rest: like(getattr(state.loss_scale, rest), value)}))
        elif kind == "master":
            state = state._replace(masters={**state.masters, rest: like(state.masters[rest], value)})
        elif kind == "optim":
            name, _, key_ = rest.rpartition(".")
            if key_ in state.shared_state:  # one counter for every parameter: each saved copy is the same
                state = state._replace(shared_state={**state.shared_state, key_: like(state.shared_state[key_], value)})
            else:
                state = state._replace(opt_state={**state.opt_state,
                                                  name: {**state.opt_state[name],
                                                         key_: like(state.opt_state[name][key_], value)}})
        else:
            raise KeyError(f"{key!r} is not a state tensor of this engine")  # _select picks live keys only
    engine.state = state
    jax.block_until_ready((state.params, state.constants, state.masters, state.opt_state, state.shared_state,
                           state.loss_scale))


def loaded(engine) -> None:
    """A checkpoint load has written the state: drop the gradients accumulated before it (they
    go with the weights they were computed at); a forward before it has no backward (its
    gradient would be another weights'); the next forward is the loaded micro-step's first. The
    host module is brought up to date when it is next read."""
    engine.gradients.new_window()
    engine.forwards.restart_draws()  # the loaded micro-step's forwards draw from its first again
    engine.params_version += 1
    engine.updates.last_skip = None
    if engine.torch_optimizer:
        take_host_optimizer_state(engine)


def save_checkpoint(engine, save_dir, tag, client_state, save_latest, exclude_frozen_parameters) -> bool:
    """DeepSpeed's ``save_checkpoint``, in the torch_xla backend's format (docs/checkpoints.md)."""
    from spmdzero.io.save import save_checkpoint as save

    engine.host.take_changes()  # what the script changed on the module since the last forward is saved
    if not engine.torch_optimizer:
        return save(engine, save_dir, tag, client_state, save_latest, exclude_frozen_parameters)
    host_optimizer_state(engine)
    try:
        return save(engine, save_dir, tag, client_state, save_latest, exclude_frozen_parameters)
    finally:
        engine.basic_optimizer.state.clear()


def load_checkpoint(engine, *args):
    """DeepSpeed's ``load_checkpoint``: returns ``(load_path, client_state)``; loads either
    backend's checkpoints and DeepSpeed ZeRO-1/2 ones, on any device count."""
    from spmdzero.io.restore import load_checkpoint as load

    engine.host.take_changes()  # the load then writes over the host's changes, not the reverse
    return load(engine, *args)
