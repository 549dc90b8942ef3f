"""Optimizers from the config's ``optimizer`` section, written for one traced SPMD step.

They are ``torch.optim.Optimizer`` subclasses with torch's (and DeepSpeed's) math, with
two differences that matter under XLA:

* every per-step number (lr, betas, the step count and bias corrections) is a device
  tensor. A Python float would become a graph constant or a cached scalar, and torch_xla
  deduplicates equal scalars, so a value that happens to equal another one (an lr of
  exactly 0, a bias correction reaching 1.0) changes the graph and recompiles;
* ``init_state()`` creates every state tensor up front, so the engine can shard them
  before the first step instead of leaving their layout to lazy creation.

A client optimizer (any torch.optim instance) is used as is; ``materialize_state``
creates its state by a priming step whose effects are undone.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from .config import ConfigError, OptimizerConfig, check_params


def _as_host_float(value: Any, key: str) -> float:
    if isinstance(value, torch.Tensor) and value.device.type != "cpu":
        raise TypeError(f"param_group[{key!r}] must be a Python number, not a device tensor "
                        "(reading it would stall the step on a host sync)")
    return float(value)


class SpmdOptimizer(torch.optim.Optimizer):
    """Shared machinery: hyperparameters as one device tensor per group, eager state."""

    def _hyper_values(self, group: dict) -> dict[str, float]:
        raise NotImplementedError

    def _initial_state(self, p: torch.Tensor, group: dict) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def _update(self, p, grad, state, hp: dict[str, torch.Tensor], group: dict) -> None:
        raise NotImplementedError

    def init_state(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if not self.state[p]:
                    self.state[p] = self._initial_state(p, group)

    def _device_hyper(self, group: dict, device) -> dict[str, torch.Tensor]:
        values = {k: _as_host_float(v, k) for k, v in self._hyper_values(group).items()}
        # One fresh host->device transfer per group: no graph constants, no shared scalars.
        packed = torch.tensor(list(values.values()), dtype=torch.float32).to(device)
        return {k: packed[i] for i, k in enumerate(values)}

    @torch.no_grad()
    def step(self, closure: Callable | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            hp = self._device_hyper(group, params[0].device)
            for p in params:
                state = self.state[p]
                if not state:
                    state.update(self._initial_state(p, group))
                self._update(p, p.grad, state, hp, group)
        return loss


def _step_counter(p: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), dtype=torch.float32, device=p.device)


class AdamW(SpmdOptimizer):
    """DeepSpeed's Adam: decoupled weight decay (AdamW) unless ``adam_w_mode=False``,
    in which case weight decay is L2 added to the gradient (classic Adam)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 bias_correction=True, adam_w_mode=True):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      bias_correction=bias_correction, adam_w_mode=adam_w_mode))

    def _hyper_values(self, group):
        b1, b2 = group["betas"]
        return dict(lr=group["lr"], beta1=b1, beta2=b2, one_minus_beta1=1.0 - b1, one_minus_beta2=1.0 - b2,
                    eps=group["eps"], weight_decay=group["weight_decay"],
                    decay_factor=1.0 - group["lr"] * group["weight_decay"])

    def _initial_state(self, p, group):
        return dict(step=_step_counter(p), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))

    def _update(self, p, grad, state, hp, group):
        # Few ops, and none that decompose in Python (lerp_ with a tensor weight does):
        # tracing cost per op dominates small models on XLA.
        step = state["step"].add_(1)
        b1, b2 = hp["beta1"], hp["beta2"]
        if group["adam_w_mode"]:
            p.mul_(hp["decay_factor"])
        else:
            grad = grad + hp["weight_decay"] * p
        state["exp_avg"].mul_(b1).add_(grad * hp["one_minus_beta1"])
        state["exp_avg_sq"].mul_(b2).add_(grad * grad * hp["one_minus_beta2"])
        if group["bias_correction"]:
            step_size = hp["lr"] / (1 - b1 ** step)
            denom = state["exp_avg_sq"].sqrt() / torch.sqrt(1 - b2 ** step) + hp["eps"]
        else:
            step_size, denom = hp["lr"], state["exp_avg_sq"].sqrt() + hp["eps"]
        p.sub_(step_size * state["exp_avg"] / denom)


class SGD(SpmdOptimizer):
    """torch.optim.SGD's math. The first step seeds the momentum buffer with the gradient
    (torch's rule) through a ``where`` on the step count, not a Python branch."""

    def __init__(self, params, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False):
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening,
                                      weight_decay=weight_decay, nesterov=nesterov))

    def _hyper_values(self, group):
        return dict(lr=group["lr"], momentum=group["momentum"], dampening=group["dampening"],
                    weight_decay=group["weight_decay"])

    def _initial_state(self, p, group):
        if group["momentum"] == 0:
            return {}
        return dict(step=_step_counter(p), momentum_buffer=torch.zeros_like(p))

    def _update(self, p, grad, state, hp, group):
        grad = grad + hp["weight_decay"] * p
        if group["momentum"] != 0:
            buf = state["momentum_buffer"]
            blended = hp["momentum"] * buf + (1 - hp["dampening"]) * grad
            buf.copy_(torch.where(state["step"] == 0, grad, blended))
            state["step"].add_(1)
            grad = grad + hp["momentum"] * buf if group["nesterov"] else buf
        p.sub_(hp["lr"] * grad)


class Adagrad(SpmdOptimizer):
    """torch.optim.Adagrad's math (dense gradients)."""

    def __init__(self, params, lr=1e-2, lr_decay=0.0, weight_decay=0.0, initial_accumulator_value=0.0, eps=1e-10):
        super().__init__(params, dict(lr=lr, lr_decay=lr_decay, weight_decay=weight_decay,
                                      initial_accumulator_value=initial_accumulator_value, eps=eps))

    def _hyper_values(self, group):
        return dict(lr=group["lr"], lr_decay=group["lr_decay"], weight_decay=group["weight_decay"], eps=group["eps"])

    def _initial_state(self, p, group):
        return dict(step=_step_counter(p),
                    sum=torch.full_like(p, group["initial_accumulator_value"]))

    def _update(self, p, grad, state, hp, group):
        state["step"].add_(1)
        grad = grad + hp["weight_decay"] * p
        clr = hp["lr"] / (1 + (state["step"] - 1) * hp["lr_decay"])
        state["sum"].add_(grad * grad)
        p.sub_(clr * grad / (state["sum"].sqrt() + hp["eps"]))


# DeepSpeed lowercases these names; any other type must be an exact torch.optim class name.
_DEEPSPEED_NAMES = {"adam", "adamw", "adagrad", "lamb", "lion", "onebitadam", "zerooneadam", "onebitlamb",
                    "muadam", "muadamw", "musgd", "muon"}
_SPMD_CLASSES = {"SGD": SGD}


def build_optimizer(opt_cfg: OptimizerConfig, params: Iterable) -> torch.optim.Optimizer:
    """The optimizer named by the config's ``optimizer`` section, with DeepSpeed's meaning."""
    kwargs = dict(opt_cfg.params)
    if "max_grad_norm" in kwargs:
        raise ConfigError("optimizer.params.max_grad_norm is not supported as an optimizer parameter; "
                          "use the top-level 'gradient_clipping' key")
    name = opt_cfg.type.lower() if opt_cfg.type.lower() in _DEEPSPEED_NAMES else opt_cfg.type
    if name in ("adam", "adamw"):
        adam_w_mode = kwargs.pop("adam_w_mode", True) or name == "adamw"
        if kwargs.pop("torch_adam", False):
            cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
            return _construct(cls, params, kwargs, opt_cfg.type)
        return _construct(AdamW, params, dict(kwargs, adam_w_mode=adam_w_mode), opt_cfg.type)
    if name == "adagrad":
        return _construct(Adagrad, params, kwargs, opt_cfg.type)
    if name in _DEEPSPEED_NAMES:
        raise ConfigError(f"optimizer.type {opt_cfg.type!r} is not supported by spmdzero yet")
    if name in _SPMD_CLASSES:
        return _construct(_SPMD_CLASSES[name], params, kwargs, opt_cfg.type)
    cls = getattr(torch.optim, name, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        import difflib

        known = {n.lower(): n for n in sorted({n for n in dir(torch.optim) if n[0].isupper()} | _DEEPSPEED_NAMES)}
        close = difflib.get_close_matches(opt_cfg.type.lower(), list(known), n=1)
        hint = f" (did you mean {known[close[0]]!r}?)" if close else ""
        raise ConfigError(f"optimizer.type {opt_cfg.type!r} is neither a DeepSpeed optimizer nor a "
                          f"torch.optim class{hint}")
    return _construct(cls, params, kwargs, opt_cfg.type)


def _construct(cls, params, kwargs: dict, type_name: str):
    check_params(cls, kwargs, f"optimizer.params for {type_name!r}", skip=("params",))
    try:
        return cls(params, **kwargs)
    except TypeError as err:
        raise ConfigError(f"optimizer.params for {type_name!r}: {err}") from None


def materialize_state(optimizer: torch.optim.Optimizer) -> None:
    """Create every optimizer state tensor now, before the first real step.

    spmdzero optimizers say what their state is (``init_state``). For any other
    torch.optim optimizer, run one step on zero gradients while recording each state
    entry as it is first assigned, then put back the parameters and those recorded
    initial values: the step's effects are undone and only the state's layout remains.
    """
    if isinstance(optimizer, SpmdOptimizer):
        optimizer.init_state()
        return
    params = [p for g in optimizer.param_groups for p in g["params"]]
    pending = [p for p in params if not optimizer.state.get(p)]
    if not pending:
        return
    saved_params = [p.detach().clone() for p in params]
    saved_grads = [p.grad for p in params]
    recorded: dict[torch.Tensor, _RecordingState] = {}
    for p in pending:
        recorded[p] = optimizer.state[p] = _RecordingState()
        p.grad = torch.zeros_like(p)
    optimizer.step()
    with torch.no_grad():
        for p, saved, grad in zip(params, saved_params, saved_grads):
            p.copy_(saved)
            p.grad = grad
    for p, rec in recorded.items():
        optimizer.state[p] = dict(rec.initial)


class _RecordingState(dict):
    """A per-parameter state dict that remembers the value each key was first given."""

    def __init__(self):
        super().__init__()
        self.initial: dict[str, Any] = {}

    def __setitem__(self, key, value):
        if key not in self.initial:
            self.initial[key] = value.detach().clone() if isinstance(value, torch.Tensor) else value
        super().__setitem__(key, value)

    def update(self, *args, **kwargs):
        for k, v in dict(*args, **kwargs).items():
            self[k] = v


def momentum_of(group: dict):
    """What DeepSpeed's ``get_mom`` reports for a param group: betas, else momentum."""
    if "betas" in group:
        return group["betas"]
    return group.get("momentum")
