"""``deepspeed.runtime.engine``: ``DeepSpeedEngine`` is spmdzero's engine (for isinstance checks)."""

from spmdzero.backends.torch_xla.engine import SpmdZeroEngine as DeepSpeedEngine  # noqa: F401
