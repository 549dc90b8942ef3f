"""``deepspeed.runtime.engine``: ``DeepSpeedEngine`` is the class both backends' engines share,
so that ``isinstance(model, DeepSpeedEngine)`` (accelerate's unwrapping, scripts' checks) holds
for either."""

from spmdzero.train.engine_base import EngineBase as DeepSpeedEngine  # noqa: F401
