"""A GPU script's calls that choose a CUDA device or reset its memory statistics, on a host without one.

DeepSpeed scripts written for GPUs pick their device with ``torch.cuda.set_device(local_rank)``
before anything else (DeepSpeedExamples' ``training/bf16_master_weight/train.py``, Megatron-style
scripts), and benchmark scripts reset the peak-memory counters between phases
(``torch.cuda.reset_peak_memory_stats()``). On a TPU VM, or on this project's CPU machines,
torch has no CUDA device, and those calls raise ("Found no NVIDIA driver on your system", or
"Torch not compiled with CUDA enabled") before the script reaches ``deepspeed.initialize``.

Under SPMD they have nothing to do: one process drives every device of its host through
compiled programs, so there is no device to choose (as ``torch.accelerator.set_device_index``
does nothing here, ``spmdzero.runtime.privateuse1``), and torch holds no accelerator memory whose
counters could be reset (``torch.cuda.max_memory_allocated()`` already answers 0 bytes without a
GPU; JAX holds the device memory: ``spmdzero.observe.reports.live_device_bytes``). So where torch
reports no CUDA device (``torch.cuda.is_available()`` False), these calls do nothing instead of
raising. A host with a GPU keeps torch's own behaviour, and every other CUDA call (a tensor
moved to ``"cuda"``, ``torch.cuda.synchronize()``, whose timing meaning has no no-op) keeps
torch's error."""

from __future__ import annotations

import functools

# the torch.cuda functions that only choose a device or reset memory counters
NOTHING_TO_DO_WITHOUT_A_GPU = ("set_device", "reset_peak_memory_stats", "reset_max_memory_allocated",
                               "reset_max_memory_cached", "reset_accumulated_memory_stats")


def install() -> None:
    """``torch.cuda``'s device choice and memory-counter resets do nothing where torch has no CUDA
    device (see the module docstring). Idempotent."""
    import torch

    for name in NOTHING_TO_DO_WITHOUT_A_GPU:
        original = getattr(torch.cuda, name, None)
        if original is None or getattr(original, "_spmdzero_without_a_gpu", False):
            continue
        setattr(torch.cuda, name, _nothing_without_a_gpu(original, torch.cuda.is_available))


def _nothing_without_a_gpu(call, gpu_available):
    @functools.wraps(call)
    def answered(*args, **kwargs):
        if gpu_available():
            return call(*args, **kwargs)
        return None

    answered._spmdzero_without_a_gpu = True
    return answered
