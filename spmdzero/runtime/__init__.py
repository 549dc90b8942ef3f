"""Layer ``runtime``, the lowest: which runtime owns this process's devices, started once per
process (JAX's by default, or torch_xla's PJRT client in SPMD mode under ``SPMDZERO_BACKEND=torch_xla``),
the device count and the host's place among the hosts. It imports nothing else of spmdzero.
"""

from spmdzero.runtime.devices import DEFAULT_CPU_DEVICES, EnvironmentSettingError, visible_device_count
from spmdzero.runtime.privateuse1 import keep_accelerator_lookup_working
from spmdzero.runtime.process import (bootstrap, device, device_count, enable_compile_cache, explain_backward_trap,
                                      hosts, register_torch_device_module, start, start_torch_xla,
                                      torch_xla_started)

__all__ = ["DEFAULT_CPU_DEVICES", "EnvironmentSettingError", "visible_device_count", "keep_accelerator_lookup_working",
           "bootstrap", "device",
           "device_count", "enable_compile_cache", "explain_backward_trap", "hosts", "register_torch_device_module",
           "start", "start_torch_xla", "torch_xla_started"]
