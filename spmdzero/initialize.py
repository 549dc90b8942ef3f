"""``spmdzero.initialize``: DeepSpeed's entry point, same arguments and return value."""

from __future__ import annotations

import os
import warnings
from typing import Any, Callable, Mapping, Optional

import torch

from . import jax_runtime, runtime
from .config import ConfigError, load_config, read_config_file, resolve_batch
from .data import ShardedDataLoader, model_pad_id
from .engine import SpmdZeroEngine
from .mesh import build_mesh, check_user_mesh, data_parallel_size, mesh_shape
from .monitor import log_block
from .optim import build_optimizer, materialize_state
from .plan import make_plan
from .scan import apply_scan_layers, lay_out_gradients, restack_groups, restack_optimizer, stacked_layers
from .precision import attach_master_weights, precision_policy
from .schedules import build_scheduler


def initialize(args: Any = None, model: Optional[torch.nn.Module] = None, optimizer: Any = None,
               model_parameters: Any = None, training_data: Any = None, lr_scheduler: Any = None,
               mesh: Any = None, config: Any = None, config_params: Any = None,
               collate_fn: Optional[Callable] = None):
    """Build the engine. Returns ``(engine, optimizer, training_dataloader, lr_scheduler)``.

    ``config`` (or ``config_params``, or ``args.deepspeed_config``) is a dict or a JSON
    path. ``mesh`` is an optional ``torch_xla.distributed.spmd.Mesh`` with an ``fsdp``
    axis; without it the config's ``spmd.mesh`` or a 1-D ``fsdp`` mesh over all devices
    is used. ``training_data`` (a Dataset) gives a loader of device-sharded batches.
    """
    if model is None:
        raise ValueError("spmdzero.initialize: model is required (got model=None)")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"spmdzero.initialize: model must be a torch.nn.Module, got {type(model).__name__}")
    cfg = load_config(args, config, config_params)
    if cfg.spmd.backend == "torchax":  # the same API and plan, the module traced once by JAX
        from . import backend_torchax

        return backend_torchax.initialize(model, cfg, mesh, optimizer, model_parameters, training_data, lr_scheduler,
                                          collate_fn, _config_dict(cfg, args, config, config_params))
    if jax_runtime.selected():
        raise ConfigError(f"spmd.backend={cfg.spmd.backend!r} needs torch_xla's runtime, which was not started: "
                          f"{jax_runtime.VARIABLE}=torchax gave this process's devices to JAX. Set spmd.backend to "
                          f"'torchax', or unset {jax_runtime.VARIABLE} before `import spmdzero` (in a notebook: "
                          "restart the kernel)")
    if cfg.spmd.compile_cache_dir:
        runtime.enable_compile_cache(cfg.spmd.compile_cache_dir)

    if mesh is not None:
        check_user_mesh(mesh)
        if cfg.spmd.mesh is not None or cfg.spmd.dcn_mesh is not None:
            raise ValueError("a mesh was given twice: as initialize(mesh=...) and in the config's 'spmd' section")
    else:
        mesh = build_mesh(cfg.spmd.mesh, runtime.device_count(), cfg.spmd.dcn_mesh)
    shape = mesh_shape(mesh)
    process_index, process_count = runtime.hosts()
    batch = resolve_batch(cfg, data_parallel_size(shape), process_count)
    if process_index == 0:
        log_block(batch.describe())

    module = _move_in_place(model, runtime.device())
    if cfg.spmd.scan_layers:
        if model_parameters is not None and not isinstance(model_parameters, (list, tuple)):
            model_parameters = list(model_parameters)  # a generator over the module, before stacking
        stacked_from = apply_scan_layers(module, cfg.spmd.scan_layers)
        if stacked_from:  # the client's per-layer parameters become the stacked ones
            model_parameters = restack_groups(model_parameters, stacked_from, "model_parameters")
            if isinstance(optimizer, torch.optim.Optimizer):
                restack_optimizer(optimizer, stacked_from)
    trainable = [(n, p.shape) for n, p in module.named_parameters() if p.requires_grad]
    plan = make_plan(trainable, shape, cfg.zero_stage, tied_embeddings=_tied_embeddings(module),
                     stacked=stacked_layers(module))
    if cfg.spmd.scan_layers:
        lay_out_gradients(module, mesh, plan)

    policy = precision_policy(cfg)
    opt = _build_optimizer(optimizer, model_parameters, module, cfg)
    masters = {}
    if opt is not None:
        _drop_frozen(opt)
        _move_state_to(opt, runtime.device())
        if policy.master_weights:
            masters = attach_master_weights(opt, module, policy.param_dtype)
        materialize_state(opt)
    elif policy.master_weights:
        module.to(policy.param_dtype)
    scheduler = _build_scheduler(lr_scheduler, opt, cfg)

    loader = None
    if training_data is not None:
        loader = ShardedDataLoader(training_data, batch, mesh, plan.batch_spec, collate_fn=collate_fn,
                                   drop_last=cfg.dataloader_drop_last, process_index=process_index,
                                   pad_to_multiple_of=cfg.spmd.pad_to_multiple_of, pad_id=model_pad_id(module))
    engine = SpmdZeroEngine(module=module, optimizer=opt, lr_scheduler=scheduler, config=cfg, batch=batch,
                            mesh=mesh, plan=plan, precision=policy, master_weights=masters,
                            training_dataloader=loader, config_dict=_config_dict(cfg, args, config, config_params))
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def _config_dict(cfg, args, config, config_params) -> dict:
    """The config as DeepSpeed's ``engine.config`` holds it: the user's dict (a file read)."""
    source = next((c for c in (config, config_params, getattr(args, "deepspeed_config", None)) if c is not None), None)
    if isinstance(source, Mapping):
        return dict(source)
    if isinstance(source, (str, os.PathLike)):
        return read_config_file(source)
    return cfg.model_dump(exclude_none=True)


def _move_in_place(module: torch.nn.Module, device) -> torch.nn.Module:
    """``module.to(device)`` that keeps every Parameter object. CPU and XLA tensors cannot
    share storage, so a plain ``.to`` makes new Parameters and an optimizer built on the
    old ones would silently update nothing; swapping contents keeps the references live."""
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        return module.to(device)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)


def _move_state_to(optimizer, device) -> None:
    """State a client optimizer already holds (e.g. loaded) follows its params to the device."""
    for p, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.device != p.device and value.shape == p.shape:
                state[key] = value.to(device)


def _build_optimizer(client, model_parameters, module, cfg):
    params = model_parameters if model_parameters is not None else [p for p in module.parameters() if p.requires_grad]
    if client is not None:
        if cfg.optimizer is not None:
            warnings.warn("spmdzero: both a client optimizer and a config 'optimizer' section were given; "
                          "the client optimizer is used (as in DeepSpeed)", stacklevel=3)
        if isinstance(client, torch.optim.Optimizer):
            return client
        if callable(client):
            built = client(params)
            if not isinstance(built, torch.optim.Optimizer):
                raise TypeError(f"the optimizer callable returned {type(built).__name__}, not a torch.optim.Optimizer")
            return built
        raise TypeError(f"optimizer must be a torch.optim.Optimizer or a callable taking params, "
                        f"got {type(client).__name__}")
    if cfg.optimizer is None:
        return None
    return build_optimizer(cfg.optimizer, params)


def _drop_frozen(optimizer) -> None:
    """DeepSpeed's ZeRO optimizers keep only the parameters that require grad, so frozen
    layers may come along in ``model_parameters=model.parameters()``; a group left empty is
    dropped, as DeepSpeed drops it (``get_lr()`` has one entry per remaining group)."""
    for group in optimizer.param_groups:
        group["params"] = [p for p in group["params"] if p.requires_grad]
    optimizer.param_groups[:] = [g for g in optimizer.param_groups if g["params"]]


def _build_scheduler(client, optimizer, cfg):
    if client is not None:
        return client(optimizer) if callable(client) and not hasattr(client, "step") else client
    if cfg.scheduler is None:
        return None
    if optimizer is None:
        raise ConfigError("the config has a 'scheduler' section but there is no optimizer to schedule")
    return build_scheduler(cfg.scheduler, optimizer)


def _tied_embeddings(module: torch.nn.Module) -> list[str]:
    """Names (as ``named_parameters`` gives them) of embedding tables that another module
    uses too, such as GPT-2's token embedding and output projection."""
    tables = {id(m.weight) for m in module.modules() if isinstance(m, torch.nn.Embedding)}
    uses: dict[int, int] = {}
    for _, p in module.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    return [n for n, p in module.named_parameters() if id(p) in tables and uses[id(p)] > 1]
