"""``deepspeed.runtime.zero.partition_parameters``.

DeepSpeed's ZeRO-3 partitions each parameter by hand and gathers it on demand. spmdzero's ZeRO-3
shards parameters by annotation on the devices. The host module the script holds keeps whole
parameters, unless the engine keeps DeepSpeed's placeholders there (``spmd.host_parameters``: at
stage 3 from 1 GiB of parameters; ``spmdzero/train/zero_params.py``). ``Init`` has nothing to
partition (a model built inside it is built on the host, and ``initialize`` places it sharded,
never whole on a device). ``GatheredParameters`` brings placeholders whole from the devices for
its block, and with ``modifier_rank`` their edits go back on exit; whole parameters it leaves
alone (edits reach the devices at the next forward, as any edit of the host's parameters does).
With ``modifier_rank`` and several processes (Hugging Face's ``from_pretrained`` under ZeRO-3
loads the weights on rank 0 only), the modifier's values are broadcast to the other processes on
exit, as DeepSpeed does. Whole parameters carry no ``ds_id``: code that checks it (as
DeepSpeed-Chat does) takes its non-ZeRO-3 path, and placeholders carry one, so it takes the
ZeRO-3 path and gathers. Every other tensor's ``ds_status`` reads AVAILABLE and its
``ds_active_sub_modules`` is empty, and every module's ``ds_external_parameters()`` is empty (TRL
reads them unchecked).
"""

from __future__ import annotations

import contextlib

import torch

from spmdzero.compat.deepspeed.accelerator import get_accelerator  # noqa: F401  (transformers reads it here)
from spmdzero.train.zero_params import ZeroParamStatus, ZeroParamType, gathered  # noqa: F401  (DeepSpeed's names)

# torch's constructors, as DeepSpeed keeps them before its Init wraps them (transformers reads
# ``_orig_torch_arange`` to leave ``arange`` unwrapped; Init wraps nothing here)
_orig_torch_tensor = torch.tensor
_orig_torch_empty = torch.empty
_orig_torch_zeros = torch.zeros
_orig_torch_ones = torch.ones
_orig_torch_full = torch.full
_orig_torch_arange = torch.arange


# Every tensor answers DeepSpeed's status question with AVAILABLE: the parameters a script holds
# are whole at every stage, and so are the traced values a forward sees. TRL reads ``p.ds_status``
# of the LM head under ZeRO-3 without checking for it (``maybe_gather_lm_head_ctx``), which raised
# AttributeError. No ``ds_id``: code that asks whether a parameter is partitioned
# (``hasattr(p, "ds_id")``, DeepSpeed-Chat, transformers) still hears no.
if not hasattr(torch.Tensor, "ds_status"):
    torch.Tensor.ds_status = ZeroParamStatus.AVAILABLE
# TRL clears each parameter's ``ds_active_sub_modules`` and reads the module's
# ``ds_external_parameters()`` around generation at ZeRO-3 (``remove_hooks``): no submodule holds
# a parameter gathered here, and no module reaches another's parameters through DeepSpeed.
if not hasattr(torch.Tensor, "ds_active_sub_modules"):
    torch.Tensor.ds_active_sub_modules = property(lambda self: set())
if not hasattr(torch.nn.Module, "ds_external_parameters"):
    torch.nn.Module.ds_external_parameters = lambda self: iter(())


class Init:
    """``with deepspeed.zero.Init(...)``: models built inside keep whole parameters."""

    def __init__(self, module=None, data_parallel_group=None, mem_efficient_linear=True, remote_device=None,
                 pin_memory=False, config_dict_or_path=None, config=None, enabled=True, dtype=None, mpu=None,
                 zero_param_parallel_group=None, zero_quantized_weights=False, zero_quantized_nontrainable_weights=False,
                 sequence_data_parallel_group=None, param_swapper=None):
        self.enabled = enabled

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def zero_wrapper_for_fp_tensor_constructor(fn, target_fp_dtype=None, target_device=None):
    """DeepSpeed's Init wraps torch's constructors with this to build on its device and dtype;
    Init wraps nothing here, so the constructor is returned as it is (transformers swaps this
    function around ``from_pretrained`` under ZeRO-3)."""
    return fn


class GatheredParameters:
    """``with deepspeed.zero.GatheredParameters(params, modifier_rank=0)``: placeholders among
    the parameters are whole inside (``zero_params.gathered``), and with ``modifier_rank`` the
    changes made inside are kept. With ``modifier_rank`` and several processes, that process's
    values are broadcast to the others on exit (code inside often changes them on rank 0 only,
    as Hugging Face's ZeRO-3 loading does)."""

    def __init__(self, params, modifier_rank=None, fwd_module=None, enabled=True):
        if isinstance(params, torch.Tensor):
            params = [params]
        self.params = [p for p in (params or []) if isinstance(p, torch.Tensor)]
        self.modifier_rank = modifier_rank if enabled else None
        self.enabled = enabled
        self._stack = contextlib.ExitStack()

    def __enter__(self):
        if self.enabled:
            self._stack.enter_context(gathered(self.params, keep_edits=self.modifier_rank is not None))
        return self

    def __exit__(self, exc_type, *exc):
        import torch.distributed as dist

        try:
            if exc_type is None and self.modifier_rank is not None and dist.is_initialized() and \
                    dist.get_world_size() > 1:
                with torch.no_grad():
                    for p in self.params:
                        dist.broadcast(p.data, src=self.modifier_rank)
        finally:
            self._stack.close()
        return False


def register_external_parameter(module, parameter) -> None:
    """ZeRO-3 bookkeeping for parameters used outside their module: nothing to do here."""


def unregister_external_parameter(module, parameter) -> None:
    """See ``register_external_parameter``."""
