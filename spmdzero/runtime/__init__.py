"""Layer ``runtime``, the lowest: which runtime owns this process's devices, started once per
process (torch_xla's PJRT client in SPMD mode, or JAX's under ``SPMDZERO_BACKEND=torchax``),
the device count and the host's place among the hosts. It imports nothing else of spmdzero.
"""

from spmdzero.runtime.devices import DEFAULT_CPU_DEVICES, EnvironmentSettingError, visible_device_count
from spmdzero.runtime.process import (bootstrap, device, device_count, enable_compile_cache, explain_backward_trap,
                                      hosts, register_torch_device_module, start)

__all__ = ["DEFAULT_CPU_DEVICES", "EnvironmentSettingError", "visible_device_count", "bootstrap", "device",
           "device_count", "enable_compile_cache", "explain_backward_trap", "hosts", "register_torch_device_module",
           "start"]
