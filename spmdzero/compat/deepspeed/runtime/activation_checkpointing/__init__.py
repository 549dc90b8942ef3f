"""``deepspeed.runtime.activation_checkpointing`` (also ``deepspeed.checkpointing``)."""

from . import checkpointing  # noqa: F401
