"""``SPMDZERO_BACKEND=torchax``: JAX owns the devices; torch_xla's runtime is never started.

``import spmdzero`` normally starts torch_xla's runtime (``spmdzero.runtime``), which takes every
TPU chip of the VM; a chip serves one runtime, so the torchax backend (``jax.jit``) could then only
run on JAX's CPU devices. With this variable set before ``import spmdzero``, the process is
JAX's instead: JAX is told which devices to take (every TPU chip on a TPU VM, else
``CPU_NUM_DEVICES`` CPU devices, 8 when unset, as torch_xla would), device and host counts come
from JAX, and only ``spmd.backend='torchax'`` can train. It is a per-process choice made before
any runtime starts, hence a variable and not a config key.
"""

from __future__ import annotations

import os
import sys
from typing import Optional
from spmdzero.runtime.devices import EnvironmentSettingError, _select_device_type, cpu_device_count

VARIABLE = "SPMDZERO_BACKEND"
CHOICES = ("torch_xla", "torchax")

_decided: Optional[bool] = None  # the choice runtime.start() made; None until it runs


def selected() -> bool:
    """True when the process's devices are JAX's: as decided when its runtime started (a variable
    set later, in a notebook, changes nothing: the runtime that started holds the devices), else
    as the variable says now."""
    return from_environment() if _decided is None else _decided


def from_environment() -> bool:
    value = os.environ.get(VARIABLE, "torch_xla")
    if value not in CHOICES:
        raise EnvironmentSettingError(f"{VARIABLE}={value!r} is not a backend: use 'torchax' (JAX takes the devices, for "
                         "spmd.backend='torchax') or 'torch_xla' (the default; or leave it unset)")
    return value == "torchax"


def decide() -> bool:
    """Fix the choice for this process (``runtime.start``)."""
    global _decided
    _decided = from_environment()
    return _decided


def _device_type() -> str:
    return _select_device_type()


def _cpu_count() -> int:
    return cpu_device_count()


def configure() -> None:
    """Tell JAX which devices to take, before it starts (this starts nothing): on a TPU VM
    only TPU and CPU, so that a TPU JAX cannot open (held by another process) is an error
    rather than a silent fallback to one CPU device."""
    import jax
    from jax._src import xla_bridge

    if xla_bridge.backends_are_initialized():
        return  # JAX ran before `import spmdzero`; devices() checks what it took
    device_type = _device_type()
    if device_type == "CPU":
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", _cpu_count())
    elif device_type == "TPU":
        if "JAX_PLATFORMS" not in os.environ:
            jax.config.update("jax_platforms", "tpu,cpu")
    else:
        raise RuntimeError(f"{VARIABLE}=torchax runs on TPU or CPU; PJRT_DEVICE={device_type} is neither")


def devices() -> list:
    """The devices of this process: the TPU chips on a TPU VM, else ``CPU_NUM_DEVICES`` CPU devices."""
    import jax

    device_type = _device_type()
    if device_type == "CPU":
        return cpu_devices(_cpu_count())
    configure()
    try:
        found = jax.devices()
    except RuntimeError as err:
        raise RuntimeError(f"{VARIABLE}=torchax: JAX could not open this host's {device_type} devices. A TPU chip "
                           "serves one process: is another one using it (a training run, a notebook kernel that "
                           "imported spmdzero without the variable)? JAX said: " + str(err)) from err
    if found[0].platform != device_type.lower():
        raise RuntimeError(f"{VARIABLE}=torchax: this is a {device_type} host but JAX started on "
                           f"{found[0].platform} devices (JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS')!r}); "
                           "to run on CPU devices, set PJRT_DEVICE=CPU")
    return found


def device_count() -> int:
    return len(devices())


def hosts() -> tuple[int, int]:
    """(this process's index, the number of processes), as JAX counts them."""
    import jax

    devices()  # the devices first: the process count is known once they have started
    return jax.process_index(), jax.process_count()


def cpu_devices(count: int) -> list:
    """``count`` JAX CPU devices. JAX's CPU backend has one device unless told before it starts;
    one that started with fewer (spmdzero's fused update lowers its op through JAX) is
    restarted when it holds no arrays yet but torchax's PRNG key."""
    import jax
    import jax.extend.backend
    import torch
    from jax._src import xla_bridge

    reseed = None
    if xla_bridge.backends_are_initialized() and len(jax.devices("cpu")) < count:
        # torchax's environment, once created (torch_xla's assume_pure does), holds a PRNG key
        env = sys.modules["torchax"].default_env() if "torchax" in sys.modules else None
        key = None if env is None else getattr(env.param.prng, "_base_array", env.param.prng)
        live = [a for a in jax.live_arrays("cpu") if a is not key]
        if not live:
            jax.extend.backend.clear_backends()
            reseed = env
    if not xla_bridge.backends_are_initialized():
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", count)
    found = jax.devices("cpu")
    if reseed is not None:
        reseed.manual_seed(torch.initial_seed() % (1 << 31))
    if len(found) < count:
        raise RuntimeError(f"spmd.backend='torchax' needs {count} JAX CPU devices but JAX started with {len(found)} "
                           f"and holds arrays; set XLA_FLAGS=--xla_force_host_platform_device_count={count} "
                           "before JAX starts")
    return found[:count]
