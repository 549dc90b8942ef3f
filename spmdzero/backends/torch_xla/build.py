"""The torch_xla backend's build pipeline: config, mesh, batch, plan, optimizer, schedule,
loader, then the engine (``spmdzero.initialize`` with ``spmd.backend: "torch_xla"``)."""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

import torch

from spmdzero import runtime
from spmdzero.config.errors import ConfigError
from spmdzero.config.schema import DeepSpeedConfig
from spmdzero.backends.torch_xla.batches import to_device_sharded
from spmdzero.backends.torch_xla.engine import SpmdZeroEngine
from spmdzero.backends.torch_xla.mesh import build_mesh
from spmdzero.sharding.mesh import check_user_mesh, mesh_shape
from spmdzero.optim.optimizers import init_state, placeholder_state
from spmdzero.backends.torch_xla.scan import apply_scan_layers, lay_out_gradients
from spmdzero.optim.precision import attach_master_weights, precision_policy
from spmdzero.train.build import move_in_place, move_state_to, refuse_sparse_gradients, setup_training


def refuse_torchax_only_keys(cfg: DeepSpeedConfig) -> None:
    """The keys only the torchax backend implements, refused here before anything is moved or
    started, each naming itself and what to do instead."""
    if cfg.bf16.enabled and cfg.bf16.bf16_master_weights_and_grads:
        raise ConfigError("bf16.bf16_master_weights_and_grads is implemented on the torchax backend (the default): the "
                          "update there reads and writes the bf16 parameters; spmd.backend='torch_xla' keeps fp32 "
                          "master weights: drop the key (and bf16.bf16_optimizer_states), or use the torchax backend")
    if cfg.spmd.remat != "none":
        raise ConfigError(f"spmd.remat={cfg.spmd.remat!r} is implemented on the torchax backend (a jax.checkpoint "
                         "policy for the scanned layers); on spmd.backend='torch_xla' checkpoint the blocks in the "
                         "model (torch.utils.checkpoint, gradient_checkpointing_enable()) or drop the key")
    if cfg.spmd.attention == "flash":
        raise ConfigError("spmd.attention='flash' is implemented on the torchax backend (Pallas's flash kernel for "
                          "F.scaled_dot_product_attention); on spmd.backend='torch_xla', SDPA is torch_xla's own "
                          "lowering: drop the key, or call torch_xla.experimental.custom_kernel.flash_attention "
                          "in the model")


def build(model: torch.nn.Module, cfg: DeepSpeedConfig, mesh: Any = None, optimizer: Any = None,
          model_parameters: Any = None, training_data: Any = None, lr_scheduler: Any = None,
          collate_fn: Optional[Callable] = None, config_dict: Optional[dict] = None, shape_only: bool = False):
    """``(engine, optimizer, training_dataloader, lr_scheduler)`` on torch_xla's runtime.
    ``shape_only``: the model's parameters are placeholders with no buffers
    (``spmdzero.aot.shapes``); the engine is built without executing anything."""
    refuse_torchax_only_keys(cfg)
    runtime.start_torch_xla()  # started at import under SPMDZERO_BACKEND=torch_xla; else now, where it can
    refuse_sparse_gradients(model)
    if cfg.spmd.compile_cache_dir:
        runtime.enable_compile_cache(cfg.spmd.compile_cache_dir)

    if mesh is not None:
        check_user_mesh(mesh, ("torch_xla",))
        if cfg.spmd.mesh is not None or cfg.spmd.dcn_mesh is not None:
            raise ValueError("a mesh was given twice: as initialize(mesh=...) and in the config's 'spmd' section")
    else:
        mesh = build_mesh(cfg.spmd.mesh, runtime.device_count(), cfg.spmd.dcn_mesh)
    shape = mesh_shape(mesh)
    process_index, process_count = runtime.hosts()
    module = move_in_place(model, runtime.device())
    policy = precision_policy(cfg)
    backend = _TorchXlaBuild(module, mesh, policy, shape_only)
    setup = setup_training(module, cfg, shape, backend, process_index=process_index, process_count=process_count,
                           optimizer=optimizer, model_parameters=model_parameters, lr_scheduler=lr_scheduler,
                           training_data=training_data, collate_fn=collate_fn)
    masters = backend.masters
    if cfg.spmd.scan_layers:
        lay_out_gradients(module, mesh, setup.plan)
    if setup.optimizer is None and policy.master_weights:
        module.to(policy.param_dtype)
    engine = SpmdZeroEngine(module=module, optimizer=setup.optimizer, lr_scheduler=setup.scheduler, config=cfg,
                            batch=setup.batch, mesh=mesh, plan=setup.plan, precision=policy, master_weights=masters,
                            training_dataloader=setup.loader, config_dict=config_dict, shape_only=shape_only)
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


class _TorchXlaBuild:
    """What ``setup_training`` asks of this backend (``train.build.BuildBackend``)."""

    even = False  # torch_xla pads a dim that does not divide by its axis

    def __init__(self, module: torch.nn.Module, mesh, policy, shape_only: bool):
        self._module, self._mesh, self._policy, self._shape_only = module, mesh, policy, shape_only
        self.masters: dict = {}  # fp32 master weights under mixed precision, by parameter (prepare_optimizer)

    def scan_layers(self, module: torch.nn.Module, cfg: DeepSpeedConfig) -> dict:
        """The block stack through torch_xla's scan (``scan.py``)."""
        return apply_scan_layers(module, cfg.spmd.scan_layers)

    def prepare_optimizer(self, opt) -> None:
        """The optimizer's state on the device, fp32 master weights under mixed precision, and
        the state of spmdzero's optimizers made now, so that the engine can lay it out before the
        first step (a torch.optim optimizer's is made by its first step: see optim.optimizers)."""
        move_state_to(opt, runtime.device())
        if self._policy.master_weights:
            self.masters.update(attach_master_weights(opt, self._module, self._policy.param_dtype))
        init_state(opt)  # spmdzero's optimizers; a torch.optim optimizer's first step creates its own
        if self._shape_only:  # the traced step is then a later step's, with the state as its input
            placeholder_state(opt)

    def batch_placement(self, plan, batch):
        return functools.partial(to_device_sharded, mesh=self._mesh, batch_spec=plan.batch_spec,
                                 dp_size=batch.dp_devices, process_count=batch.processes)
