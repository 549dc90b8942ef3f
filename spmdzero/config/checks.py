"""Checks of free-form ``params`` sections (optimizer and scheduler parameters) against the
signature of what they configure, with errors that name the key and the accepted values."""

from __future__ import annotations
import difflib
from typing import Any, Mapping
from spmdzero.config.errors import ConfigError


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_value(key: str, value: Any, default: Any, where: str) -> None:
    """The type the constructor's default has, strictly: ``"adam_w_mode": "false"`` would be
    true to Python and ``"weight_decay": "0.01"`` would fail deep inside. A number may be
    given per param group (a list, as DeepSpeed's schedules allow); a parameter without a
    default (``total_num_steps``) is a number. Numbers must be finite."""
    import inspect
    import math

    def numbers(v):
        return _is_number(v) or (isinstance(v, (tuple, list)) and bool(v) and all(_is_number(x) for x in v))

    if default is inspect.Parameter.empty or _is_number(default):
        expected, ok = "a number", numbers(value)
    elif isinstance(default, bool):
        expected, ok = "true or false", isinstance(value, bool)
    elif isinstance(default, (tuple, list)) and default and all(_is_number(d) for d in default):
        expected = f"{ {2: 'two', 3: 'three'}.get(len(default), len(default))} numbers"
        ok = isinstance(value, (tuple, list)) and len(value) == len(default) and numbers(value)
    elif isinstance(default, str):
        expected, ok = "a string", isinstance(value, str)
    else:
        expected, ok = "", True
    section = where.partition(" for ")[0]
    if not ok:
        raise ConfigError(f"{section}.{key} must be {expected}, got {value!r} ({where})")
    for number in (value if isinstance(value, (tuple, list)) else [value]):
        if isinstance(number, float) and not math.isfinite(number):
            raise ConfigError(f"{section}.{key} must be a finite number, got {value!r} ({where})")


def check_params(cls, params: Mapping[str, Any], where: str, skip: tuple[str, ...] = ()) -> None:
    """Refuse keys that ``cls``'s constructor does not take, suggesting the closest one,
    and values of another type than the parameter's default (``check_value``)."""
    import inspect

    try:
        signature = inspect.signature(cls.__init__)
    except (TypeError, ValueError):
        return
    accepted = [n for n, p in signature.parameters.items()
                if n != "self" and n not in skip and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if any(p.kind == p.VAR_KEYWORD for p in signature.parameters.values()):
        return
    for key in params:
        if key not in accepted:
            close = difflib.get_close_matches(key, accepted, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"accepted: {', '.join(accepted)}"
            raise ConfigError(f"{where}: unknown key {key!r} ({hint})")
        check_value(key, params[key], signature.parameters[key].default, where)
