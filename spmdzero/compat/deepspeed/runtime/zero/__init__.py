"""``deepspeed.runtime.zero`` (also ``deepspeed.zero``): ZeRO-3's parameter helpers: no-ops at
stages 0-2, where the host keeps whole parameters; at stage 3 ``GatheredParameters`` brings the
host's placeholders whole from the devices (``spmd.host_parameters``)."""

from . import partition_parameters  # noqa: F401
from .partition_parameters import GatheredParameters, Init, ZeroParamStatus, ZeroParamType  # noqa: F401
from .partition_parameters import register_external_parameter, unregister_external_parameter  # noqa: F401
