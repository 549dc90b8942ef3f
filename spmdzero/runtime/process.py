"""Process-wide runtime start: one process per host, the devices held by one runtime.

``start`` runs once, on ``import spmdzero``, before any tensor is placed on a device. By
default (``SPMDZERO_BACKEND`` unset or ``torchax``) JAX takes the devices
(``spmdzero.runtime.jax_runtime``) and torch_xla is not even imported. With
``SPMDZERO_BACKEND=torch_xla``, torch_xla's runtime starts instead (``bootstrap``):

* pick the PJRT device: every TPU chip on a TPU VM, else the CPU client with
  ``CPU_NUM_DEVICES`` virtual devices (8 when unset), the embedded default;
* keep XLA's C++ warnings quiet unless ``TF_CPP_MIN_LOG_LEVEL`` is set (compiler noise on
  request only);
* on a TPU, add spmdzero's libtpu compiler flags to ``LIBTPU_INIT_ARGS``
  (``spmdzero.runtime.libtpu_flags``, the flags ``spmdzero aot`` compiles with);
* switch torch_xla into SPMD mode (it must precede the first XLA tensor);
* start the runtime now. PyTorch's autograd engine sizes its per-device queues
  at the first ``backward()`` of the process. If that backward runs on CPU before
  the XLA runtime has started, the XLA queues are never created and every later
  XLA backward dies with a ``device_ready_queues_`` assert. Starting the runtime
  at import makes that ordering impossible.

In a process whose devices are JAX's, a config naming ``spmd.backend='torch_xla'`` starts
torch_xla's runtime at ``initialize`` (``start_torch_xla``) where the two can share the host:
on CPU, one process. On a TPU the chips are JAX's, and the error says to set the variable."""

from __future__ import annotations
import os
from spmdzero.runtime.devices import select_device_type, cpu_device_count, size_cpu_thread_pool
from spmdzero.runtime import jax_runtime, libtpu_flags
from spmdzero.runtime import cuda_calls, privateuse1

_torch_xla_started = False


def start() -> None:
    """The process's runtime, at ``import spmdzero`` (and ``spmdzero launch``): JAX's devices
    (``spmdzero.runtime.jax_runtime``, the default), or torch_xla's (``bootstrap``) under
    ``SPMDZERO_BACKEND=torch_xla``."""
    # either backend imports torchax (torch_xla's fused update and scan call JAX through it), which
    # names torch's PrivateUse1 device "jax" with nothing behind it: the host stands in
    privateuse1.install()
    # XLA's C++ warnings, read when the first XLA library loads (jaxlib, or torch_xla): a "GSPMD
    # sharding propagation is going to be deprecated" line on every torch_xla compile says nothing
    # the user can act on (torch_xla 2.9 has no Shardy path). Errors still show;
    # TF_CPP_MIN_LOG_LEVEL=0 (or 1) shows the warnings again.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    if jax_runtime.decide():
        jax_runtime.configure()
        privateuse1.name_the_device()
    else:
        bootstrap()
    # a GPU script's "cuda" means the runtime's device; after the log level above: it imports
    # torchax's lowerings, and with them jaxlib, which reads the level when it loads
    cuda_calls.install()


def start_torch_xla(why: str = "spmd.backend='torch_xla'") -> None:
    """torch_xla's runtime, for ``why``, in a process that may have given its devices to JAX:
    nothing to do under ``SPMDZERO_BACKEND=torch_xla`` (started at import); on one CPU host it
    starts now, beside JAX's CPU devices. A TPU's chips, or hosts joined through
    ``jax.distributed``, are JAX's: refused, saying how to choose torch_xla's runtime."""
    if _torch_xla_started or not jax_runtime.selected():
        bootstrap()  # idempotent
        return
    device_type = select_device_type()
    joined = jax_runtime.joined_processes()
    if device_type == "CPU" and joined <= 1:
        bootstrap()
        return
    where = (f"the {device_type} devices, which JAX holds in this process" if device_type != "CPU" else
             f"this host, but torch_xla 2.9 cannot join the {joined} processes that jax.distributed joined")
    raise RuntimeError(f"{why} needs torch_xla's runtime on {where} ({jax_runtime.VARIABLE} is unset or 'torchax': "
                       f"JAX takes the devices at `import spmdzero`). Set {jax_runtime.VARIABLE}=torch_xla in the "
                       "environment before `import spmdzero` (`spmdzero launch` does it for a config that names "
                       "spmd.backend 'torch_xla'; in a notebook: restart the kernel, set "
                       f"os.environ['{jax_runtime.VARIABLE}'] = 'torch_xla', then import spmdzero), or use "
                       "spmd.backend='torchax'")


def bootstrap() -> None:
    """Configure and start torch_xla's runtime in SPMD mode. Idempotent."""
    global _torch_xla_started
    device_type = select_device_type()
    os.environ["PJRT_DEVICE"] = device_type
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # (see start), for a bootstrap without start
    if device_type == "CPU":
        os.environ["CPU_NUM_DEVICES"] = str(cpu_device_count())  # checked: torch_xla reads "x" as no device
        size_cpu_thread_pool(cpu_device_count())
    elif device_type == "TPU":  # the compiler flags spmdzero aot compiles with, before libtpu loads

        libtpu_flags.apply()

    import importlib.util

    if importlib.util.find_spec("torch_xla") is None:
        raise RuntimeError(f"the torch_xla backend needs torch_xla, which is not installed: pip install "
                           f"'spmdzero[torch_xla]' (torch_xla 2.9, which runs on torch 2.9 only; this is torch "
                           f"{_torch_version()}), or use the default backend (spmd.backend 'torchax')")
    import torch_xla.runtime as xr

    if not xr.is_spmd():
        try:
            xr.use_spmd()
        except Exception as err:  # torch_xla refuses once XLA tensors exist
            raise RuntimeError(
                "spmdzero could not switch torch_xla into SPMD mode: XLA tensors were "
                "created before `import spmdzero`. Import spmdzero first (in a notebook: "
                "restart the kernel and import it in the first cell)."
            ) from err
    xr.global_runtime_device_count()  # starts the runtime; see the module docstring
    register_torch_device_module()
    _torch_xla_started = True


def torch_xla_started() -> bool:
    return _torch_xla_started


def register_torch_device_module() -> None:
    """``torch.xla``, the device module ``torch.utils.checkpoint`` and ``torch.random.fork_rng``
    look up to save and restore a device's RNG state: without it, activation checkpointing
    (Hugging Face's ``gradient_checkpointing_enable()``) fails on XLA tensors with "module
    'torch' has no attribute 'xla'". The state is torch_xla's RNG seed, so the recomputed
    forward draws the same dropout masks. One logical device per process (SPMD)."""
    import contextlib
    import types

    import torch

    if hasattr(torch, "xla"):
        return
    import torch_xla.core.xla_model as xm

    module = types.ModuleType("torch.xla")
    module._initialized = True
    module.device = lambda index=None: contextlib.nullcontext()
    module.device_count = lambda: 1
    module.get_rng_state = lambda device=None: xm.get_rng_state()
    module.set_rng_state = lambda state, device=None: xm.set_rng_state(int(state))
    torch._register_device_module("xla", module)


def device_count() -> int:
    if jax_runtime.selected():  # torch_xla's runtime must not start: it would take the TPU
        return jax_runtime.device_count()
    import torch_xla.runtime as xr

    return xr.global_runtime_device_count()


def hosts() -> tuple[int, int]:
    """(this process's index, the number of processes): one process per host."""
    if jax_runtime.selected():
        return jax_runtime.hosts()
    import torch_xla.runtime as xr

    return xr.process_index(), xr.process_count()


def device():
    import torch_xla

    return torch_xla.device()


def enable_compile_cache(path: str) -> bool:
    """XLA's persistent compilation cache at ``path``. It can only be switched on before the
    first XLA computation of the process; returns False (and warns) when that has passed."""
    import warnings

    import torch_xla
    import torch_xla.runtime as xr

    path = os.path.abspath(path)
    if torch_xla._XLAC._xla_computation_cache_is_initialized():
        if os.environ.get("XLA_PERSISTENT_CACHE_PATH") != path:
            warnings.warn(f"spmdzero: spmd.compile_cache_dir={path!r} is ignored: XLA already compiled in this "
                          "process. Set it in the first initialize() of the process (or set "
                          "XLA_PERSISTENT_CACHE_PATH before importing spmdzero).", stacklevel=3)
            return False
        return True
    os.makedirs(path, exist_ok=True)
    xr.initialize_cache(path, readonly=False)
    return True


BACKWARD_TRAP_MARKER = "device_ready_queues_"


def explain_backward_trap(err: RuntimeError) -> RuntimeError | None:
    """A clear error for the autograd queue trap, or None if ``err`` is something else."""
    if BACKWARD_TRAP_MARKER not in str(err):
        return None
    late = jax_runtime.selected()  # torch_xla started at initialize, not at import
    fix = (f"Set {jax_runtime.VARIABLE}=torch_xla before `import spmdzero`, which then starts torch_xla's runtime "
           "first" if late else "Import spmdzero before running any backward pass")
    return RuntimeError(
        "XLA backward failed because a backward pass ran on CPU tensors before torch_xla's "
        "runtime started in this process (PyTorch's autograd engine then never creates "
        f"its XLA device queues). {fix}; in a notebook, restart the kernel and do it in the first cell."
    )


def _torch_version() -> str:
    import torch

    return torch.__version__
