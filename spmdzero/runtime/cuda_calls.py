"""A GPU script's CUDA calls on a host without a GPU: ``cuda`` stands for the accelerator.

DeepSpeed scripts written for GPUs name CUDA directly. DeepSpeedExamples' GAN
(``training/gan/gan_deepspeed_train.py``) runs ``torch.cuda.set_device(args.local_rank)``,
``device = torch.device("cuda", args.local_rank)``, ``netG.to(device)``, ``data[0].to(device)``,
``torch.randn(..., device=device)`` and ``torch.cuda.synchronize()`` around its timing;
``training/bf16_master_weight/train.py`` resets the peak-memory counters. On a TPU VM, or on this
project's CPU machines, torch has no CUDA device, and each of those calls raised ("Found no
NVIDIA driver on your system", or "Torch not compiled with CUDA enabled") before or during
training. Under SPMD "the GPU" has one meaning: the accelerator that one process drives whole,
through the engine. So, only where torch reports no CUDA device (``torch.cuda.is_available()``
False, checked when the call has failed, so a working call pays nothing):

* **device choice and memory-counter resets do nothing** (``set_device``, ``reset_peak_memory_stats``
  and the other resets): there is no device to choose (``torch.accelerator.set_device_index`` does
  nothing here either, ``spmdzero.runtime.privateuse1``), and torch holds no accelerator memory
  (``torch.cuda.max_memory_allocated()`` answers 0 bytes without a GPU; JAX holds it);
* **a move to ``cuda``, a factory or ``new_*`` with ``device="cuda"``, ``.cuda()``** do what they do
  with the runtime's own device (``accelerator_device``): ``jax:0`` where JAX holds the devices,
  so a host tensor is copied on the host and an engine output stays where it is, as with
  ``y.to(out.device)``; ``xla:0`` under torch_xla's runtime. ``model.to(device)`` leaves the
  module on the host, where ``initialize`` places it from;
* ``torch.cuda.current_device()`` is 0 (the process's one logical device, as
  ``torch.accelerator.current_device_index()``), ``tensor.pin_memory()`` returns the tensor
  unpinned, and ``torch.cuda.synchronize()`` waits for the devices' work
  (``wait_for_devices``), the wait that a script's timing asks for;
* ``torch.autocast("cuda", ...)`` is the accelerator's autocast.

A host with a GPU keeps torch's own behaviour, and every other CUDA call (device properties,
streams) keeps torch's error: it asks about a GPU that is not there.
"""

from __future__ import annotations

import functools

# the torch.cuda functions that only choose a device or reset memory counters
NOTHING_TO_DO_WITHOUT_A_GPU = ("set_device", "reset_peak_memory_stats", "reset_max_memory_allocated",
                               "reset_max_memory_cached", "reset_accumulated_memory_stats")
# torch's factories that take a device
FACTORIES = ("arange", "as_tensor", "asarray", "empty", "empty_like", "empty_strided", "eye", "full", "full_like",
             "linspace", "logspace", "normal", "ones", "ones_like", "rand", "rand_like", "randint", "randint_like",
             "randn", "randn_like", "randperm", "range", "scalar_tensor", "tensor", "tril_indices", "triu_indices",
             "zeros", "zeros_like")
NEW_METHODS = ("new_empty", "new_empty_strided", "new_full", "new_ones", "new_tensor", "new_zeros")
_MARK = "_spmdzero_without_a_gpu"


def install() -> None:
    """A GPU script's CUDA calls mean the accelerator where torch has no CUDA device (see the
    module docstring). Idempotent."""
    import torch

    for name in NOTHING_TO_DO_WITHOUT_A_GPU:
        _answer(torch.cuda, name, lambda call, *args, **kwargs: None)
    _answer(torch.cuda, "current_device", lambda call: 0)
    _answer(torch.cuda, "synchronize", lambda call, device=None: wait_for_devices())
    # torchax keys its lowerings by torch's factories (``torch.zeros``...) when its ``jtorch``
    # is imported: imported after the wrapping it would key them by the wrappers, and find none
    # of them when a wrapper calls torch's own
    try:
        import torchax.ops.jtorch  # noqa: F401
    except ImportError:
        pass
    # torch's device contexts (``with torch.device("meta")``, ``torch.set_default_device``; the
    # meta device transformers and accelerate build models on) name the factories they place by
    # identity, and see torch's own function when a wrapper calls it: it stays in their set.
    # Without it every factory under ``with torch.device("meta")`` made a host tensor, and
    # transformers 5's ``from_pretrained`` left BERT's ``position_ids`` buffer uninitialized.
    from torch.utils._device import _device_constructors

    placed = _device_constructors()  # torch's own functions, if first asked for now
    for name in FACTORIES:
        original = getattr(torch, name)
        _answer(torch, name, _on_the_accelerator)
        if original in placed or getattr(torch, name) in placed:
            placed.update((getattr(original, "__wrapped__", original), getattr(torch, name)))
    for name in ("to", *NEW_METHODS):
        _answer(torch.Tensor, name, _on_the_accelerator)
    _answer(torch.Tensor, "cuda", lambda call, tensor, device=None, non_blocking=False, **kwargs:
            tensor.to(accelerator_device(), non_blocking=non_blocking, **kwargs))
    _answer(torch.Tensor, "pin_memory", lambda call, tensor, *args, **kwargs: tensor)
    _autocast_on_the_accelerator(torch.amp.autocast_mode.autocast)


def _autocast_on_the_accelerator(autocast) -> None:
    """``torch.autocast("cuda", ...)`` (a GPU script's mixed-precision region around its forward
    and loss) is the accelerator's autocast without a GPU: torch refused it for bf16 ("Current
    CUDA Device does not support bfloat16") and switched it off for fp16."""
    init = autocast.__init__
    if getattr(init, _MARK, False):
        return
    import torch

    @functools.wraps(init)
    def on_the_accelerator(self, device_type, *args, **kwargs):
        if _names_cuda(device_type) and not torch.cuda.is_available():
            device_type = accelerator_device().type
        init(self, device_type, *args, **kwargs)

    setattr(on_the_accelerator, _MARK, True)
    autocast.__init__ = on_the_accelerator


def accelerator_device():
    """The device a GPU script's ``cuda`` stands for: the runtime's own (see the module docstring)."""
    import torch

    from spmdzero.runtime import jax_runtime

    return torch.device("jax", 0) if jax_runtime.selected() else torch.device("xla", 0)


def wait_for_devices() -> None:
    """Wait for the device work whose results are still held: every live JAX array made ready,
    or torch_xla's issued operations done."""
    from spmdzero.runtime import jax_runtime

    if jax_runtime.selected():
        import jax

        jax.block_until_ready(jax.live_arrays())
    else:
        import torch_xla.core.xla_model as xm

        xm.wait_device_ops()


def _names_cuda(value) -> bool:
    import torch

    if isinstance(value, str):
        return value == "cuda" or value.startswith("cuda:")
    return isinstance(value, torch.device) and value.type == "cuda"


def _on_the_accelerator(call, *args, **kwargs):
    """``call`` again with each CUDA device replaced by the accelerator's; torch's error stands
    where the call names none (``_Unanswered``)."""
    if not any(_names_cuda(a) for a in (*args, *kwargs.values())):
        raise _Unanswered
    device = accelerator_device()
    return call(*(device if _names_cuda(a) else a for a in args),
                **{k: device if _names_cuda(v) else v for k, v in kwargs.items()})


class _Unanswered(Exception):
    """The failed call is not one that ``install`` answers: torch's own error is raised."""


def _answer(namespace, name: str, answer) -> None:
    """``namespace.<name>`` answers ``answer(original, *args, **kwargs)`` where the original
    raises and torch has no CUDA device; as before otherwise (the first try costs nothing more)."""
    import torch

    original = getattr(namespace, name, None)
    if original is None or getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def answered(*args, **kwargs):
        try:
            return original(*args, **kwargs)
        except Exception:
            if torch.cuda.is_available():
                raise
            try:
                return answer(original, *args, **kwargs)
            except _Unanswered:
                pass
            raise

    setattr(answered, _MARK, True)
    setattr(namespace, name, answered)
    _same_builtin_for_torchscript(original, answered)


def _same_builtin_for_torchscript(original, answered) -> None:
    """TorchScript (``torch.jit.script``, which transformers 4.57's DeBERTa-v2 applies to its
    position helpers) compiles a Python function it meets from its source, and knows torch's
    builtins by identity: ``answered`` is registered as the builtin ``original`` is, else the
    script failed ("module, class, method, function ... was expected, got
    builtin_function_or_method")."""
    from torch.jit import _builtins

    op = _builtins._find_builtin(original)
    if op is not None:
        _builtins._register_builtin(answered, op)
