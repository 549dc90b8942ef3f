"""spmdzero: DeepSpeed ZeRO-1/2 on TPUs, the GSPMD way.

Importing spmdzero starts the XLA runtime in SPMD mode (see ``spmdzero.runtime``), so
import it before creating any XLA tensor or running any backward pass. With
``SPMDZERO_BACKEND=torchax`` it starts no runtime and JAX takes the devices, for
``spmd.backend='torchax'`` (see ``spmdzero.runtime.jax_runtime``).
"""

import os as _os

from spmdzero import runtime as _runtime

if _os.environ.get("SPMDZERO_NO_RUNTIME") != "1":  # set by the CLI, which needs no devices
    _runtime.start()

from spmdzero.config.errors import ConfigError  # noqa: E402
from spmdzero.backends.torch_xla.engine import SpmdZeroEngine  # noqa: E402
from spmdzero.initialize import initialize  # noqa: E402
from spmdzero.sharding.plan import ShardingPlan, make_plan  # noqa: E402

from spmdzero.version import __version__  # noqa: E402
__all__ = ["initialize", "alias_deepspeed", "SpmdZeroEngine", "ShardingPlan", "make_plan", "ConfigError",
           "__version__"]


def alias_deepspeed() -> None:
    """After this call, ``import deepspeed`` (and ``from deepspeed.X import Y``) gives
    spmdzero's DeepSpeed compatibility layer, in this module and every later import.
    ``spmdzero launch`` does this for a script; call it yourself in a notebook."""
    from spmdzero.compat import alias

    alias.install()
