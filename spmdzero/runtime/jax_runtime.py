"""JAX owns the devices (the default): ``SPMDZERO_BACKEND`` unset or ``torchax``.

A process's devices are held by one runtime, chosen before any starts, at ``import spmdzero``:
JAX's (the torchax backend, ``spmd.backend='torchax'``, the default) or torch_xla's
(``SPMDZERO_BACKEND=torch_xla``, for ``spmd.backend='torch_xla'``). On a TPU VM a chip serves one
runtime, hence a per-process choice made before either starts, and a variable rather than a
config key. Here JAX is told which devices to take (every TPU chip on a TPU VM, else
``CPU_NUM_DEVICES`` CPU devices, 8 when unset, as torch_xla would), and device and host counts come
from JAX. On CPU, torch_xla's runtime can still be started beside JAX's devices for a config that
names ``spmd.backend='torch_xla'`` (``runtime.process.start_torch_xla``).

Several hosts (one process each) join one global mesh through ``jax.distributed``, before JAX
starts its devices (``configure``, from ``runtime.start`` at ``import spmdzero``), as the
environment says (``distributed_settings``): ``WORLD_SIZE`` > 1 with ``RANK`` and
``MASTER_ADDR``/``MASTER_PORT`` (what ``spmdzero launch --num_nodes N --node_rank I`` sets, or
set by hand for a plain script), the coordinator listening on ``MASTER_PORT + 1`` of the first
host (``MASTER_PORT`` is torch.distributed's, which ``deepspeed.init_distributed`` takes); on a
TPU VM without ``WORLD_SIZE``, JAX's own discovery from the TPU runtime.
``SPMDZERO_DISTRIBUTED=0`` joins nothing. Device counts and ``hosts()`` are then the global ones.
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Mapping
from typing import Optional
from spmdzero.runtime import jax_private
from spmdzero.runtime.devices import EnvironmentSettingError, select_device_type, cpu_device_count, size_cpu_thread_pool

VARIABLE = "SPMDZERO_BACKEND"
CHOICES = ("torch_xla", "torchax")
DEFAULT = "torchax"

DISTRIBUTED = "SPMDZERO_DISTRIBUTED"  # 0: never call jax.distributed.initialize
INIT_TIMEOUT = "SPMDZERO_DISTRIBUTED_INIT_TIMEOUT"  # s to wait for every process to join (JAX: 300)
HEARTBEAT_TIMEOUT = "SPMDZERO_DISTRIBUTED_HEARTBEAT_TIMEOUT"  # s of silence before a process counts as lost (JAX: 100)
DEFAULT_MASTER_PORT = 29500

_decided: Optional[bool] = None  # the choice runtime.start() made; None until it runs


def selected() -> bool:
    """True when the process's devices are JAX's: as decided when its runtime started (a variable
    set later, in a notebook, changes nothing: the runtime that started holds the devices), else
    as the variable says now."""
    return from_environment() if _decided is None else _decided


def from_environment() -> bool:
    """Whether the environment gives this process's devices to JAX: ``SPMDZERO_BACKEND`` unset
    (the default) or ``torchax``; ``torch_xla`` gives them to torch_xla's runtime."""
    return backend_from_environment() == "torchax"


def backend_from_environment() -> str:
    """``SPMDZERO_BACKEND``, checked: the backend whose runtime takes this process's devices."""
    value = os.environ.get(VARIABLE, "").strip() or DEFAULT
    if value not in CHOICES:
        raise EnvironmentSettingError(f"{VARIABLE}={value!r} is not a backend: use 'torchax' (the default: JAX takes "
                                      "the devices) or 'torch_xla' (torch_xla's runtime takes them, for "
                                      "spmd.backend='torch_xla'), or leave it unset")
    return value


def decide() -> bool:
    """Fix the choice for this process (``runtime.start``)."""
    global _decided
    _decided = from_environment()
    return _decided


def _device_type() -> str:
    return select_device_type()


def _cpu_count() -> int:
    return cpu_device_count()


def _seconds(name: str, environ: Mapping[str, str]) -> int | None:
    value = environ.get(name)
    if value is None:
        return None
    try:
        seconds = int(value)
    except ValueError:
        seconds = 0
    if seconds <= 0:
        raise ValueError(f"{name}={value!r}: give a whole number of seconds > 0")
    return seconds


def distributed_settings(environ: Mapping[str, str] | None = None, device_type: str | None = None) -> dict | None:
    """The ``jax.distributed.initialize`` arguments this process's environment asks for, or
    None (one process): ``WORLD_SIZE`` > 1 with ``RANK`` and ``MASTER_ADDR`` (``MASTER_PORT``,
    29500 if unset; the coordinator listens on the port after it); on a Cloud TPU VM without
    ``WORLD_SIZE``, no address (JAX discovers the hosts from the TPU runtime). A process that
    ``multiprocessing`` started (a DataLoader worker) is not a host and joins nothing."""
    import multiprocessing

    environ = os.environ if environ is None else environ
    value = environ.get(DISTRIBUTED, "1").strip().lower()
    if value not in ("0", "1", "true", "false", ""):
        raise ValueError(f"{DISTRIBUTED}={value!r}: use 1 (join the processes WORLD_SIZE/RANK/MASTER_ADDR name, "
                         "the default) or 0 (this process alone)")
    if value in ("0", "false") or multiprocessing.parent_process() is not None:
        return None
    timeouts = {"initialization_timeout": _seconds(INIT_TIMEOUT, environ),
                "heartbeat_timeout_seconds": _seconds(HEARTBEAT_TIMEOUT, environ)}
    timeouts = {k: v for k, v in timeouts.items() if v is not None}
    world = environ.get("WORLD_SIZE")
    if world is None:
        if (device_type or _device_type()) == "TPU" and _on_cloud_tpu_vm():
            return timeouts  # JAX finds the TPU VM's hosts and this one's index itself
        return None
    try:
        count = int(world)
    except ValueError:
        count = 0
    if count < 1:
        raise ValueError(f"WORLD_SIZE={world!r}: the number of processes (hosts), a whole number >= 1")
    if count == 1:
        return None
    missing = [name for name in ("RANK", "MASTER_ADDR") if not environ.get(name)]
    if missing:
        raise ValueError(f"WORLD_SIZE={count} asks for {count} processes but {' and '.join(missing)} "
                         f"{'is' if len(missing) == 1 else 'are'} not set: RANK is this process's index (0 to "
                         f"{count - 1}), MASTER_ADDR the first host's address (`spmdzero launch --num_nodes "
                         f"{count} --node_rank I --master_addr ADDR` sets them)")
    rank, port = environ["RANK"], environ.get("MASTER_PORT", str(DEFAULT_MASTER_PORT))
    if not rank.isdigit() or int(rank) >= count:
        raise ValueError(f"RANK={rank!r}: this process's index among WORLD_SIZE={count} processes, 0 to {count - 1}")
    if not port.isdigit() or not 0 < int(port) < 65535:
        raise ValueError(f"MASTER_PORT={port!r}: a TCP port (JAX's coordinator takes the one after it)")
    return {"coordinator_address": f"{environ['MASTER_ADDR']}:{int(port) + 1}", "num_processes": count,
            "process_id": int(rank), **timeouts}


def joined_processes() -> int:
    """How many processes ``jax.distributed`` joined (1 when none), without starting the devices."""
    import jax

    return jax_private.joined_process()[1] if jax.distributed.is_initialized() else 1


def _on_cloud_tpu_vm() -> bool:
    """Whether JAX found TPU chips and libtpu when it was imported: where its discovery of the
    TPU VM's hosts (the TPU runtime's metadata) can work."""
    return jax_private.on_cloud_tpu_vm()


def join_processes(settings: dict) -> None:
    """``jax.distributed.initialize(**settings)``: blocks until every process has joined (or the
    initialization timeout passes, an error naming the coordinator)."""
    import jax

    if jax.distributed.is_initialized():
        return
    where = settings.get("coordinator_address", "found by JAX from the TPU runtime")
    timeout = settings.get("initialization_timeout", 300)
    if "num_processes" in settings:
        print(f"[spmdzero] process {settings['process_id']} of {settings['num_processes']}: joining the others "
              f"through jax.distributed at {where} (waiting up to {timeout} s, {INIT_TIMEOUT})", file=sys.stderr)
    try:
        if settings.get("process_id", 0) > 0:
            # JAX stops the process (no exception) when the coordinator never answers: wait for it here
            settings = {**settings, "initialization_timeout": _wait_for_coordinator(where, timeout)}
        jax.distributed.initialize(**settings)
    except Exception as err:
        if "num_processes" not in settings:
            raise RuntimeError(f"spmdzero on a TPU VM: JAX could not find this host's place among the "
                               "TPU VM's hosts (jax.distributed.initialize() with no arguments). Name the hosts "
                               "yourself (spmdzero launch --num_nodes N --node_rank I --master_addr ADDR, or "
                               f"WORLD_SIZE/RANK/MASTER_ADDR/MASTER_PORT), or set {DISTRIBUTED}=0 to run this "
                               f"process alone. JAX said: {err}") from err
        raise RuntimeError(f"spmdzero: process {settings['process_id']} of {settings['num_processes']} "
                           f"could not join the others through jax.distributed at {where} (MASTER_ADDR, port "
                           "MASTER_PORT + 1, served by the RANK 0 process). Did every host start, with the same "
                           f"WORLD_SIZE, MASTER_ADDR and MASTER_PORT and its own RANK? ({INIT_TIMEOUT} sets how long "
                           f"to wait.) {type(err).__name__}: {err}") from err
    # JAX names a lost process when it stops the others ("task:N"; docs/multihost.md)
    index, count = jax_private.joined_process()  # jax.process_index() would start the devices
    print(f"[spmdzero] process {index} of {count} joined the others", file=sys.stderr)


def _wait_for_coordinator(address: str, timeout: int) -> int:
    """Wait until the coordinator (``host:port``) accepts connections; return the seconds left
    of ``timeout``, or raise TimeoutError."""
    import socket
    import time

    host, port = address.rsplit(":", 1)
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=5):
                return max(1, int(deadline - time.monotonic()))
        except OSError as err:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing answered at {address} for {timeout} s ({err})") from None
            time.sleep(0.5)


def configure() -> None:
    """Tell JAX which devices to take, before it starts (this starts nothing but the join of the
    processes, ``distributed_settings``): on a TPU VM only TPU and CPU, so that a TPU JAX cannot
    open (held by another process) is an error rather than a silent fallback to one CPU device."""
    import jax

    if jax_private.backends_started():
        if not jax.distributed.is_initialized() and (distributed_settings() or {}).get("num_processes"):
            raise RuntimeError(f"spmdzero with WORLD_SIZE={os.environ['WORLD_SIZE']}: JAX started its "
                               "devices before `import spmdzero`, so this process can no longer join the others "
                               "(jax.distributed must come first). Import spmdzero before any JAX computation.")
        return  # JAX ran before `import spmdzero`; devices() checks what it took
    device_type = _device_type()
    if device_type == "CPU":
        size_cpu_thread_pool(_cpu_count())
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", _cpu_count())
    elif device_type == "TPU":
        if "JAX_PLATFORMS" not in os.environ:
            jax.config.update("jax_platforms", "tpu,cpu")
    else:
        raise RuntimeError(f"spmdzero's JAX devices are TPU or CPU devices; PJRT_DEVICE={device_type} is neither")
    settings = distributed_settings(device_type=device_type)
    if settings is not None:
        join_processes(settings)


def devices() -> list:
    """The devices of this process: the TPU chips on a TPU VM, else ``CPU_NUM_DEVICES`` CPU devices;
    every process's, in JAX's order, when several processes joined (``jax.distributed``)."""
    import jax

    device_type = _device_type()
    if device_type == "CPU" and not jax.distributed.is_initialized():
        return cpu_devices(_cpu_count())
    configure()
    try:
        found = jax.devices()
    except RuntimeError as err:
        raise RuntimeError(f"spmdzero: JAX could not open this host's {device_type} devices. A TPU chip "
                           "serves one process: is another one using it (a training run, a notebook kernel that "
                           "imported spmdzero without the variable)? JAX said: " + str(err)) from err
    if found[0].platform != device_type.lower():
        raise RuntimeError(f"spmdzero: this is a {device_type} host but JAX started on "
                           f"{found[0].platform} devices (JAX_PLATFORMS={os.environ.get('JAX_PLATFORMS')!r}); "
                           "to run on CPU devices, set PJRT_DEVICE=CPU")
    return found


def device_count() -> int:
    return len(devices())


def local_devices() -> list:
    """This process's own devices (``devices()`` holds every process's when several joined)."""
    import jax

    found = devices()
    return [d for d in found if d.process_index == jax.process_index()]


def hosts() -> tuple[int, int]:
    """(this process's index, the number of processes), as JAX counts them (``jax.distributed``)."""
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
    reseed = None
    if jax_private.backends_started() and len(jax.devices("cpu")) < count:
        # torchax's environment, once created (torch_xla's assume_pure does), holds a PRNG key
        env = sys.modules["torchax"].default_env() if "torchax" in sys.modules else None
        key = None if env is None else getattr(env.param.prng, "_base_array", env.param.prng)
        live = [a for a in jax.live_arrays("cpu") if a is not key]
        if not live:
            jax.extend.backend.clear_backends()
            reseed = env
    if not jax_private.backends_started():
        size_cpu_thread_pool(count)
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


def enable_compile_cache(path: str) -> None:
    """JAX's persistent compilation cache at ``path`` (``spmd.compile_cache_dir`` on the torchax
    backend), for every program however small or quick to compile (JAX's defaults skip those,
    which on CPU is all of them). JAX reads its cache settings at its first compile and keeps
    them: they are reset here, so that a directory set after something compiled (a second
    ``initialize`` in a notebook) takes effect too."""
    import jax
    from jax.experimental.compilation_cache import compilation_cache

    path = os.path.abspath(path)
    os.makedirs(path, exist_ok=True)
    if jax.config.jax_compilation_cache_dir == path:
        return
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)  # every entry (0 means JAX's default)
    compilation_cache.reset_cache()


@contextlib.contextmanager
def shardy_partitioner(enabled: bool):
    """JAX's partitioner for the lowerings inside: Shardy (``sdy.sharding``, what a TPU VM's
    JAX runs by default) or GSPMD (``mhlo.sharding``, which torch_xla's partitioner reads). A
    process where torch_xla used JAX has Shardy switched off for good
    (``jax_workarounds.maybe_get_jax``), so each lowering says which it writes."""
    import jax

    before = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", enabled)
    try:
        yield
    finally:
        jax.config.update("jax_use_shardy_partitioner", before)
