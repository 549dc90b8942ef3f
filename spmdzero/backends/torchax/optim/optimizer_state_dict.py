"""``optimizer.state_dict()`` and ``optimizer.load_state_dict()`` on the torchax backend: torch's
format, read from and written to the devices.

Scripts written as plain PyTorch loops save the optimizer beside the model:
DeepSpeedExamples' ImageNet example (``training/imagenet/main.py``, after PyTorch's own) writes
``{"state_dict": model.state_dict(), "optimizer": optimizer.state_dict(), ...}`` after every
epoch, with ``optimizer`` the one ``deepspeed.initialize`` returned, and loads it back with
``--resume``. DeepSpeed answers both at every stage (its ZeRO optimizers in a format of their
own). This backend keeps the states on the devices, as JAX arrays laid out by the plan, and the
base optimizer's ``state`` holds none of them: its own ``state_dict()`` saved nothing and its
``load_state_dict()`` loaded nothing, silently, so both used to be refused.

Now ``state_dict()`` is torch's ``Optimizer.state_dict()`` of the base optimizer with each
parameter's states read whole from the devices (a device-to-host copy): the same keys
(``exp_avg``, ``momentum_buffer``, ``step`` ...), indexed by parameter as torch indexes them, so
torch's optimizer of the same class loads it too. Under mixed precision each parameter's fp32
master weight is saved with its states (``MASTER``), as DeepSpeed's ZeRO optimizers save their
fp32 partitions. ``load_state_dict()`` checks the groups as torch does, takes the saved
hyperparameters into the param groups, and writes the states onto the devices in the live
layout (a torch optimizer before its first step gets them created first); loaded masters become
the parameters too, as DeepSpeed's ``load_from_fp32_weights`` does. Nothing is traced again.

The same example resumes before ``initialize``, with torch's own ``load_state_dict`` on the SGD
it then passes in: ``take_given_state`` moves such states to the devices at ``initialize``.
"""

from __future__ import annotations

import warnings

import torch

from spmdzero.backends.torchax.optim import torch_optim

MASTER = "fp32_master_weight"  # a parameter's fp32 master weight among its saved states


def state_dict(engine) -> dict:
    """The base optimizer's ``state_dict()``, its states those the devices hold."""
    from torchax.ops import mappings

    optimizer = engine.basic_optimizer
    names = engine.optimized_names()
    states = engine.optimizer_states()
    held = {p: optimizer.state[p] for p in names if p in optimizer.state}
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.filterwarnings("ignore", "The given NumPy array is not writable")  # copied
            for target, name in names.items():
                saved = {key: mappings.j2t(value, use_dlpack=False).clone() for key, value in states[name].items()}
                if name in engine.state.masters:
                    saved[MASTER] = mappings.j2t(engine.state.masters[name], use_dlpack=False).clone()
                if saved:
                    optimizer.state[target] = saved
            return type(optimizer).state_dict(optimizer)
    finally:
        for target in names:
            optimizer.state.pop(target, None)
        optimizer.state.update(held)


def load_state_dict(engine, saved: dict) -> None:
    """Torch's ``Optimizer.load_state_dict()`` of ``saved`` onto the devices (see the module docstring)."""
    optimizer = engine.basic_optimizer
    if not isinstance(saved, dict) or not {"state", "param_groups"} <= saved.keys():
        what = sorted(saved) if isinstance(saved, dict) else type(saved).__name__
        raise ValueError(f"optimizer.load_state_dict() takes what optimizer.state_dict() returned (a dict with 'state' "
                         f"and 'param_groups'), got {what}")
    groups, saved_groups = optimizer.param_groups, saved["param_groups"]
    if len(groups) != len(saved_groups):
        raise ValueError(f"loaded state dict has a different number of parameter groups ({len(saved_groups)}) than "
                         f"the optimizer ({len(groups)})")
    for i, (group, saved_group) in enumerate(zip(groups, saved_groups)):
        if len(group["params"]) != len(saved_group["params"]):
            raise ValueError(f"loaded state dict's parameter group {i} has {len(saved_group['params'])} parameters, "
                             f"the optimizer's has {len(group['params'])}")
    # the script's edits of the module so far (a model.load_state_dict() first, as a resume does)
    # go to the devices now: taken at the next forward, they would overwrite the masters loaded here
    engine.host.take_changes()
    targets = {index: p for group, saved_group in zip(groups, saved_groups)
               for index, p in zip(saved_group["params"], group["params"])}
    names = engine.optimized_names()
    if any(targets.get(index) in names for index in saved["state"]):
        engine.placeholder_optimizer_state()  # a torch optimizer before its first step: states to write into
    values, masters = {}, False
    for index, states in saved["state"].items():
        name = names.get(targets.get(index))
        if name is None:
            continue  # a parameter the engine does not train (frozen): no states on the devices
        live = {**engine.state.opt_state[name], **engine.state.shared_state}
        host = optimizer.state.get(targets[index], {})
        for key, value in states.items():
            array = torch_optim.host_array(value)
            if key == MASTER and name in engine.state.masters:
                values[f"master.{name}"] = values[f"model.{name}"] = array
                masters = True
            elif key in live:
                values[f"optim.{name}.{key}"] = array
            elif key in host and key in torch_optim.HOST_KEYS:
                host[key] = torch.as_tensor(value, dtype=torch.float32).clone()
            else:
                raise ValueError(f"optimizer.load_state_dict(): state {key!r} of parameter {name!r} is not one "
                                 f"{type(optimizer).__name__} keeps here (it keeps {sorted(live) or 'none yet'})")
    for group, saved_group in zip(groups, saved_groups):
        group.update({k: v for k, v in saved_group.items() if k != "params"})
    engine.load_state(values)
    engine.take_host_optimizer_state()
    if masters:  # the parameters changed: what a forward before this took is another weights' gradient
        engine.loaded(new_window=False)


def take_given_state(engine) -> None:
    """A torch optimizer given to ``initialize`` with states already (a script that resumed it
    first: the ImageNet example loads its checkpoint into torch's SGD, then initializes): those
    states go to the devices, where the update reads them, and leave the host. Left in its
    ``state``, the update never read them, and the resumed run restarted its momentum from zero,
    silently; DeepSpeed's engine keeps the optimizer's states."""
    optimizer = engine.basic_optimizer
    if optimizer is None or not engine.torch_optimizer:
        return
    names = engine.optimized_names()
    if not any(optimizer.state.get(p) for p in names):
        return
    given = type(optimizer).state_dict(optimizer)
    # left in place while the load runs: torch's Adagrad makes its states in its constructor and
    # its first step reads them (torch_optim.constructor_state); the load takes them off the host
    taken = {target: optimizer.state[target] for target in names if target in optimizer.state}
    try:
        load_state_dict(engine, given)  # it takes the states off the host (_take_host_optimizer_state)
    except torch_optim.UntraceableStep:
        # a step that cannot be traced: the states stay where they were, and the first step says
        # why it cannot run
        optimizer.state.update(taken)
