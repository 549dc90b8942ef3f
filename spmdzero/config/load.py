"""Reading a DeepSpeed config: a dict, a JSON/HJSON file (duplicate keys refused, as
DeepSpeed refuses them), base64, or ``args.deepspeed_config``; DeepSpeed's aliases; the
classification of switched-on keys (``keys``); and the validation into ``schema.DeepSpeedConfig``,
whose errors are rewritten to name the key."""

from __future__ import annotations
import difflib
import json
import os
import warnings
from typing import Any, Mapping, Optional
from pydantic import ValidationError
from spmdzero.config.errors import ConfigError
from spmdzero.config.keys import NOOP_KEYS, NOOP_VALID_VALUES, OFF_VALUES, REFUSED_KEYS, ZERO3_REASON, zero3_reason
from spmdzero.config.schema import DeepSpeedConfig


def _no_duplicate_keys(pairs: list[tuple[str, Any]], source: str) -> dict:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise ConfigError(f"{source}: duplicate key {key!r}")
        seen[key] = value
    return seen


def read_config_file(path: str | os.PathLike) -> dict:
    """Read a JSON (or HJSON, as DeepSpeed allows) file, refusing duplicate keys."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise ConfigError(f"DeepSpeed config file {path!r} is a directory")
    if not os.path.isfile(path):
        decoded = _base64_config(path)
        if decoded is None:
            raise ConfigError(f"DeepSpeed config file not found: {path!r} (nor is it a base64-encoded config)")
        text, path = decoded, "config (base64)"
    else:
        with open(path, "rb") as f:
            raw = f.read()
        try:
            text = raw.decode("utf-8-sig")  # JSON is UTF-8 whatever the locale (a BOM is skipped)
        except UnicodeDecodeError as err:
            raise ConfigError(f"DeepSpeed config file {path!r} is not UTF-8 text (byte {err.start}: "
                              f"{raw[err.start:err.start + 1]!r}); JSON files are UTF-8") from None
    if not text.strip():
        raise ConfigError(f"DeepSpeed config file {path!r} is empty")
    hook = lambda pairs: _no_duplicate_keys(pairs, path)  # noqa: E731
    try:
        return json.loads(text, object_pairs_hook=hook)
    except RecursionError:
        raise ConfigError(f"{path}: nested too deeply to be a DeepSpeed config") from None
    except json.JSONDecodeError as json_err:
        try:
            import hjson
        except ImportError:
            raise ConfigError(f"{path}: not valid JSON ({json_err})") from None
        try:
            return dict(hjson.loads(text, object_pairs_hook=hook))
        except ConfigError:
            raise
        except RecursionError:
            raise ConfigError(f"{path}: nested too deeply to be a DeepSpeed config") from None
        except Exception as err:
            raise ConfigError(f"{path}: neither valid JSON nor HJSON ({err})") from None


def without_integration_autos(config: dict) -> tuple[dict, list[str], bool]:
    """A config as a Hugging Face integration writes it (the Trainer or accelerate fill its
    ``"auto"`` optimizer and scheduler parameters from ``TrainingArguments`` before DeepSpeed
    sees it), made checkable on its own: the ``"auto"`` optimizer parameters dropped (the
    optimizer's defaults stand in) and a scheduler with ``"auto"`` parameters left out.
    Returns the config, the optimizer parameter names that were ``"auto"``, and whether the
    scheduler was left out. ``deepspeed.initialize`` itself still refuses ``"auto"`` there:
    only an integration knows the values."""
    config = dict(config)
    auto: list[str] = []
    optimizer = config.get("optimizer")
    if isinstance(optimizer, dict) and isinstance(optimizer.get("params"), dict):
        auto = [k for k, v in optimizer["params"].items() if v == "auto"]
        if auto:
            config["optimizer"] = {**optimizer, "params": {k: v for k, v in optimizer["params"].items()
                                                           if k not in auto}}
    scheduler = config.get("scheduler")
    dropped = isinstance(scheduler, dict) and isinstance(scheduler.get("params"), dict) and \
        "auto" in scheduler["params"].values()
    if dropped:
        del config["scheduler"]
    return config, auto, dropped


def _base64_config(value: str) -> Optional[str]:
    """DeepSpeed also takes the config as base64-encoded JSON (its launcher and autotuner pass
    it so): the decoded text, or None when ``value`` is not that."""
    import base64
    import binascii

    if not value or os.sep in value or value.endswith((".json", ".hjson")):
        return None
    try:
        text = base64.urlsafe_b64decode(value + "=" * (-len(value) % 4)).decode("utf-8")
    except (binascii.Error, ValueError, UnicodeDecodeError):
        return None
    return text if text.lstrip().startswith("{") else None


def _format_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            section_path, bad = e["loc"][:-1], str(e["loc"][-1])
            model: Any = DeepSpeedConfig
            for part in section_path:
                model = model.model_fields[part].annotation
                model = next((a for a in getattr(model, "__args__", ()) if isinstance(a, type)), model)
            valid = list(getattr(model, "model_fields", {}))
            prefix = ".".join(str(p) for p in section_path) + "."
            valid += [k[len(prefix):] for k in {**NOOP_KEYS, **REFUSED_KEYS} if k.startswith(prefix)]
            close = difflib.get_close_matches(bad, valid, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f" (valid keys: {', '.join(valid)})"
            lines.append(f"unknown key {key!r}{hint}")
        else:
            lines.append(f"{key}: {e['msg']} (got {e.get('input')!r})")
    return "; ".join(lines)


def parse_config(raw: Mapping[str, Any], source: str = "config") -> DeepSpeedConfig:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{source}: a DeepSpeed config must be a JSON object, got {type(raw).__name__}")
    raw = _deepspeed_aliases(dict(raw), source)
    _warn_misspelled_keys(raw, source)
    raw, noop = _classify(raw, source)
    try:
        cfg = DeepSpeedConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(f"{source}: {_format_errors(err)}") from None
    if cfg.fp16.enabled and cfg.bf16.enabled:
        raise ConfigError(f"{source}: fp16 and bf16 cannot both be enabled")
    mode = "fp16" if cfg.fp16.enabled else "bf16" if cfg.bf16.enabled else "fp32"
    _check_bf16_masters(cfg, source)
    param_dtype = cfg.data_types.param_dtype
    if param_dtype is not None and _DTYPE_MODE[param_dtype] != mode:
        raise ConfigError(f"{source}: data_types.param_dtype={param_dtype!r} conflicts with the precision mode "
                          f"({mode}); set the fp16/bf16 'enabled' flag or omit data_types.param_dtype")
    cfg._noop_keys = tuple(noop)
    _warn_noop_keys(cfg)
    return cfg


def _check_bf16_masters(cfg: DeepSpeedConfig, source: str) -> None:
    """DeepSpeed's conditions on its bf16 master weights and optimizer states (runtime/config.py):
    a ZeRO optimizer (stage 1-3) holds them, and bf16 states go with bf16 masters."""
    bf16 = cfg.bf16
    if not bf16.enabled or not (bf16.bf16_master_weights_and_grads or bf16.bf16_optimizer_states):
        return
    key = "bf16_master_weights_and_grads" if bf16.bf16_master_weights_and_grads else "bf16_optimizer_states"
    if cfg.zero_optimization.stage == 0:
        raise ConfigError(f"{source}: bf16.{key} needs ZeRO stage 1, 2 or 3 (zero_optimization.stage is 0), as in "
                          "DeepSpeed: the ZeRO optimizer holds the master weights")
    if bf16.bf16_optimizer_states and not bf16.bf16_master_weights_and_grads:
        raise ConfigError(f"{source}: bf16.bf16_optimizer_states needs bf16.bf16_master_weights_and_grads, as in "
                          "DeepSpeed: the optimizer states take the master weights' dtype")


_DTYPE_MODE = {"fp32": "fp32", "float32": "fp32", "float": "fp32", "fp16": "fp16", "float16": "fp16",
               "half": "fp16", "bf16": "bf16", "bfloat16": "bf16", "bfloat": "bf16"}


def known_top_level_keys() -> set[str]:
    """Every top-level key spmdzero reads, accepts as a no-op or refuses."""
    return (set(DeepSpeedConfig.model_fields) | {k.split(".")[0] for k in (*NOOP_KEYS, *REFUSED_KEYS)}
            | {"bfloat16"})


def _warn_misspelled_keys(raw: Mapping[str, Any], source: str) -> None:
    """DeepSpeed ignores unknown top-level keys, and so does spmdzero (scripts keep their own
    settings there), but a near miss of a DeepSpeed key (``zero_optimisation``) would silently
    train at ZeRO-0 or in fp32: say so, once per key."""
    known = known_top_level_keys()
    for key in raw:
        if key in known or not isinstance(key, str):
            continue
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.8)
        if close:
            _warn_once(f"misspelled:{key}", f"{source}: unknown top-level key {key!r} is ignored, as DeepSpeed "
                                            f"ignores it; did you mean {close[0]!r}?")


def _deepspeed_aliases(raw: dict, source: str) -> dict:
    """DeepSpeed's old spellings: ``"bfloat16"`` for ``"bf16"``, ``"zero_optimization": true``
    for stage 1 (``false``: stage 0)."""
    if "bfloat16" in raw:
        old = raw.pop("bfloat16")
        if "bf16" in raw and raw["bf16"] != old:
            raise ConfigError(f"{source}: 'bf16' and its old name 'bfloat16' are both given, with different values")
        raw.setdefault("bf16", old)
    if isinstance(raw.get("zero_optimization"), bool):
        raw["zero_optimization"] = {"stage": int(raw["zero_optimization"])}
    return raw


def _enabled(key: str, value: Any) -> bool:
    """Whether a DeepSpeed feature is switched on: not null/false/"none"/its off value;
    a section by its ``enabled`` or ``device`` key, else by any enabled entry."""
    if value is None or value is False or value in OFF_VALUES.get(key, ()):
        return False
    if key == "compression_training" and isinstance(value, Mapping):  # each technique's switch
        return any(isinstance(t, Mapping) and _enabled(f"{key}.{name}", t.get("shared_parameters"))
                   for name, t in value.items())
    if isinstance(value, str):
        return value.lower() != "none"
    if isinstance(value, Mapping):
        if "enabled" in value:
            return _enabled(f"{key}.enabled", value["enabled"])
        if "device" in value:
            return _enabled(f"{key}.device", value["device"])
        return any(_enabled(f"{key}.{k}", v) for k, v in value.items())
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return True  # a number is a setting (bucket sizes, factors whose off value is in OFF_VALUES)
    return bool(value)


def _classify(raw: dict, source: str) -> tuple[dict, list[str]]:
    """Refuse the refused keys switched on; drop the classified keys (the typed sections do not
    know them) and return the no-op keys switched on."""
    raw = {k: dict(v) if isinstance(v, Mapping) else v for k, v in raw.items()}
    for key, reason in REFUSED_KEYS.items():
        section, _, name = key.rpartition(".")
        holder = raw.get(section) if section else raw
        if isinstance(holder, dict) and name in holder:
            value = holder.pop(name)
            if _enabled(key, value):
                raise ConfigError(f"{source}: {key}={value!r} is not supported: {reason}")
    noop = []
    zero = raw.get("zero_optimization")
    stage = zero.get("stage") if isinstance(zero, dict) else None
    for key in NOOP_KEYS:
        section, _, name = key.rpartition(".")
        holder = raw.get(section) if section else raw
        if isinstance(holder, dict) and name in holder:
            value = holder.pop(name)
            valid = NOOP_VALID_VALUES.get(key)
            if valid is not None and value != "auto" and not (isinstance(value, str) and value.lower() in valid):
                raise ConfigError(f"{source}: {key}={value!r} is not one of {', '.join(valid)} (any case), as "
                                  "DeepSpeed requires")
            # ZeRO-3 knobs are silent below stage 3, as DeepSpeed ignores them there
            zero3_noop = stage == 3 and zero3_reason(name) is not None
            if (NOOP_KEYS[key] != ZERO3_REASON or zero3_noop) and value != "auto" and _enabled(key, value):
                noop.append(key)
    return raw, noop


_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(f"spmdzero: {message}", stacklevel=4)


def noop_reason(key: str) -> str:
    """Why a no-op key switched on changes nothing: a ZeRO-3 knob (only ever switched on at stage
    3) says what XLA does in its place."""
    reason = NOOP_KEYS[key]
    return zero3_reason(key.rpartition(".")[2]) if reason == ZERO3_REASON else reason


def _warn_noop_keys(cfg: DeepSpeedConfig) -> None:
    """One warning per parse for the no-op keys not warned about before (one line per reason)."""
    by_reason: dict[str, list[str]] = {}
    for key in cfg.noop_keys:
        if key not in _warned:
            _warned.add(key)
            by_reason.setdefault(noop_reason(key), []).append(key)
    if by_reason:
        lines = [f"{', '.join(keys)}: {reason}" for reason, keys in by_reason.items()]
        warnings.warn("spmdzero: these DeepSpeed config keys have no effect under GSPMD (docs/config.md, "
                      "\"No-ops under GSPMD\"):\n  " + "\n  ".join(lines), stacklevel=3)


def load_config(args: Any = None, config: Any = None, config_params: Any = None) -> DeepSpeedConfig:
    """Resolve the one config source, as ``deepspeed.initialize`` does."""
    if config is not None and config_params is not None:
        raise ConfigError("give the DeepSpeed config as `config` or `config_params`, not both")
    config = config if config is not None else config_params
    args_config = getattr(args, "deepspeed_config", None) if args is not None else None
    old_name = getattr(args, "deepscale_config", None) if args is not None else None
    if old_name is not None:  # DeepSpeed's deprecated flag
        if args_config is not None:
            raise ConfigError("give the config as --deepspeed_config or its deprecated name --deepscale_config, "
                              "not both")
        warnings.warn("spmdzero: --deepscale_config is deprecated, use --deepspeed_config", stacklevel=3)
        args_config = old_name
    if config is not None and args_config is not None:
        raise ConfigError(
            "Not sure how to proceed, we were given deepspeed configs in the deepspeed arguments "
            "and deepspeed.initialize() function call"
        )
    config = config if config is not None else args_config
    if config is None:
        raise ConfigError(
            "no DeepSpeed config: pass config= (a dict or a JSON path) or args with .deepspeed_config"
        )
    if isinstance(config, DeepSpeedConfig):
        return config
    if isinstance(config, (str, os.PathLike)):
        return parse_config(read_config_file(config), source=os.fspath(config))
    if isinstance(config, Mapping):
        return parse_config(config)
    raise ConfigError(f"config must be a dict or a path to a JSON file, got {type(config).__name__}")
