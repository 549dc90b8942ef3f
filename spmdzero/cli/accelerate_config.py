"""What ``accelerate launch --config_file FILE`` hands a DeepSpeed run, read from the same file,
so that ``spmdzero launch --config_file FILE SCRIPT`` starts an accelerate script unchanged.

accelerate's launcher does not pass its config to the script: it exports it as environment
variables (``ACCELERATE_USE_DEEPSPEED``, ``ACCELERATE_DEEPSPEED_CONFIG_FILE``, ...), which
``Accelerator()`` reads to build its ``DeepSpeedPlugin``. This module reads the file (YAML or
JSON, as accelerate writes it) into those variables and into the host flags it implies
(``num_machines``, ``machine_rank``, ``main_process_ip``, ``main_process_port``), as plain data:
``launch.py`` applies it. The variable names and their spelling follow accelerate's
``prepare_deepspeed_cmd_env`` (accelerate 1.x). Settings that pick GPUs or a multi-node
launcher have no meaning with one process per host and are named, not applied.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

# deepspeed_config keys -> the variable accelerate exports, and whether it lowercases the value
_DEEPSPEED_VARIABLES = {
    "deepspeed_config_file": ("ACCELERATE_DEEPSPEED_CONFIG_FILE", False),
    "zero_stage": ("ACCELERATE_DEEPSPEED_ZERO_STAGE", False),
    "gradient_accumulation_steps": ("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", False),
    "gradient_clipping": ("ACCELERATE_GRADIENT_CLIPPING", True),
    "offload_optimizer_device": ("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE", True),
    "offload_param_device": ("ACCELERATE_DEEPSPEED_OFFLOAD_PARAM_DEVICE", True),
    "zero3_init_flag": ("ACCELERATE_DEEPSPEED_ZERO3_INIT", True),
    "zero3_save_16bit_model": ("ACCELERATE_DEEPSPEED_ZERO3_SAVE_16BIT_MODEL", True),
    "deepspeed_moe_layer_cls_names": ("ACCELERATE_DEEPSPEED_MOE_LAYER_CLS_NAMES", False),
}
# they choose GPUs, or how DeepSpeed's launcher reaches other nodes: one process per host here
_LAUNCHER_ONLY = ("num_processes", "gpu_ids", "deepspeed_hostfile", "deepspeed_multinode_launcher",
                  "deepspeed_inclusion_filter", "deepspeed_exclusion_filter")
# top-level keys -> spmdzero launch's own host flags
_HOST_FLAGS = {"num_machines": "num_nodes", "machine_rank": "node_rank", "main_process_ip": "master_addr",
               "main_process_port": "master_port"}


@dataclass
class AccelerateLaunch:
    """The environment to export, the host flags the file gives (``launch``'s own flags win), and
    the settings that are not applied, as ``key=value``."""

    env: dict[str, str] = field(default_factory=dict)
    hosts: dict[str, object] = field(default_factory=dict)
    ignored: list[str] = field(default_factory=list)


def _text(value, lower: bool) -> str:
    text = str(value)
    return text.lower() if lower else text


def _read(path: str) -> dict:
    try:
        with open(path) as handle:
            text = handle.read()
    except OSError as err:
        raise ValueError(f"--config_file {path}: cannot read it ({err.strerror or err})") from None
    try:
        if path.endswith(".json"):
            data = json.loads(text)
        else:
            import yaml  # PyYAML, a dependency of transformers and accelerate

            data = yaml.safe_load(text)
    except Exception as err:  # yaml's and json's own errors carry the line
        raise ValueError(f"--config_file {path}: not an accelerate config ({' '.join(str(err).split())})") from None
    if not isinstance(data, dict):
        raise ValueError(f"--config_file {path}: an accelerate config is a mapping of settings, got "
                         f"{type(data).__name__}")
    return data


def _number(data: dict, key: str, path: str) -> int:
    value = data.get(key)
    if value is None:
        return 0
    try:
        return int(value)
    except (TypeError, ValueError):
        raise ValueError(f"--config_file {path}: {key} must be a whole number, got {value!r}") from None


def read_accelerate_config(path: str) -> AccelerateLaunch:
    """The launch an accelerate config file asks for, checked: it must be a DeepSpeed config
    (``distributed_type: DEEPSPEED``), since spmdzero runs DeepSpeed's ZeRO, and a
    ``deepspeed_config_file`` it names must exist (accelerate would fail later, inside the script)."""
    data = _read(path)
    kind = str(data.get("distributed_type", "NO"))
    if kind.upper() != "DEEPSPEED":
        raise ValueError(f"--config_file {path}: distributed_type is {kind!r}; spmdzero launch runs DeepSpeed "
                         "configs (distributed_type: DEEPSPEED, as `accelerate config` writes when you choose "
                         "DeepSpeed)")
    deepspeed = data.get("deepspeed_config") or {}
    if not isinstance(deepspeed, dict):
        raise ValueError(f"--config_file {path}: deepspeed_config must be a mapping of settings, got {deepspeed!r}")
    launch = AccelerateLaunch()
    launch.env["ACCELERATE_USE_DEEPSPEED"] = "true"
    for key, value in deepspeed.items():
        if key in _DEEPSPEED_VARIABLES and value is not None:
            variable, lower = _DEEPSPEED_VARIABLES[key]
            launch.env[variable] = _text(value, lower)
        elif key in _LAUNCHER_ONLY and value is not None:
            launch.ignored.append(f"deepspeed_config.{key}={value}")
    ds_file = deepspeed.get("deepspeed_config_file")
    if ds_file is not None and not os.path.isfile(str(ds_file)):
        raise ValueError(f"--config_file {path}: deepspeed_config.deepspeed_config_file {ds_file!r} is not a file "
                         f"(it is read from the directory you launch in, {os.getcwd()})")
    # accelerate tells its DeepSpeedPlugin which fields came from the file, to refuse those that a
    # deepspeed_config_file must hold instead
    fields = list(deepspeed)
    if data.get("mixed_precision") is not None:
        launch.env["ACCELERATE_MIXED_PRECISION"] = _text(data["mixed_precision"], True)
        fields.append("mixed_precision")
    else:
        launch.env["ACCELERATE_MIXED_PRECISION"] = "no"
    launch.env["ACCELERATE_CONFIG_DS_FIELDS"] = ",".join(fields).lower()
    if data.get("debug"):
        launch.env["ACCELERATE_DEBUG_MODE"] = "true"
    if _number(data, "num_machines", path) > 1:
        launch.hosts = {flag: data[key] if flag == "master_addr" else _number(data, key, path)
                        for key, flag in _HOST_FLAGS.items() if data.get(key) is not None}
    for key in _LAUNCHER_ONLY:
        if data.get(key) not in (None, "all"):
            launch.ignored.append(f"{key}={data[key]}")
    return launch
