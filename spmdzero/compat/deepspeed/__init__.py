"""DeepSpeed's public API over spmdzero: what ``import deepspeed`` gives under
``spmdzero launch`` or after ``spmdzero.alias_deepspeed()``.

The names and signatures are DeepSpeed's (0.19); behind them are spmdzero's engine,
optimizers and schedules. ``initialize`` counts DeepSpeed ranks as processes (one per
host, what ``torch.distributed`` sees) unless the config says otherwise in
``spmd.rank``: see "The batch rule" in docs/migrating.md.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable, Optional

from . import accelerator, checkpoint, comm, moe, ops, runtime, utils  # noqa: F401
from ._unsupported import unsupported_attribute
from .accelerator import get_accelerator
from .comm import init_distributed
from .comm.comm import TORCH_DISTRIBUTED_DEFAULT_PORT
from .runtime import zero
from . import checkpointing  # noqa: F401  (deepspeed.checkpointing, DeepSpeed's alias of the runtime module)
from .runtime.engine import DeepSpeedEngine
from .utils import log_dist, logger

from ..deepspeed_version import DEEPSPEED_API_VERSION, VERSION as __version__
__version_major__, __version_minor__, __version_patch__ = (int(v) for v in DEEPSPEED_API_VERSION.split("."))
__git_hash__ = __git_branch__ = None

__all__ = ["initialize", "init_distributed", "add_config_arguments", "get_accelerator", "zero", "comm", "ops",
           "runtime", "utils", "logger", "log_dist", "DeepSpeedEngine", "__version__"]

# The "spmd" section deepspeed.initialize starts from; the config's own "spmd" keys win.
# ``spmdzero launch --spmd '{...}'`` adds to it (e.g. shape buckets for a script's own collator).
SPMD_DEFAULTS: dict = {"rank": "process"}

_OUT_OF_SCOPE = {
    "init_inference": "DeepSpeed-Inference",
    "InferenceEngine": "DeepSpeed-Inference",
    "PipelineModule": "pipeline parallelism",
    "PipelineEngine": "pipeline parallelism",
    "DeepSpeedTransformerLayer": "DeepSpeed's CUDA transformer kernels",
    "DeepSpeedHybridEngine": "the hybrid (RLHF) engine",
}


def __getattr__(name):
    if name in _OUT_OF_SCOPE:
        raise AttributeError(f"deepspeed.{name}: {_OUT_OF_SCOPE[name]} is not supported by spmdzero (see "
                             "docs/migrating.md)")
    raise unsupported_attribute("deepspeed", name)  # deepspeed.pipe, deepspeed.inference, ... as attributes


def initialize(args: Any = None, model=None, optimizer=None, model_parameters=None, training_data=None,
               lr_scheduler=None, distributed_port: int = TORCH_DISTRIBUTED_DEFAULT_PORT, mpu: Any = None,
               dist_init_required: Optional[bool] = None, collate_fn: Optional[Callable] = None,
               config: Any = None, mesh_param: Any = None, config_params: Any = None):
    """``deepspeed.initialize``: ``spmdzero.initialize`` with DeepSpeed's signature. Creates
    the host process group first (as DeepSpeed does) and fills the config's "spmd" section
    from ``SPMD_DEFAULTS``: the batch rule "process" unless the config sets ``spmd.rank``."""
    import spmdzero
    from spmdzero.config.errors import ConfigError
    from spmdzero.config.load import read_config_file

    if mpu is not None:
        raise ValueError("deepspeed.initialize(mpu=...): model parallelism is not supported by spmdzero (ZeRO-1/2 "
                         "data parallelism; use the config's spmd.mesh for a data x fsdp mesh)")
    if mesh_param is not None:
        raise ValueError("deepspeed.initialize(mesh_param=...): sequence parallelism is not supported by spmdzero")
    init_distributed(distributed_port=distributed_port, dist_init_required=dist_init_required)
    if config is None and config_params is not None:
        config, config_params = config_params, None
    args_config = getattr(args, "deepspeed_config", None) or getattr(args, "deepscale_config", None)
    if config is not None and args_config is not None:
        raise ConfigError("Not sure how to proceed, we were given deepspeed configs in the deepspeed arguments and "
                          "deepspeed.initialize() function call")
    config = config if config is not None else args_config
    if isinstance(config, str) or hasattr(config, "__fspath__"):
        config = read_config_file(config)
    if isinstance(config, dict):
        spmd = config.get("spmd")
        config = {**config, "spmd": {**SPMD_DEFAULTS, **(spmd if isinstance(spmd, dict) else {})}}
    return spmdzero.initialize(model=model, optimizer=optimizer, model_parameters=model_parameters,
                               training_data=training_data, lr_scheduler=lr_scheduler, config=config,
                               collate_fn=collate_fn)


def _add_core_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (helper flag for user code, no impact on DeepSpeed backend)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true",
                       help="Deprecated enable DeepSpeed (helper flag for user code, no impact on DeepSpeed backend)")
    group.add_argument("--deepscale_config", default=None, type=str, help="Deprecated DeepSpeed json configuration file.")
    return parser


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """DeepSpeed's ``--deepspeed``, ``--deepspeed_config`` (and the deprecated ``--deepscale*``)."""
    return _add_core_arguments(parser)
