"""``deepspeed.checkpointing``: DeepSpeed's alias of ``deepspeed.runtime.activation_checkpointing.
checkpointing``, the same module object (``import deepspeed.checkpointing`` and the attribute
give one module, one configuration)."""

import sys

from .runtime.activation_checkpointing import checkpointing as _checkpointing

sys.modules[__name__] = _checkpointing
