"""Shape-only engines: the real engine, built and traced with no parameter in memory.

The torchax backend's (``shape_only_torchax_engine``) is JAX's own: the engine is built on an
abstract mesh of the topology's size and every array of its state is a
``jax.ShapeDtypeStruct`` carrying the plan's ``NamedSharding``; its step is traced by
``jax.jit(...).trace`` and never run. The rest of this docstring is the torch_xla backend's.

The model comes with its parameters on ``meta``. Each gets an XLA placeholder (a tensor
with a shape, a dtype and no buffer), the engine is built around them with
``shape_only=True``, so it never syncs (its grad buffers, masters and optimizer states stay
unexecuted graph nodes), and then
every state tensor is swapped for a placeholder carrying the plan's sharding. Tracing a
step on this engine runs the engine's own forward, backward, clipping, optimizer and
re-annotation code; nothing is ever executed, so host memory holds graph nodes only.

The sharding of a placeholder can only be attached as a ``Sharding`` custom call on its
value (``_xla_annotate_custom_sharding``); ``spmdzero.tpu.compile.prepare_module`` moves
it onto the exported function's argument.
"""

from __future__ import annotations

import torch
from spmdzero import runtime
from spmdzero.config.errors import ConfigError
from spmdzero.config.load import load_config
from spmdzero.initialize import with_backend
from spmdzero.train.build import config_dict
from spmdzero.train.engine_protocol import Engine


def placeholder(shape, dtype: torch.dtype) -> torch.Tensor:
    import torch_xla.core.xla_builder as xb

    return xb.create_placeholder_tensor(tuple(shape), dtype)


def _replicated(t: torch.Tensor, mesh) -> None:
    import torch_xla

    torch_xla._XLAC._xla_annotate_custom_sharding(t, mesh.get_op_sharding((None,) * t.dim()))


def shape_only_engine(model: torch.nn.Module, config: dict) -> tuple[Engine, dict]:
    """``spmdzero.initialize(model, config)`` for a model whose parameters are on ``meta``.
    Returns ``(engine, inputs)``: ``inputs`` maps each state key (``state_tensors()`` keys
    and ``grad.<name>``) to the placeholder that is its value before the step. torch_xla (an
    optional install) is imported here, its runtime started if JAX has this process's
    devices and it can start beside them (CPU)."""
    cfg = with_backend(load_config(None, config, None))
    if cfg.spmd.backend != "torch_xla":
        raise ConfigError(f"spmd.backend={cfg.spmd.backend!r}: this builds a torch_xla engine; a torchax engine's "
                          "shape-only build is shape_only_torchax_engine (spmdzero.aot.capture_step picks by backend)")
    runtime.start_torch_xla("spmdzero aot's torch_xla step")  # before any placeholder
    from spmdzero.backends.torch_xla import build as torch_xla_build
    from spmdzero.backends.torch_xla.mesh import build_mesh

    mesh = build_mesh(None, runtime.device_count())  # any mesh over all devices: for replicated only
    swapped: dict[int, torch.nn.Parameter] = {}  # tied parameters stay tied
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None:
                continue
            if id(p) not in swapped:
                value = placeholder(p.shape, p.dtype).clone()  # a clone: annotating it leaves the placeholder alone
                _replicated(value, mesh)  # not device data any more: mark_sharding will not try to read it
                swapped[id(p)] = torch.nn.Parameter(value, requires_grad=p.requires_grad)
            module._parameters[name] = swapped[id(p)]
    engine, *_ = torch_xla_build.build(model, cfg, config_dict=config_dict(cfg, None, config, None), shape_only=True)
    inputs = {}
    tensors = {k: (t, spec) for k, (t, spec) in engine.state_tensors().items()}
    tensors.update({f"grad.{k}": (b, engine.plan[k].grad) for k, b in engine.grad_buffers().items()})
    import torch_xla

    for key, (t, spec) in tensors.items():
        inputs[key] = placeholder(t.shape, t.dtype)
        torch_xla._XLAC._replace_xla_tensor(t, inputs[key].clone())  # `t.data =` would break later views of t
        torch_xla._XLAC._xla_annotate_custom_sharding(t, engine.mesh.get_op_sharding(tuple(spec)))
    return engine, inputs


def shape_only_torchax_engine(model: torch.nn.Module, config: dict, devices: int) -> Engine:
    """The torchax backend's engine for ``config`` on ``devices`` chips (a topology this machine
    need not have), shape-only: nothing is placed on a device and the model's parameters may
    be on ``meta``. Its step is traced by ``TorchaxEngine.trace_step``. A torch optimizer gets
    the states its first step creates, as a later step has them."""
    from spmdzero.backends.torchax import build as torchax_build

    cfg = load_config(None, config, None)
    engine, *_ = torchax_build.build(model, cfg, config_dict=config_dict(cfg, None, config, None),
                                     shape_only_devices=devices)
    engine.placeholder_optimizer_state()
    return engine
