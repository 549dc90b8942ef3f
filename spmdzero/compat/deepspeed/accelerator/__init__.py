"""``deepspeed.accelerator``: DeepSpeed's accelerator interface, describing the XLA device.

Under spmdzero one process drives every device of its host through one SPMD program;
the process sees a single logical XLA device (``xla:0``) whose tensors the compiler
places on all local chips. So ``current_device()`` is 0 and ``set_device`` accepts only 0,
while ``device_count()`` reports the chips this host drives.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

from spmdzero.backends.torch_xla import COMPILE_BACKEND


class NeutralStream:
    """A CUDA stream's interface with nothing behind it: XLA orders the device's work itself."""

    def __init__(self, *args, **kwargs):
        pass

    def synchronize(self) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def record_event(self, event=None):
        return event if event is not None else HostEvent()

    def query(self) -> bool:
        return True

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        return None


class HostEvent:
    """A CUDA event's interface on the host clock: ``elapsed_time`` is the host time between the
    two ``record`` calls, in ms. Device work is asynchronous under XLA, so it times the
    tracing, not the device, unless the device is waited for in between."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self._time: Optional[float] = None

    def record(self, stream=None) -> None:
        import time

        self._time = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def wait(self, stream=None) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: "HostEvent") -> float:
        if self._time is None or end._time is None:
            raise RuntimeError("elapsed_time: both events must be recorded first")
        return (end._time - self._time) * 1000.0


class XlaAccelerator:
    def __init__(self):
        self._name = "xla"
        self._communication_backend_name = "gloo"  # host-side process group, one process per host
        self._compile_backend = COMPILE_BACKEND

    # ---- device -----------------------------------------------------------------------
    def is_synchronized_device(self) -> bool:
        return False  # XLA runs asynchronously: host timers need synchronize()

    def use_host_timers(self) -> bool:
        return self.is_synchronized_device()

    def resolves_data_dependency(self) -> bool:
        return False

    def handles_memory_backpressure(self) -> bool:
        return False

    def device_name(self, device_index=None) -> str:
        return "xla" if device_index is None else f"xla:{device_index}"

    def device(self, device_index=None):
        return torch.device(self.device_name(device_index))

    def set_device(self, device_index) -> None:
        """One logical device per process: index 0 (what ``LOCAL_RANK`` is under ``spmdzero launch``)."""
        if int(device_index) != 0:
            raise ValueError(f"set_device({device_index}): under spmdzero one process per host drives every local "
                             "device through the logical device xla:0; run one process per host "
                             "(`spmdzero launch`), whose LOCAL_RANK is 0")

    def current_device(self) -> int:
        return 0

    def current_device_name(self) -> str:
        return "xla:0"

    def device_count(self) -> int:
        """Chips this host drives (DeepSpeed: GPUs visible on this node)."""
        import torch_xla.runtime as xr

        return xr.addressable_runtime_device_count()

    def synchronize(self, device_index=None) -> None:
        """Wait for the device work already issued. It does not cut the pending trace: the
        step boundary (``engine.step()``) does that."""
        import torch_xla.core.xla_model as xm

        xm.wait_device_ops()

    def is_available(self) -> bool:
        return True

    # ---- RNG ----------------------------------------------------------------------------
    def random(self):
        return torch.random

    def set_rng_state(self, new_state, device_index=None) -> None:
        import torch_xla.core.xla_model as xm

        xm.set_rng_state(int(new_state))

    def get_rng_state(self, device_index=None):
        import torch_xla.core.xla_model as xm

        return xm.get_rng_state()

    def manual_seed(self, seed) -> None:
        import torch_xla.core.xla_model as xm

        xm.set_rng_state(int(seed))

    def manual_seed_all(self, seed) -> None:
        self.manual_seed(seed)  # one RNG state drives every device of the SPMD program

    def initial_seed(self) -> int:
        return torch.initial_seed()

    def default_generator(self, device_index):
        return torch.default_generator

    # ---- streams and events: XLA schedules its own; these are the neutral stand-ins -----------
    @property
    def Stream(self):  # noqa: N802 (DeepSpeed's name)
        return NeutralStream

    def stream(self, stream):
        return contextlib.nullcontext()

    def current_stream(self, device_index=None):
        return NeutralStream()

    def default_stream(self, device_index=None):
        return NeutralStream()

    @property
    def Event(self):  # noqa: N802 (DeepSpeed's name)
        return HostEvent

    def range_push(self, msg) -> None:
        pass

    def range_pop(self) -> None:
        pass

    def lazy_call(self, callback):
        return callback()

    # ---- memory (the runtime's figures where it has them; 0 where it does not, e.g. XLA:CPU) ---
    def _memory(self) -> dict:
        import torch_xla
        import torch_xla.core.xla_model as xm

        try:
            return dict(xm.get_memory_info(torch_xla.device()))
        except Exception:  # the CPU client keeps no allocator statistics
            return {}

    def empty_cache(self) -> None:
        pass  # the PJRT allocator frees a buffer when its last tensor dies

    def memory_allocated(self, device_index=None) -> int:
        return int(self._memory().get("bytes_used", 0))

    def max_memory_allocated(self, device_index=None) -> int:
        return int(self._memory().get("peak_bytes_used", self.memory_allocated()))

    def reset_max_memory_allocated(self, device_index=None) -> None:
        pass

    def reset_peak_memory_stats(self, device_index=None) -> None:
        pass

    memory_reserved = memory_cached = memory_allocated
    max_memory_reserved = max_memory_cached = max_memory_allocated
    reset_max_memory_cached = reset_max_memory_allocated

    def memory_stats(self, device_index=None) -> dict:
        return self._memory()

    def total_memory(self, device_index=None) -> int:
        return int(self._memory().get("bytes_limit", 0))

    def available_memory(self, device_index=None) -> int:
        return max(self.total_memory() - self.memory_allocated(), 0)

    # ---- dtypes and features ----------------------------------------------------------------
    def is_bf16_supported(self) -> bool:
        return True

    def is_fp16_supported(self) -> bool:
        return True

    def supported_dtypes(self) -> list:
        return [torch.float32, torch.bfloat16, torch.float16]

    def is_triton_supported(self) -> bool:
        return False

    def communication_backend_name(self) -> str:
        return self._communication_backend_name

    def pin_memory(self, tensor, align_bytes=1):
        return tensor  # host-to-device transfers go through PJRT, not pinned CUDA buffers

    def is_pinned(self, tensor) -> bool:
        return False

    def on_accelerator(self, tensor) -> bool:
        return tensor.device.type == "xla"

    def op_builder_dir(self) -> str:
        return ""

    def create_op_builder(self, class_name):
        return None  # no DeepSpeed CUDA/C++ ops: spmdzero's optimizers are plain XLA graphs

    def get_op_builder(self, class_name):
        return None

    def export_envs(self) -> list:
        return []

    def visible_devices_envs(self) -> list:
        return []

    def set_visible_devices_envs(self, current_env, local_accelerator_ids) -> None:
        pass

    def get_compile_backend(self) -> str:
        return self._compile_backend

    def set_compile_backend(self, backend) -> None:
        self._compile_backend = backend


class JaxHostAccelerator(XlaAccelerator):
    """Where JAX owns the devices (the default; not under ``SPMDZERO_BACKEND=torch_xla``),
    torch_xla's runtime must not start (``spmdzero.runtime.jax_runtime``): a script's tensors stay on the host (``cpu``) and the
    torchax engine puts each batch on the devices; counts, memory and RNG come from JAX and
    torch, never from torch_xla."""

    def device_name(self, device_index=None) -> str:
        return "cpu"

    def current_device_name(self) -> str:
        return "cpu"

    def device_count(self) -> int:
        """Chips this host drives (DeepSpeed: GPUs visible on this node)."""
        from spmdzero.runtime import jax_runtime

        return len(jax_runtime.local_devices())

    def synchronize(self, device_index=None) -> None:
        """Wait for the device work whose results are still held (every live JAX array), as
        ``torch.cuda.synchronize()`` does here (``spmdzero.runtime.cuda_calls``)."""
        from spmdzero.runtime.cuda_calls import wait_for_devices

        wait_for_devices()

    def set_rng_state(self, new_state, device_index=None) -> None:
        torch.set_rng_state(new_state)

    def get_rng_state(self, device_index=None):
        return torch.get_rng_state()

    def manual_seed(self, seed) -> None:
        torch.manual_seed(int(seed))  # the torchax engine takes its JAX key from torch's seed at initialize

    def _memory(self) -> dict:
        from spmdzero.runtime import jax_runtime

        stats = jax_runtime.local_devices()[0].memory_stats() or {}  # None on CPU
        return {"bytes_used": stats.get("bytes_in_use", 0), "peak_bytes_used": stats.get("peak_bytes_in_use", 0),
                "bytes_limit": stats.get("bytes_limit", 0)}

    def on_accelerator(self, tensor) -> bool:
        return False  # the engine's arrays are JAX's; a torch tensor here is a host tensor


_ACCELERATOR = None


def get_accelerator() -> XlaAccelerator:
    """The accelerator of this process's runtime (decided at ``import spmdzero``)."""
    global _ACCELERATOR
    if _ACCELERATOR is None:
        from spmdzero.runtime import jax_runtime

        _ACCELERATOR = JaxHostAccelerator() if jax_runtime.selected() else XlaAccelerator()
    return _ACCELERATOR


def set_accelerator(accelerator) -> None:
    global _ACCELERATOR
    _ACCELERATOR = accelerator


def is_current_accelerator_supported() -> bool:
    return True
