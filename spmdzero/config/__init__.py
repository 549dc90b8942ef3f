"""Layer ``config``: the DeepSpeed JSON, read once (``load``), validated into typed models
(``schema``) at the door, with every key DeepSpeed reads classified as data (``keys``). Below
it everything reads typed fields, not dict keys. It imports nothing else of spmdzero.
"""

from spmdzero.config.checks import check_params, check_value
from spmdzero.config.errors import ConfigError
from spmdzero.config.keys import NOOP_KEYS, REFUSED_KEYS
from spmdzero.config.load import load_config, parse_config, read_config_file
from spmdzero.config.schema import DeepSpeedConfig, OptimizerConfig, SchedulerConfig

__all__ = ["check_params", "check_value", "ConfigError", "NOOP_KEYS", "REFUSED_KEYS", "load_config", "parse_config",
           "read_config_file", "DeepSpeedConfig", "OptimizerConfig", "SchedulerConfig"]
