"""spmdzero: DeepSpeed ZeRO-1/2 on TPUs, the GSPMD way.

Importing spmdzero gives the process's devices to one runtime (see ``spmdzero.runtime``): JAX's
by default, for the torchax backend (``spmd.backend='torchax'``), or torch_xla's in SPMD mode under
``SPMDZERO_BACKEND=torch_xla``; so import it first, before any device work (and, for torch_xla,
before any backward pass). torch_xla is an optional install (``spmdzero[torch_xla]``), imported
only when its backend is used.
"""

import os as _os

from spmdzero import runtime as _runtime

if _os.environ.get("SPMDZERO_NO_RUNTIME") != "1":  # set by the CLI, which needs no devices
    _runtime.start()

from spmdzero.config.errors import ConfigError  # noqa: E402
from spmdzero.initialize import initialize  # noqa: E402
from spmdzero.sharding.plan import ShardingPlan, make_plan  # noqa: E402

from spmdzero.version import __version__  # noqa: E402
__all__ = ["initialize", "alias_deepspeed", "SpmdZeroEngine", "TorchaxEngine", "ShardingPlan", "make_plan", "ConfigError",
           "__version__"]


def __getattr__(name: str):
    """``spmdzero.SpmdZeroEngine`` (the torch_xla backend's engine) and ``spmdzero.TorchaxEngine``,
    imported on first use: the torch_xla one imports torch_xla."""
    if name == "SpmdZeroEngine":
        from spmdzero.backends.torch_xla.engine import SpmdZeroEngine

        return SpmdZeroEngine
    if name == "TorchaxEngine":
        from spmdzero.backends.torchax.engine.engine import TorchaxEngine

        return TorchaxEngine
    raise AttributeError(f"module 'spmdzero' has no attribute {name!r}")


def alias_deepspeed() -> None:
    """After this call, ``import deepspeed`` (and ``from deepspeed.X import Y``) gives
    spmdzero's DeepSpeed compatibility layer, in this module and every later import.
    ``spmdzero launch`` does this for a script; call it yourself in a notebook."""
    from spmdzero.compat import alias

    alias.install()
