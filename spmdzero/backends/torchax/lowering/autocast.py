"""``torch.autocast`` on the torchax backend, as DeepSpeed's engine applies it.

torchax applies autocast's cast policy op by op from its environment's ``autocast_dtype``; it
does not see ``torch.autocast`` contexts. Two things follow from them here:

* **A script's region on the device** (``with torch.autocast("cuda", dtype=torch.bfloat16):``
  around ``engine(x)`` and its loss, DeepSpeedExamples' ``bf16_master_weight/train.py``; "cuda"
  names the accelerator on a host without a GPU, ``spmdzero.runtime.cuda_calls``): ops on the
  engine's outputs (the loss) compute under it, in torchax's environment.
* **The engine's forward** computes under the config's ``torch_autocast`` section, whatever
  region it is called in, as DeepSpeed's ``autocast_if_enabled`` does: off when the section is
  off (DeepSpeed then switches an outer region off inside the forward), its dtype when on. A
  region the module switches off inside its forward (``torch.autocast(device_type=x.device.type,
  enabled=False)``: transformers' rotary embeddings, which want fp32) stays fp32, as in torch.

Parameters, gradients and optimizer states keep their dtypes: autocast casts what the ops
compute in.

torchax's policy names aten ops; a few ops reach it as the torch functions it lowers whole
(``F.linear``, ``torch.einsum``, convolutions), which it then missed: they computed in fp32.
Softmax, log-softmax and the cross-entropy built on them computed in bf16, where torch's CUDA
list (which torchax's copies) runs them in fp32. They join the policy (it acts only where
autocast is on). Its "promote" rule failed on a list of tensors (``torch.cat``): it reads them.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch

# torch functions torchax lowers whole, which autocast runs in the lower precision (through the
# matmuls and convolutions they stand for in torch)
_LOWERED_WHOLE = (torch.nn.functional.linear, torch.einsum, torch.ops.aten.einsum.default,
                  torch.ops.aten.convolution.default)
# ops torch's autocast runs in fp32 that reach torchax under names its policy lacks: softmax and
# log-softmax (torch's CUDA list computes them in fp32), and the losses built on them
# (``F.cross_entropy`` arrives as log-softmax and ``nll_loss_forward``)
_FP32 = (torch.ops.aten._softmax.default, torch.ops.aten.softmax.int, torch.ops.aten._log_softmax.default,
         torch.ops.aten.log_softmax.int, torch.ops.aten.nll_loss_forward.default,
         torch.ops.aten.nll_loss2d_forward.default)
_INSTALLED = []  # one entry once install() has run


def install() -> None:
    """Regions of ``torch.autocast`` on torchax's device set its environment's dtype while they
    last (nested ones put the outer dtype back). Idempotent."""
    if _INSTALLED:
        return
    import torchax
    from torchax import amp

    for f in _LOWERED_WHOLE:
        amp.autocast_policy.setdefault(f, amp.CastPolicy.LOWER_PRECISION_FP)
    for f in _FP32:
        amp.autocast_policy.setdefault(f, amp.CastPolicy.FP32)
    amp.execute_policy = _promoting_lists(amp.execute_policy, amp.CastPolicy.PROMOTE)
    autocast = torch.amp.autocast_mode.autocast
    enter, exit_ = autocast.__enter__, autocast.__exit__
    outer: list = []

    def entered(self):
        result = enter(self)
        if self.device == "jax":
            env = torchax.default_env()
            outer.append(env.param.autocast_dtype)
            env.param.autocast_dtype = self.fast_dtype if self._enabled else None
        return result

    def exited(self, *args):
        if self.device == "jax" and outer:
            torchax.default_env().param.autocast_dtype = outer.pop()
        return exit_(self, *args)

    autocast.__enter__, autocast.__exit__ = entered, exited
    _INSTALLED.append(True)


def _promoting_lists(execute_policy, promote):
    """torchax's cast policy with its "promote" rule (``torch.cat``, ``torch.stack``: run in the
    widest floating dtype of the inputs) reading tensors inside lists too: it read ``.dtype`` of
    each argument, and ``torch.cat((cls_token, patches))`` (ViT's embeddings) raised
    AttributeError ("'list' object has no attribute 'dtype'")."""
    from torch.utils import _pytree as pytree

    def is_float(a) -> bool:
        return isinstance(a, torch.Tensor) and a.is_floating_point()

    def execute(policy, args, kwargs, target_lower_fp):
        if policy is not promote:
            return execute_policy(policy, args, kwargs, target_lower_fp)
        floats = {a.dtype for a in pytree.tree_leaves((args, kwargs)) if is_float(a)}
        if len(floats) < 2:
            return args, kwargs
        # torch's promotion of floating dtypes (torch.promote_types is an op to torchax here)
        widest = torch.float64 if torch.float64 in floats else torch.float32
        return pytree.tree_map_only(is_float, lambda a: a.to(widest), (args, kwargs))

    return execute


@contextlib.contextmanager
def autocasting(env, dtype: Optional[torch.dtype]):
    """The engine's forward traced under the config's autocast ``dtype`` (None: none, whatever
    region the script called it in)."""
    previous = env.param.autocast_dtype
    env.param.autocast_dtype = dtype
    try:
        yield
    finally:
        env.param.autocast_dtype = previous
