"""``spmdzero.initialize``: DeepSpeed's entry point, same arguments and return value. It reads
the config and hands the rest to the backend the config names (``spmd.backend``), or, when it
names none, the one the process's runtime serves (``SPMDZERO_BACKEND``: torchax unless it says
torch_xla). A backend's modules are imported when it is chosen: torch_xla is an optional
install, never imported for the torchax backend. torch and the build pipeline are imported at the first
call: ``import spmdzero`` stays quick where nothing is trained (the command line's parent process,
``spmdzero aot``'s compile process)."""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any, Callable, Optional

from spmdzero.config.errors import ConfigError
from spmdzero.config.load import load_config
from spmdzero.runtime import jax_runtime

if TYPE_CHECKING:
    import torch

BACKENDS = {"torch_xla": "spmdzero.backends.torch_xla.build", "torchax": "spmdzero.backends.torchax.build"}


def backend_builder(name: str):
    """The ``build`` module of backend ``name``; a missing torch_xla install is named, with the fix."""
    if name == "torch_xla" and importlib.util.find_spec("torch_xla") is None:
        import torch

        raise ConfigError("spmd.backend='torch_xla' needs torch_xla, which is not installed: pip install "
                          f"'spmdzero[torch_xla]' (torch_xla==2.9.0, which runs on torch 2.9 only; this is torch "
                          f"{torch.__version__}), or use spmd.backend='torchax' (the default)")
    return importlib.import_module(BACKENDS[name])


def initialize(args: Any = None, model: Optional[torch.nn.Module] = None, optimizer: Any = None,
               model_parameters: Any = None, training_data: Any = None, lr_scheduler: Any = None,
               mesh: Any = None, config: Any = None, config_params: Any = None,
               collate_fn: Optional[Callable] = None):
    """Build the engine. Returns ``(engine, optimizer, training_dataloader, lr_scheduler)``.

    ``config`` (or ``config_params``, or ``args.deepspeed_config``) is a dict or a JSON
    path. ``mesh`` is an optional mesh with an ``fsdp`` axis (on torchax a ``jax.sharding.Mesh``
    or a ``torch_xla.distributed.spmd.Mesh``; on torch_xla the latter); without it the config's
    ``spmd.mesh`` or a 1-D ``fsdp`` mesh over all devices is used. ``training_data`` (a
    Dataset) gives a loader of device-sharded batches.
    """
    import torch

    from spmdzero.train.build import config_dict

    if model is None:
        raise ValueError("spmdzero.initialize: model is required (got model=None)")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"spmdzero.initialize: model must be a torch.nn.Module, got {type(model).__name__}")
    cfg = with_backend(load_config(args, config, config_params))
    return backend_builder(cfg.spmd.backend).build(model, cfg, mesh=mesh, optimizer=optimizer,
                                            model_parameters=model_parameters, training_data=training_data,
                                            lr_scheduler=lr_scheduler, collate_fn=collate_fn,
                                            config_dict=config_dict(cfg, args, config, config_params))


def with_backend(cfg, jax_devices: Optional[bool] = None):
    """``cfg`` with the backend that builds its engine: the one ``spmd.backend`` names, else the
    one whose runtime holds the process's devices (``SPMDZERO_BACKEND``: JAX's, torchax, unless
    it says torch_xla). ``jax_devices``: whether JAX holds them, for another process than this
    one (``spmdzero aot``'s child); by default this process's runtime."""
    if "backend" not in cfg.spmd.model_fields_set:
        jax_devices = jax_runtime.selected() if jax_devices is None else jax_devices
        chosen = "torchax" if jax_devices else "torch_xla"
        cfg = cfg.model_copy(update={"spmd": cfg.spmd.model_copy(update={"backend": chosen})})
    return cfg


def backend_of(config: dict, jax_devices: Optional[bool] = None) -> str:
    """The backend ``initialize`` builds ``config``'s engine with (a config dict, as read from
    its file; ``jax_devices`` as for ``with_backend``)."""
    return with_backend(load_config(None, config, None), jax_devices).spmd.backend
