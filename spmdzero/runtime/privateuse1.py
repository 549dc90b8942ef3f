"""torch's accelerator lookup in a process where torchax is imported.

torchax names torch's PrivateUse1 device ``jax`` (``torch.utils.rename_privateuse1_backend``) but
registers no C++ hooks for it. torch 2.9's ``torch._C._get_accelerator()`` then raises "Please
register PrivateUse1HooksInterface by `RegisterPrivateUse1HooksInterface` first", and
``torch.distributed.barrier()`` calls it first thing, on any backend: every barrier of a script
(DeepSpeed's cifar example, the HF Trainer's ``main_process_first``) failed once an engine of the
torchax backend existed. There is no device behind the name that a barrier could use (torchax's
tensors live in JAX), so the lookup answers what torch answers on a machine without an
accelerator: the CPU. Any other error of the lookup is raised as before.
"""

from __future__ import annotations

import functools

_MISSING_HOOKS = "PrivateUse1HooksInterface"


def keep_accelerator_lookup_working() -> None:
    """Make ``torch._C._get_accelerator`` answer ``cpu`` where PrivateUse1 has no hooks. Idempotent."""
    import torch

    lookup = torch._C._get_accelerator
    if getattr(lookup, "_spmdzero_cpu_without_hooks", False):
        return

    @functools.wraps(lookup)
    def get_accelerator(*args, **kwargs):
        try:
            return lookup(*args, **kwargs)
        except RuntimeError as err:
            if _MISSING_HOOKS not in str(err):
                raise
            return torch.device("cpu")

    get_accelerator._spmdzero_cpu_without_hooks = True
    torch._C._get_accelerator = get_accelerator
