"""The build pipeline of ``spmdzero.initialize`` that every backend runs (``setup_training``:
batch arithmetic, plan, optimizer, schedule, loader, in this order), and its pieces: the config
as DeepSpeed's ``engine.config`` dict, moving a module without replacing its Parameters, the
client optimizer and scheduler as DeepSpeed takes them, frozen parameters dropped from the
groups, and which embedding tables are tied. A backend brings only what differs: its devices
(the mesh shape), where the optimizer's state lives, and how a loader's batches are placed."""

from __future__ import annotations
import os
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Protocol
import torch
from spmdzero.config.errors import ConfigError
from spmdzero.config.load import read_config_file
from spmdzero.config.schema import DeepSpeedConfig
from spmdzero.observe.console import say_once
from spmdzero.optim.optimizers import build_optimizer
from spmdzero.optim.schedules import build_scheduler
from spmdzero.sharding.batch import BatchSizes, resolve_batch
from spmdzero.sharding.mesh import data_parallel_size
from spmdzero.sharding.plan import ShardingPlan, make_plan
from spmdzero.train.data import ShardedDataLoader, model_pad_id
from spmdzero.train.scan_layers import scan_model, stacked_layers
from spmdzero.train.shape_buckets import buckets_for


@dataclass(frozen=True)
class TrainingSetup:
    """What ``setup_training`` built, for the backend's engine."""

    batch: BatchSizes
    plan: ShardingPlan
    optimizer: Optional[torch.optim.Optimizer]
    scheduler: Any
    loader: Optional[ShardedDataLoader]


class BuildBackend(Protocol):
    """What ``setup_training`` asks of the backend that builds an engine."""

    even: bool  # shard only dims that divide by the axis size (JAX's rule; torch_xla pads)

    def scan_layers(self, module: torch.nn.Module, cfg: DeepSpeedConfig) -> dict:
        """Convert the block stack in place for this backend's loop (``spmd.scan_layers``);
        returns ``scan_layers.apply_scan_layers``'s mapping."""

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Where the backend puts the optimizer's state (frozen parameters already dropped)."""

    def batch_placement(self, plan: ShardingPlan, batch: BatchSizes) -> Optional[Callable]:
        """How the loader places each batch; None: batches stay on the host."""


def setup_training(model: torch.nn.Module, cfg: DeepSpeedConfig, mesh_shape: dict[str, int], backend: BuildBackend,
                   *, process_index: int = 0, process_count: int = 1, optimizer: Any = None,
                   model_parameters: Any = None, lr_scheduler: Any = None, training_data: Any = None,
                   collate_fn: Optional[Callable] = None) -> TrainingSetup:
    """The model scanned where ``spmd.scan_layers`` says (``scan_layers.scan_model``), DeepSpeed's
    batch arithmetic on this mesh (said once, by the first process), the ZeRO plan of
    ``model``'s trainable parameters, the optimizer (the client's or the config's, frozen
    parameters dropped, then the backend's ``prepare_optimizer``), the schedule, and a loader
    of ``training_data`` whose batches the backend's ``batch_placement`` places."""
    if cfg.spmd.scan_layers:
        model_parameters = scan_model(model, lambda module: backend.scan_layers(module, cfg), model_parameters,
                                      optimizer)
    batch = resolve_batch(cfg, data_parallel_size(mesh_shape), process_count)
    if process_index == 0:
        say_once(batch.describe())
    trainable = [(n, p.shape) for n, p in model.named_parameters() if p.requires_grad]
    plan = make_plan(trainable, mesh_shape, cfg.zero_stage, tied_embeddings=tied_embeddings(model),
                     stacked=stacked_layers(model), even=backend.even)
    built = build_engine_optimizer(optimizer, model_parameters, model, cfg)
    if built is not None:
        drop_frozen(built)  # as DeepSpeed's ZeRO optimizers: trainable parameters only, no empty groups
        backend.prepare_optimizer(built)
    scheduler = build_engine_scheduler(lr_scheduler, built, cfg)
    loader = None
    if training_data is not None:
        loader = ShardedDataLoader(training_data, batch, backend.batch_placement(plan, batch),
                                   collate_fn=collate_fn, drop_last=cfg.dataloader_drop_last,
                                   process_index=process_index, pad_id=model_pad_id(model),
                                   # the buckets the config asks for; the torchax engine's default ones
                                   # pad at the forward, which cuts its outputs back
                                   buckets=buckets_for(cfg.spmd, model, on_by_default=False))
    return TrainingSetup(batch, plan, built, scheduler, loader)


def refuse_sparse_gradients(model: torch.nn.Module) -> None:
    """An ``nn.Embedding`` or ``nn.EmbeddingBag`` built with ``sparse=True`` makes a sparse
    gradient, which a sharding annotation cannot lay out: torch_xla fails on it in
    ``backward`` (deep inside, naming no module) and a backend that computes gradients dense
    would ignore the flag. Refused before anything is touched, naming the module. (DeepSpeed's
    ``sparse_gradients`` config key is another thing: see config.keys.)"""
    for name, module in model.named_modules():
        if isinstance(module, (torch.nn.Embedding, torch.nn.EmbeddingBag)) and module.sparse:
            where = f"module {name!r}" if name else "the model"
            raise ValueError(f"{where} ({type(module).__name__}) has sparse=True: a sparse gradient cannot be "
                             "sharded by annotation under SPMD. Construct it with sparse=False (the gradient "
                             "values are the same; XLA computes them dense)")


def config_dict(cfg, args, config, config_params) -> dict:
    """The config as DeepSpeed's ``engine.config`` holds it: the user's dict (a file read)."""
    source = next((c for c in (config, config_params, getattr(args, "deepspeed_config", None)) if c is not None), None)
    if isinstance(source, Mapping):
        return dict(source)
    if isinstance(source, (str, os.PathLike)):
        return read_config_file(source)
    return cfg.model_dump(exclude_none=True)


def move_in_place(module: torch.nn.Module, device) -> torch.nn.Module:
    """``module.to(device)`` that keeps every Parameter object. CPU and XLA tensors cannot
    share storage, so a plain ``.to`` makes new Parameters and an optimizer built on the
    old ones would silently update nothing; swapping contents keeps the references live."""
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        return module.to(device)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)


def move_state_to(optimizer, device) -> None:
    """State a client optimizer already holds (e.g. loaded) follows its params to the device."""
    for p, state in optimizer.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.device != p.device and value.shape == p.shape:
                state[key] = value.to(device)


def build_engine_optimizer(client, model_parameters, module, cfg):
    params = model_parameters if model_parameters is not None else [p for p in module.parameters() if p.requires_grad]
    if client is not None:
        if cfg.optimizer is not None:
            warnings.warn("spmdzero: both a client optimizer and a config 'optimizer' section were given; "
                          "the client optimizer is used (as in DeepSpeed)", stacklevel=3)
        if isinstance(client, torch.optim.Optimizer):
            return unfused(client)
        if callable(client):
            built = client(params)
            if not isinstance(built, torch.optim.Optimizer):
                raise TypeError(f"the optimizer callable returned {type(built).__name__}, not a torch.optim.Optimizer")
            return unfused(built)
        raise TypeError(f"optimizer must be a torch.optim.Optimizer or a callable taking params, "
                        f"got {type(client).__name__}")
    if cfg.optimizer is None:
        return None
    return build_optimizer(cfg.optimizer, params)


def unfused(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """``fused=True`` (the Hugging Face Trainer's default AdamW, ``adamw_torch_fused``) picks
    torch's CUDA/CPU kernels, which refuse XLA tensors. It is a choice of implementation, not
    of math: the step runs torch's per-tensor code instead, traced into the step's graph, where
    XLA fuses it anyway."""
    for group in optimizer.param_groups:
        if group.get("fused"):
            group["fused"] = False
    return optimizer


def drop_frozen(optimizer) -> None:
    """DeepSpeed's ZeRO optimizers keep only the parameters that require grad, so frozen
    layers may come along in ``model_parameters=model.parameters()``; a group left empty is
    dropped, as DeepSpeed drops it (``get_lr()`` has one entry per remaining group)."""
    for group in optimizer.param_groups:
        group["params"] = [p for p in group["params"] if p.requires_grad]
    optimizer.param_groups[:] = [g for g in optimizer.param_groups if g["params"]]


def build_engine_scheduler(client, optimizer, cfg):
    if client is not None:
        return client(optimizer) if callable(client) and not hasattr(client, "step") else client
    if cfg.scheduler is None:
        return None
    if optimizer is None:
        raise ConfigError("the config has a 'scheduler' section but there is no optimizer to schedule")
    return build_scheduler(cfg.scheduler, optimizer)


def tied_embeddings(module: torch.nn.Module) -> list[str]:
    """Names (as ``named_parameters`` gives them) of embedding tables that another module
    uses too, such as GPT-2's token embedding and output projection."""
    tables = {id(m.weight) for m in module.modules() if isinstance(m, torch.nn.Embedding)}
    uses: dict[int, int] = {}
    for _, p in module.named_parameters(remove_duplicate=False):
        uses[id(p)] = uses.get(id(p), 0) + 1
    return [n for n, p in module.named_parameters() if id(p) in tables and uses[id(p)] > 1]
