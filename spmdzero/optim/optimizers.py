"""Optimizers from the config's ``optimizer`` section, written for one traced SPMD step.

They are ``torch.optim.Optimizer`` subclasses with torch's (and DeepSpeed's) math, with
two differences that matter under XLA:

* every per-step number (lr, betas, the step count and bias corrections) is a device
  tensor. A Python float would become a graph constant or a cached scalar, and torch_xla
  deduplicates equal scalars, so a value that happens to equal another one (an lr of
  exactly 0, a bias correction reaching 1.0) changes the graph and recompiles;
* ``init_state()`` creates every state tensor up front, so the engine can shard them
  before the first step instead of leaving their layout to lazy creation. Their first step
  is written against that state (SGD seeds its momentum buffer through a ``where`` on the
  step count), so it is torch's first step.

A client optimizer (any torch.optim instance) is used as is, and keeps torch's lazy state:
its first real step creates it, as in plain torch and in DeepSpeed (whose ZeRO optimizer
links the state "after the first step() call"). No state is made up before: torch's first
step is not a step from some initial value (SGD's momentum buffer *is* the first gradient,
weight decay included), so state made by a step on zero gradients trains differently.
``placeholder_state`` gives it state whose values mean nothing, for what overwrites or never
executes them (a checkpoint load, a shape-only engine).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Callable, Iterable

import torch

from spmdzero.config.errors import ConfigError
from spmdzero.config.schema import OptimizerConfig
from spmdzero.config.checks import check_params, check_value
from spmdzero.optim.ops import TORCH_OPS
from spmdzero.optim.update import GradScale, update_group


def _is_device_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type != "cpu"


def _check_hyper(lr=0.0, betas=(0.0, 0.0), eps=1.0, weight_decay=0.0, **ranged) -> None:
    """Range checks shared by the optimizers; the message names the offending key."""
    if not (isinstance(lr, (int, float)) and lr >= 0):
        raise ValueError(f"lr must be a number >= 0, got {lr!r}")
    if not (isinstance(betas, (tuple, list)) and len(betas) == 2 and all(0.0 <= b < 1.0 for b in betas)):
        raise ValueError(f"betas must be two numbers in [0, 1), got {betas!r}")
    if not eps > 0:
        raise ValueError(f"eps must be > 0, got {eps!r}")
    if not weight_decay >= 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay!r}")
    for key, (value, low, high) in ranged.items():
        if not low <= value <= high:
            raise ValueError(f"{key} must be in [{low}, {high}], got {value!r}")


class SpmdOptimizer(torch.optim.Optimizer):
    """Shared machinery: hyperparameters as one device tensor per group, eager state, and
    the update written once as a pure function (``_math``) of one tensor's parameter,
    gradient, state and hyperparameters, on an array namespace (``ops``).

    On XLA devices a group's whole update is that function run under JAX for every tensor of
    the group and embedded into the lazy graph as one op (``fused.py``): the host traces it
    once per group shape signature, not once per tensor and op. Elsewhere (CPU tensors in
    unit tests, non-fp32 targets) it runs per tensor with torch ops."""

    def _hyper_values(self, group: dict) -> dict[str, float]:
        raise NotImplementedError

    def _initial_state(self, p: torch.Tensor, group: dict) -> dict[str, torch.Tensor]:
        raise NotImplementedError

    def _math(self, p, grad, state: dict, hp: dict, group: dict, ops) -> tuple[Any, dict]:
        """The new parameter and state. Pure: ``group`` is read only for flags that change
        the formula (bools), never for numbers, which come from ``hp`` (device scalars)."""
        raise NotImplementedError

    def init_state(self) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if not self.state[p]:
                    self.state[p] = self._initial_state(p, group)

    def _device_hyper(self, group: dict, device) -> dict[str, torch.Tensor]:
        """Host numbers travel in one fresh host->device transfer per group (no graph
        constants, no shared scalars); values already on the device (an lr computed in
        the graph by a schedule) are used as they are."""
        values = self._hyper_values(group)
        on_host = {k: float(v) for k, v in values.items() if not _is_device_tensor(v)}
        hyper = {k: v.to(torch.float32) for k, v in values.items() if _is_device_tensor(v)}
        if on_host:
            packed = torch.tensor(list(on_host.values()), dtype=torch.float32).to(device)
            hyper.update({k: packed[i] for i, k in enumerate(on_host)})
        return hyper

    @torch.no_grad()
    def step(self, closure: Callable | None = None, *, grads: dict | None = None,
             grad_scale: torch.Tensor | None = None, skip: torch.Tensor | None = None, donate: bool = False,
             group_update: Callable | None = None):
        """torch's ``step()``, plus what the engine needs inside the same traced op:
        ``grads`` ({param: gradient}, any float dtype) instead of ``p.grad``, ``grad_scale``
        multiplied into every gradient (unscaling and clipping), ``skip``, a device bool
        that leaves parameters and states as they were (an overflowed step), and ``donate``:
        the next ``torch_xla.sync()`` executes this step and may write the new values into
        the old ones' buffers (see ``fused.swap_in``). ``group_update(optimizer, params, grads,
        hp, group, grad_scale, skip, donate)`` is the backend's whole-group update (torch_xla's
        fused op); it returns None where it does not apply, and the math then runs per tensor."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.laid_out: set[int] = set()  # ids of params whose new values and states carry their shardings
        for group in self.param_groups:
            params = [p for p in group["params"] if (p.grad if grads is None else grads.get(p)) is not None]
            if not params:
                continue
            grad_of = {p: p.grad if grads is None else grads[p] for p in params}
            hp = self._device_hyper(group, params[0].device)
            for p in params:
                if not self.state[p]:
                    self.state[p].update(self._initial_state(p, group))
            laid_out = None if group_update is None else group_update(
                self, params, [grad_of[p] for p in params], hp, group, grad_scale, skip, donate)
            if laid_out is not None:  # done as one op
                if laid_out:
                    self.laid_out.update(map(id, params))
                continue
            states = [self.state[p] for p in params]
            new_params, new_states = update_group(self, params, [grad_of[p] for p in params], states, hp, group,
                                                  GradScale(None, grad_scale, skip), TORCH_OPS)
            for p, state, new_p, new_state in zip(params, states, new_params, new_states):
                p.copy_(new_p)
                for key, value in new_state.items():
                    state[key].copy_(value)
        return loss

    def scaled_math(self, p, grad, state, hp, group, ops, grad_scale=None, skip=None):
        """``_math`` on ``grad`` cast to p's dtype and times ``grad_scale``; the old values where ``skip``."""
        grad = ops.cast(grad, p)
        if grad_scale is not None:
            grad = grad * grad_scale
        new_p, new_state = self._math(p, grad, state, hp, group, ops)
        if skip is not None:
            new_p = ops.where(skip, p, new_p)
            new_state = {k: ops.where(skip, state[k], v) for k, v in new_state.items()}
        return new_p, new_state


def _step_counter(p: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), dtype=torch.float32, device=p.device)


class AdamW(SpmdOptimizer):
    """DeepSpeed's Adam: decoupled weight decay (AdamW) unless ``adam_w_mode=False``,
    in which case weight decay is L2 added to the gradient (classic Adam)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 bias_correction=True, adam_w_mode=True, amsgrad=False, set_grad_none=True):
        # set_grad_none: FusedAdam's zero_grad option; the engine owns the gradients here
        if amsgrad:
            raise ValueError("amsgrad is not supported (DeepSpeed's FusedAdam refuses it too)")
        _check_hyper(lr, betas, eps, weight_decay)
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                                      bias_correction=bias_correction, adam_w_mode=adam_w_mode))

    def _hyper_values(self, group):
        b1, b2 = group["betas"]
        return dict(lr=group["lr"], beta1=b1, beta2=b2, one_minus_beta1=1.0 - b1, one_minus_beta2=1.0 - b2,
                    eps=group["eps"], weight_decay=group["weight_decay"], lr_decay=group["lr"] * group["weight_decay"])

    def _initial_state(self, p, group):
        return dict(step=_step_counter(p), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))

    def _math(self, p, grad, state, hp, group, ops):
        # The whole update, weight decay included, is one expression subtracted from p, all on
        # the optimizer state's shards: the fused op lays the new p out like the states before
        # its own layout all-gathers it (fused._shard_layouts), so the full replicated p is
        # neither decayed nor subtracted from.
        step = state["step"] + 1
        b1, b2 = hp["beta1"], hp["beta2"]
        if not group["adam_w_mode"]:
            grad = grad + hp["weight_decay"] * p
        exp_avg = state["exp_avg"] * b1 + grad * hp["one_minus_beta1"]
        exp_avg_sq = state["exp_avg_sq"] * b2 + grad * grad * hp["one_minus_beta2"]
        if group["bias_correction"]:
            step_size = hp["lr"] / (1 - b1 ** step)
            denom = ops.sqrt(exp_avg_sq) / ops.sqrt(1 - b2 ** step) + hp["eps"]
        else:
            step_size, denom = hp["lr"], ops.sqrt(exp_avg_sq) + hp["eps"]
        update = step_size * exp_avg / denom
        if group["adam_w_mode"]:
            update = update + hp["lr_decay"] * p
        return p - update, dict(step=step, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq)


class SGD(SpmdOptimizer):
    """torch.optim.SGD's math. The first step seeds the momentum buffer with the gradient
    (torch's rule) through a ``where`` on the step count, not a Python branch."""

    def __init__(self, params, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, *,
                 maximize=False, foreach=None, differentiable=False, fused=None):
        # foreach, differentiable, fused: torch's choice of implementation (DeepSpeed passes them to
        # torch.optim.SGD); the same math here, one traced op
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires a momentum and zero dampening")
        _check_hyper(lr, weight_decay=weight_decay, momentum=(momentum, 0.0, 1.0), dampening=(dampening, 0.0, 1.0))
        super().__init__(params, dict(lr=lr, momentum=momentum, dampening=dampening,
                                      weight_decay=weight_decay, nesterov=nesterov, maximize=maximize))

    def _hyper_values(self, group):
        return dict(lr=group["lr"], momentum=group["momentum"], dampening=group["dampening"],
                    weight_decay=group["weight_decay"])

    def _initial_state(self, p, group):
        if group["momentum"] == 0:
            return {}
        return dict(step=_step_counter(p), momentum_buffer=torch.zeros_like(p))

    def _math(self, p, grad, state, hp, group, ops):
        if group["maximize"]:  # torch's: ascend the objective
            grad = -grad
        grad = grad + hp["weight_decay"] * p
        new_state = {}
        if "momentum_buffer" in state:  # momentum != 0
            blended = hp["momentum"] * state["momentum_buffer"] + (1 - hp["dampening"]) * grad
            buf = ops.where(state["step"] == 0, grad, blended)
            new_state = dict(step=state["step"] + 1, momentum_buffer=buf)
            grad = grad + hp["momentum"] * buf if group["nesterov"] else buf
        return p - hp["lr"] * grad, new_state


class Adagrad(SpmdOptimizer):
    """torch.optim.Adagrad's math (dense gradients)."""

    def __init__(self, params, lr=1e-2, lr_decay=0.0, weight_decay=0.0, initial_accumulator_value=0.0, eps=1e-10,
                 foreach=None, *, maximize=False, differentiable=False, fused=None):
        # foreach, differentiable, fused: as SGD's (DeepSpeed passes them to torch.optim.Adagrad)
        _check_hyper(lr, eps=eps, weight_decay=weight_decay)
        super().__init__(params, dict(lr=lr, lr_decay=lr_decay, weight_decay=weight_decay,
                                      initial_accumulator_value=initial_accumulator_value, eps=eps,
                                      maximize=maximize))

    def _hyper_values(self, group):
        return dict(lr=group["lr"], lr_decay=group["lr_decay"], weight_decay=group["weight_decay"], eps=group["eps"])

    def _initial_state(self, p, group):
        return dict(step=_step_counter(p),
                    sum=torch.full_like(p, group["initial_accumulator_value"]))

    def _math(self, p, grad, state, hp, group, ops):
        step = state["step"] + 1
        if group["maximize"]:
            grad = -grad
        grad = grad + hp["weight_decay"] * p
        clr = hp["lr"] / (1 + (step - 1) * hp["lr_decay"])
        total = state["sum"] + grad * grad
        return p - clr * grad / (ops.sqrt(total) + hp["eps"]), dict(step=step, sum=total)


class Lamb(SpmdOptimizer):
    """DeepSpeed's FusedLamb: Adam moments without bias correction inside the update,
    a per-tensor trust ratio ||p|| / ||update|| clamped to [min_coeff, max_coeff] (1 when
    either norm is 0), and the bias corrections folded into the step size."""

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8,
                 eps_inside_sqrt=False, weight_decay=0.0, max_coeff=10.0, min_coeff=0.01, amsgrad=False):
        if amsgrad:
            raise ValueError("amsgrad is not supported by Lamb (nor by DeepSpeed's FusedLamb)")
        _check_hyper(lr, betas, eps, weight_decay)
        if not 0 <= min_coeff <= max_coeff:
            raise ValueError(f"min_coeff/max_coeff must satisfy 0 <= min_coeff <= max_coeff, got {min_coeff}/{max_coeff}")
        super().__init__(params, dict(lr=lr, bias_correction=bias_correction, betas=tuple(betas), eps=eps,
                                      eps_inside_sqrt=eps_inside_sqrt, weight_decay=weight_decay,
                                      max_coeff=max_coeff, min_coeff=min_coeff))

    def _hyper_values(self, group):
        b1, b2 = group["betas"]
        return dict(lr=group["lr"], beta1=b1, beta2=b2, one_minus_beta1=1.0 - b1, one_minus_beta2=1.0 - b2,
                    eps=group["eps"], weight_decay=group["weight_decay"], max_coeff=group["max_coeff"],
                    min_coeff=group["min_coeff"])

    def _initial_state(self, p, group):
        return dict(step=_step_counter(p), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))

    def _math(self, p, grad, state, hp, group, ops):
        step = state["step"] + 1
        m = state["exp_avg"] * hp["beta1"] + grad * hp["one_minus_beta1"]
        v = state["exp_avg_sq"] * hp["beta2"] + grad * grad * hp["one_minus_beta2"]
        denom = ops.sqrt(v + hp["eps"]) if group["eps_inside_sqrt"] else ops.sqrt(v) + hp["eps"]
        update = m / denom + hp["weight_decay"] * p
        w_norm, u_norm = ops.norm(p), ops.norm(update)
        ratio = ops.clamp(w_norm / u_norm, hp["min_coeff"], hp["max_coeff"])
        coeff = ops.where((w_norm > 0) & (u_norm > 0), ratio, ops.ones_like(ratio))
        step_size = hp["lr"]
        if group["bias_correction"]:
            step_size = step_size * ops.sqrt(1 - hp["beta2"] ** step) / (1 - hp["beta1"] ** step)
        return p - step_size * coeff * update, dict(step=step, exp_avg=m, exp_avg_sq=v)


class Lion(SpmdOptimizer):
    """DeepSpeed's FusedLion: p <- p * (1 - lr * wd) - lr * sign(b1 * m + (1 - b1) * g),
    then m <- b2 * m + (1 - b2) * g."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0, set_grad_none=True):
        _check_hyper(lr, betas, weight_decay=weight_decay)  # set_grad_none: as AdamW's
        super().__init__(params, dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay))

    def _hyper_values(self, group):
        b1, b2 = group["betas"]
        return dict(lr=group["lr"], beta1=b1, beta2=b2, one_minus_beta1=1.0 - b1, one_minus_beta2=1.0 - b2,
                    decay_factor=1.0 - group["lr"] * group["weight_decay"])

    def _initial_state(self, p, group):
        return dict(exp_avg=torch.zeros_like(p))

    def _math(self, p, grad, state, hp, group, ops):
        m = state["exp_avg"]
        direction = ops.sign(m * hp["beta1"] + grad * hp["one_minus_beta1"])
        return p * hp["decay_factor"] - hp["lr"] * direction, dict(exp_avg=m * hp["beta2"] + grad * hp["one_minus_beta2"])


# DeepSpeed lowercases these names; any other type must be an exact torch.optim class name.
_DEEPSPEED_NAMES = {"adam", "adamw", "adagrad", "lamb", "lion", "onebitadam", "zerooneadam", "onebitlamb",
                    "muadam", "muadamw", "musgd", "muon"}
_COMPRESSED_COMMUNICATION = {"onebitadam", "zerooneadam", "onebitlamb"}
_SPMD_BY_DEEPSPEED_NAME = {"adagrad": Adagrad, "lamb": Lamb, "lion": Lion}
_SPMD_CLASSES = {"SGD": SGD}


def build_optimizer(opt_cfg: OptimizerConfig, params: Iterable) -> torch.optim.Optimizer:
    """The optimizer named by the config's ``optimizer`` section, with DeepSpeed's meaning."""
    kwargs = dict(opt_cfg.params)
    if "max_grad_norm" in kwargs:
        raise ConfigError("optimizer.params.max_grad_norm is not supported as an optimizer parameter; "
                          "use the top-level 'gradient_clipping' key")
    name = opt_cfg.type.lower() if opt_cfg.type.lower() in _DEEPSPEED_NAMES else opt_cfg.type
    if name in ("adam", "adamw"):
        for flag in ("adam_w_mode", "torch_adam"):  # taken out before the constructor's checks
            check_value(flag, kwargs.get(flag, False), False, f"optimizer.params for {opt_cfg.type!r}")
        # DeepSpeed takes it out too; it picks the precision of CPU-offloaded Adam moments only
        # (states are fp32 here: there is no offload)
        if kwargs.get("fp32_optimizer_states") is not None:
            check_value("fp32_optimizer_states", kwargs["fp32_optimizer_states"], False,
                        f"optimizer.params for {opt_cfg.type!r}")
        kwargs.pop("fp32_optimizer_states", None)
        adam_w_mode = kwargs.pop("adam_w_mode", True) or name == "adamw"
        if kwargs.pop("torch_adam", False):
            cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
            return _construct(cls, params, kwargs, opt_cfg.type)
        return _construct(AdamW, params, dict(kwargs, adam_w_mode=adam_w_mode), opt_cfg.type)
    if name in _SPMD_BY_DEEPSPEED_NAME:
        return _construct(_SPMD_BY_DEEPSPEED_NAME[name], params, kwargs, opt_cfg.type)
    if name in _COMPRESSED_COMMUNICATION:
        raise ConfigError(
            f"optimizer.type {opt_cfg.type!r} compresses DeepSpeed's hand-made gradient all-reduce (1-bit/0-1 "
            "communication). Under GSPMD the compiler emits the collectives, so there is no all-reduce for it to "
            "compress; use 'Adam' or 'Lamb' instead")
    if name in _DEEPSPEED_NAMES:
        raise ConfigError(f"optimizer.type {opt_cfg.type!r} is not supported by spmdzero")
    if name in _SPMD_CLASSES:
        return _construct(_SPMD_CLASSES[name], params, kwargs, opt_cfg.type)
    cls = getattr(torch.optim, name, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        import difflib

        shown = {"adam": "Adam", "adamw": "AdamW", "adagrad": "AdaGrad", "lamb": "Lamb", "lion": "Lion"}
        known = {n.lower(): shown.get(n, n) for n in sorted({n for n in dir(torch.optim) if n[0].isupper()}
                                                              | set(shown))}
        close = difflib.get_close_matches(opt_cfg.type.lower(), list(known), n=1)
        hint = f" (did you mean {known[close[0]]!r}?)" if close else ""
        raise ConfigError(f"optimizer.type {opt_cfg.type!r} is neither a DeepSpeed optimizer nor a "
                          f"torch.optim class{hint}")
    import inspect

    closure = inspect.signature(cls.step).parameters.get("closure")
    if closure is not None and closure.default is inspect.Parameter.empty:
        raise ConfigError(f"optimizer.type {opt_cfg.type!r} needs a closure that re-evaluates the loss in every "
                          "step(); engine.step() takes none (as in DeepSpeed)")
    return _construct(cls, params, kwargs, opt_cfg.type)


def _construct(cls, params, kwargs: dict, type_name: str):
    check_params(cls, kwargs, f"optimizer.params for {type_name!r}", skip=("params",))
    try:
        return cls(params, **kwargs)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"optimizer.params for {type_name!r}: {err}") from None


def is_lazy(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` creates its state at its first step (any torch.optim optimizer)
    rather than up front (spmdzero's own, ``SpmdOptimizer.init_state``)."""
    return not isinstance(optimizer, SpmdOptimizer)


def init_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the state now where its first step is written against it (spmdzero's
    optimizers). A torch.optim optimizer is left to create its own at its first step: see the
    module docstring for why no state is invented for it."""
    if not is_lazy(optimizer):
        optimizer.init_state()


def placeholder_state(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Give each parameter of a torch.optim optimizer that has no state yet the state its
    first step creates (keys, shapes, dtypes, devices), by a step on zero gradients whose
    effect on the parameters is undone. The values mean nothing: only for what writes every
    one of them (a checkpoint load) or never executes them (a shape-only engine's traced
    step). Returns the parameters given state, for ``drop_state`` to take it back."""
    if not is_lazy(optimizer):
        return []
    params = [p for g in optimizer.param_groups for p in g["params"]]
    pending = [p for p in params if not optimizer.state.get(p)]
    if not pending:
        return []
    saved_params = [p.detach().clone() for p in pending]
    saved_grads = [p.grad for p in params]
    waiting = set(pending)
    for p in params:  # only the pending ones step: the others' state stays as it is
        p.grad = torch.zeros_like(p) if p in waiting else None
    try:
        optimizer.step()
    finally:
        with torch.no_grad():
            for p, saved in zip(pending, saved_params):
                p.copy_(saved)
            for p, grad in zip(params, saved_grads):
                p.grad = grad
    return pending


def drop_state(optimizer: torch.optim.Optimizer, params: Iterable[torch.Tensor]) -> None:
    """Take the state of ``params`` back to none: torch's next step creates it again."""
    for p in params:
        optimizer.state.pop(p, None)


class ZeroOptimizer:
    """``engine.optimizer``, DeepSpeed's ZeRO optimizer face: the base optimizer's
    ``param_groups`` and ``state`` (its params are the fp32 master weights under mixed
    precision), plus the loss-scaling fields integrations read. Those read the device,
    and only when asked."""

    def __init__(self, optimizer: torch.optim.Optimizer, engine):
        self.optimizer = optimizer
        self._engine = engine

    param_groups = property(lambda self: self.optimizer.param_groups)
    state = property(lambda self: self.optimizer.state)
    defaults = property(lambda self: self.optimizer.defaults)

    @property
    def loss_scale(self) -> float:
        return self._engine.current_loss_scale()

    cur_scale = loss_scale

    @property
    def parameter_offload(self) -> SimpleNamespace:
        """DeepSpeed's ZeRO-3 hook holder (stage 3 only), which TRL empties around generation: none here."""
        if self._engine.zero_optimization_stage() != 3:
            raise AttributeError("parameter_offload: DeepSpeed's ZeRO-3 optimizers have it, not stages 0-2")
        return SimpleNamespace(module=self._engine.module, forward_hooks=[], backward_hooks=[],
                               _register_deepspeed_module=lambda module, count=None: None)

    def refresh_fp32_params(self) -> None:
        """DeepSpeed's: after the module's weights were changed by hand, make the fp32 master
        weights (mixed precision) take them, so the next step updates those values."""
        self._engine.refresh_fp32_params()

    @property
    def overflow(self) -> bool:
        return self._engine.overflow()

    def step(self, closure: Callable | None = None) -> None:
        """DeepSpeed's ZeRO optimizer stepped by the caller (``engine.backward(loss);
        engine.optimizer.step()``): the update with the gradients reduced at the accumulation
        boundary, which it consumes; the engine's counters and schedule stay
        (``engine.optimizer_step``). Without this the base optimizer's own ``step()`` ran: it
        reads ``.grad``, which the engine keeps elsewhere, and did nothing."""
        if closure is not None:
            raise TypeError("engine.optimizer.step() takes no closure (DeepSpeed's ZeRO optimizers do not support one)")
        self._engine.optimizer_step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """DeepSpeed's ZeRO ``optimizer.zero_grad()``: what it drops depends on the stage
        (``engine.optimizer_zero_grad``)."""
        self._engine.optimizer_zero_grad()

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.optimizer.load_state_dict(state_dict)

    def __getattr__(self, name: str):
        return getattr(self.optimizer, name)

    def __repr__(self) -> str:
        return f"ZeroOptimizer({self.optimizer!r})"
