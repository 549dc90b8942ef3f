"""A torch.optim optimizer on the torchax backend (a client's ``initialize(optimizer=...)``,
or ``optimizer.type`` naming a torch.optim class): its own ``step()`` traced into the update
program.

Why trace torch's own step rather than map each class to a formula: any optimizer a script
brings (RMSprop, NAdam, a third-party one written in torch ops) then runs with its exact math,
as on the torch_xla backend, where its ops are traced lazily. Under ``jax.jit`` the parameters,
gradients and states are torchax tensors for the length of the call; ``capturable`` is set
where the optimizer has it, so that its step counter stays a tensor (a traced value) instead of
a Python number read from the device.

The learning rate is a traced input (a schedule changing it every step is not a new program),
in one of three ways (``LR_MODES``): for torch's optimizers whose update is linear in the lr
and whose states do not depend on it (SGD, Adam, AdamW, RMSprop, ... : ``LINEAR_IN_LR``), the
step runs at lr 1 and its change of the parameters is scaled by the lr; else it is given to
the step as a tensor, where the step takes one; else the lr is a constant of the program, built
again for each new lr. Adam and AdamW take a tensor lr too, but their capturable step divides
by it: at a warmup's lr 0 that is 0/0 wherever a state is zero (an embedding row no batch has
touched), and the parameter becomes NaN. The group's other hyperparameters are constants of the program, and a change of
one (a schedule cycling momentum) builds it again (``static_hyperparameters``).

States are created by the optimizer's first step, as torch creates them: the update program is
traced once without them and once with them."""

from __future__ import annotations

import collections
import contextlib
from typing import Any

import numpy as np
import torch

from spmdzero.backends.torchax.optim import adafactor
from spmdzero.backends.torchax.lowering.out_arguments import OutArgumentsCopied
from spmdzero.backends.torchax.optim.tensor_scalars import TensorScalarsComputed


class UntraceableStep(RuntimeError):
    """A torch optimizer whose ``step()`` cannot be traced into the update program."""

    def __init__(self, optimizer: torch.optim.Optimizer, err: Exception):
        import jax

        name = type(optimizer).__name__
        why = ("its step reads a tensor's value on the host (.item()), which a compiled program cannot stop for"
               if isinstance(err, jax.errors.ConcretizationTypeError) else
               f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
        super().__init__(f"spmd.backend='torchax' runs {name}.step() inside the compiled update, and it cannot be "
                         f"traced there: {why}. Give the optimizer in the config instead (\"optimizer\": {{\"type\": "
                         f"...}}: spmdzero's Adam, AdamW, SGD, Adagrad, Lamb or Lion run on this backend), or use "
                         "spmd.backend='torch_xla', which runs any torch.optim optimizer")


# "traced": the lr a tensor in the step; "unit": the step at lr 1, its change times the lr;
# "constant": the lr a Python number, a constant of the program
LR_MODES = ("traced", "unit", "constant")
# torch.optim classes whose parameter change is the lr times a term that does not depend on it,
# and whose states do not depend on it (not Rprop, ASGD, Adafactor, LBFGS, SparseAdam)
LINEAR_IN_LR = frozenset({"SGD", "RMSprop", "Adagrad", "Adadelta", "Adamax", "NAdam", "RAdam", "Adam", "AdamW"})


def initial_lr_mode(optimizer: torch.optim.Optimizer) -> str:
    """How the first update gives the lr to the step ("traced" falls back by ``fallback_lr_mode``
    if the step needs a Python number)."""
    return "unit" if fallback_lr_mode(optimizer) == "unit" else "traced"


def fallback_lr_mode(optimizer: torch.optim.Optimizer) -> str:
    """How to give the lr to an optimizer whose step needs it as a Python number."""
    cls = type(optimizer)
    return "unit" if cls.__module__.startswith("torch.optim") and cls.__name__ in LINEAR_IN_LR else "constant"


# States torch keeps on the host unless ``capturable`` (the step count): checkpoints hold them in
# their host state, as the torch_xla backend's do, so that either backend loads the other's.
HOST_KEYS = frozenset({"step"})


def state_shapes(optimizer: torch.optim.Optimizer, groups: list[list[str]], targets: dict, env,
                 lr_mode: str = "traced") -> dict:
    """The states the optimizer's first step creates, by parameter name and key, as
    ``jax.ShapeDtypeStruct`` (nothing runs)."""
    import jax

    def first_step(targets):
        grads = {n: t for n, t in targets.items()}
        lrs = [[float(g["lr"])] for g in optimizer.param_groups] if lr_mode == "constant" else [
            jax.numpy.asarray(lr) for lr in learning_rates(optimizer)]
        return traced_step(optimizer, groups, targets, grads, {n: {} for n in targets}, lrs, None, None, env,
                           lr_mode)[1]

    return jax.eval_shape(first_step, dict(targets))


def learning_rates(optimizer: torch.optim.Optimizer) -> list[np.ndarray]:
    """Each group's lr, the update program's traced hyperparameter."""
    # lr None: an optimizer that sizes its own steps (Adafactor's relative_step) and reads none
    return [np.array([float(group["lr"] if group["lr"] is not None else 0.0)], dtype=np.float32)
            for group in optimizer.param_groups]


def static_hyperparameters(optimizer: torch.optim.Optimizer, with_lr: bool = False) -> tuple:
    """Every group's hyperparameters but the lr (``with_lr``: and the lr), as a hashable value:
    the update program is built for these."""
    def plain(value):
        return float(value) if isinstance(value, torch.Tensor) else value

    left_out = ("params",) if with_lr else ("params", "lr")
    return tuple(tuple(sorted((k, repr(plain(v))) for k, v in group.items() if k not in left_out))
                 for group in optimizer.param_groups)


def constructor_state(host_state: dict | None) -> dict:
    """The states an optimizer made in its constructor (torch's Adagrad makes ``sum`` and ``step``
    there, and its step reads them without creating them), as JAX values for its first traced
    step; empty where it made none. A host-kept step count alone (``HOST_KEYS``, which a
    checkpoint load leaves in ``optimizer.state``) is not such a state: torch's other optimizers
    create all their states at once, when they find none."""
    import jax.numpy as jnp

    if not host_state or set(host_state) <= HOST_KEYS:
        return {}
    return {k: jnp.asarray(host_array(v)) for k, v in host_state.items() if isinstance(v, torch.Tensor)}


def host_array(value) -> np.ndarray:
    """A state kept on the host as NumPy takes it (bf16, which NumPy lacks, as fp32; the live
    dtype is restored where it is placed)."""
    tensor = torch.as_tensor(value).detach().cpu()
    return np.asarray(tensor.float() if tensor.dtype == torch.bfloat16 else tensor)


@contextlib.contextmanager
def tracing_as_torch_compile():
    """torch's optimizers read their step count with ``.item()`` unless torch is compiling
    (``torch.optim.optimizer._get_value``; Adagrad, and NAdam, RAdam, Adamax and ASGD when not
    ``capturable``): a host read, which a traced step cannot make. Tracing the step under
    ``jax.jit`` is compiling too, so for its length torch is told so, and the count stays a
    tensor, as under ``torch.compile``."""
    compiling = torch.compiler.is_compiling
    torch.compiler.is_compiling = lambda: True
    try:
        yield
    finally:
        torch.compiler.is_compiling = compiling


def traced_step(optimizer: torch.optim.Optimizer, groups: list[list[str]], targets: dict, grads: dict, states: dict,
                lrs: list, multiplier: Any, skip: Any, env, lr_mode: str = "traced") -> tuple[dict, dict]:
    """``optimizer.step()`` on JAX values inside a trace: ``targets`` (the parameters, or the fp32
    masters), ``grads`` (cast to each target's dtype, times ``multiplier`` when given), the
    states by parameter name (empty before the first step) and each group's ``lr``. Returns the
    new targets and states, the old ones kept where ``skip``. The optimizer's own parameters,
    state and hyperparameters are put back afterwards. ``lr_mode``: how the lr reaches the step
    (``LR_MODES``; under "constant", ``lrs`` holds the groups' numbers)."""
    import jax.numpy as jnp
    from torchax import tensor as ttensor

    saved_groups = [dict(group) for group in optimizer.param_groups]
    saved_state = optimizer.state
    wrapped: dict[str, Any] = {}
    try:
        optimizer.state = collections.defaultdict(dict)
        for group, names, lr in zip(optimizer.param_groups, groups, lrs):
            params = []
            for name, host in zip(names, group["params"]):
                target = targets[name]
                grad = grads[name].astype(target.dtype)
                p = ttensor.Tensor(target, env)
                p.grad = ttensor.Tensor(grad if multiplier is None else grad * multiplier, env)
                state = states[name] or constructor_state(saved_state.get(host))
                if state:
                    optimizer.state[p] = {k: ttensor.Tensor(v, env) for k, v in state.items()}
                params.append(p)
                wrapped[name] = p
            group["params"] = params
            group["lr"] = {"traced": lambda: ttensor.Tensor(lr[0], env), "unit": lambda: 1.0,
                           "constant": lambda: float(lr[0])}[lr_mode]()
            if "capturable" in group:
                group["capturable"] = True  # its step counter stays a traced tensor
            for flag in ("foreach", "fused"):  # torch's per-tensor code: the same math, traced
                if flag in group:
                    group[flag] = False
        with env, OutArgumentsCopied(), TensorScalarsComputed(), torch.no_grad(), tracing_as_torch_compile():
            try:
                if adafactor.replaces(optimizer):  # its step reads its count on the host: a traced twin
                    adafactor.step(optimizer)
                else:
                    optimizer.step()
            except Exception as err:
                import jax

                if lr_mode == "traced" and isinstance(err, jax.errors.ConcretizationTypeError):
                    raise  # the engine tries the lr another way (LR_MODES)
                raise UntraceableStep(optimizer, err) from None
        new_targets = {name: p._elem for name, p in wrapped.items()}
        if lr_mode == "unit":  # the change at lr 1, times each group's lr
            scaled = {name: lr[0] for names, lr in zip(groups, lrs) for name in names}
            new_targets = {n: targets[n] + (scaled[n] * (t - targets[n])).astype(t.dtype) for n, t in new_targets.items()}
        new_states = {name: {k: v._elem for k, v in optimizer.state[p].items() if isinstance(v, ttensor.Tensor)}
                      for name, p in wrapped.items()}
    finally:
        optimizer.state = saved_state
        for group, saved in zip(optimizer.param_groups, saved_groups):
            group.clear()
            group.update(saved)
    if skip is not None:
        new_targets = {n: jnp.where(skip, targets[n], t) for n, t in new_targets.items()}
        # a skipped first step leaves fresh state (zeros), as a step that never ran
        new_states = {n: {k: jnp.where(skip, states[n][k] if k in states[n] else jnp.zeros_like(v), v)
                          for k, v in st.items()} for n, st in new_states.items()}
    return new_targets, new_states
