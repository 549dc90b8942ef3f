"""Route Hugging Face transformers and accelerate to their DeepSpeed path under ``spmdzero launch``.

Both libraries look for torch_xla before DeepSpeed: on a TPU VM, accelerate's ``PartialState``
takes its XLA branch and never its DeepSpeed one, and the Trainer then saves with ``xm.save``
and steps a plain optimizer, so ``TrainingArguments(deepspeed=...)`` would silently train
without spmdzero. ``USE_TORCH_XLA=0`` (both libraries' own switch) makes them take the
DeepSpeed branch; the engine then drives the XLA devices itself. ``ACCELERATE_TORCH_DEVICE``
names the device the engine's outputs live on (as DeepSpeed's engine and accelerate agree on
``cuda:N``), so the Trainer's loss bookkeeping stays on the device, without a host copy per
step. The metadata that makes ``importlib.metadata.version("deepspeed")`` answer comes with
the ``deepspeed`` alias (``alias.py``).

Both are set only when the user has not set them, and must be set before transformers or
accelerate is imported (they read them at import).

With ``USE_TORCH_XLA=0``, ``TrainingArguments(bf16=True)`` would refuse ("Your setup doesn't
support bf16/gpu"): it asks ``is_torch_bf16_gpu_available()``, which knows CUDA-like devices
and torch_xla, not the engine's. The engine's XLA devices compute in bf16 (TPUs natively,
XLA:CPU too), so once transformers' ``import_utils`` is loaded, that question answers yes.

On the torchax backend accelerate's device stays the host (a tensor made for torchax's ``jax``
device outside torchax's own mode is a host tensor: ``spmdzero.runtime.privateuse1``), while the
engine's loss lives on the JAX devices. The Trainer keeps its running loss on its own device and refuses a step loss on
another ("Calculated loss must be on the original device"). ``Trainer.training_step`` is
therefore wrapped to hand the loss over on the Trainer's device: a host copy of one number per
micro-step, where the Trainer's default ``logging_nan_inf_filter`` already reads that number
every micro-step.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.util
import os
import sys
import warnings

import torch

from spmdzero.train.engine_base import EngineBase

# the device each backend's engine returns its outputs on, as torch names it without the
# backend imported (the torchax backend's outputs say "jax:0", a name torch knows only once
# torchax is imported: accelerate's device is left to accelerate there)
_OUTPUT_DEVICE = {"torch_xla": "xla:0", "torchax": None}


def route_to_deepspeed(backend: str) -> None:
    """Set the environment that sends transformers and accelerate down their DeepSpeed path,
    engine outputs on ``backend``'s device. Warns once if either library is already imported
    (too late: it has read its environment)."""
    os.environ.setdefault("USE_TORCH_XLA", "0")
    if _OUTPUT_DEVICE[backend] is not None:
        os.environ.setdefault("ACCELERATE_TORCH_DEVICE", _OUTPUT_DEVICE[backend])
    if not any(isinstance(finder, _PatchOnLoad) for finder in sys.meta_path):
        sys.meta_path.insert(0, _PatchOnLoad())
    early = [name for name in ("accelerate", "transformers") if name in sys.modules]
    if early:
        warnings.warn(f"spmdzero: {' and '.join(early)} was imported before spmdzero set USE_TORCH_XLA=0; its "
                      "Trainer/Accelerator may take its XLA path instead of DeepSpeed's. Import spmdzero (or call "
                      "spmdzero.alias_deepspeed()) before them.", stacklevel=3)


def _bf16_available() -> bool:
    return True


def _answer_bf16(module) -> None:
    """transformers' bf16 question, answered for the engine's devices (before ``training_args``
    imports the function by name)."""
    if hasattr(module, "is_torch_bf16_gpu_available"):
        module.is_torch_bf16_gpu_available = _bf16_available


def _on_trainer_device(step):
    """``step`` (a ``training_step``), returning its loss on the Trainer's device (``args.device``)."""
    if getattr(step, "_spmdzero_wrapped", False):
        return step

    @functools.wraps(step)
    def training_step(self, *args, **kwargs):
        loss = step(self, *args, **kwargs)
        device = self.args.device
        if isinstance(loss, torch.Tensor) and loss.device != device and device.type == "cpu":
            loss = loss.cpu().clone()  # a copy of its own, not a view of the device's buffer
        return loss

    training_step._spmdzero_wrapped = True
    return training_step


def _module_loss_counted_once(compute_loss):
    """``compute_loss`` (the Trainer's), without its per-process scaling of a loss the engine's
    module returned. With ``average_tokens_across_devices`` the Trainer divides by the tokens of
    every process and multiplies the loss, in place, by the process count, for DeepSpeed's ranks,
    each of which sums only its own tokens and then averages its gradient with the others'. The
    engine's module sums the tokens of every process (one global batch): on several hosts the
    logged loss came out the process count too large, and on one host the in-place ``*= 1``
    made the loss no longer the module's (its backward then took the slower path, ``backward``).
    A loss the Trainer computes from the outputs (``compute_loss_func``, label smoothing) is
    each host's own rows', as a rank's, and keeps the scaling."""
    if getattr(compute_loss, "_spmdzero_wrapped", False):
        return compute_loss

    @functools.wraps(compute_loss)
    def wrapped(self, model, inputs, *args, **kwargs):
        from_module = not ((self.label_smoother is not None or self.compute_loss_func is not None)
                           and "labels" in inputs)  # as the Trainer decides, before it pops the labels
        if not (from_module and isinstance(model, EngineBase) and getattr(self.args, "average_tokens_across_devices",
                                                                          False)):
            return compute_loss(self, model, inputs, *args, **kwargs)
        self.args.average_tokens_across_devices = False  # read only by that scaling in compute_loss
        try:
            return compute_loss(self, model, inputs, *args, **kwargs)
        finally:
            self.args.average_tokens_across_devices = True

    wrapped._spmdzero_wrapped = True
    return wrapped


def _loss_on_trainer_device(module) -> None:
    """``Trainer.training_step`` returns the step's loss on the Trainer's device, and so does
    the ``training_step`` of every subclass that defines its own (TRL's online DPO does, without
    calling the Trainer's: the Trainer refused its loss, "Calculated loss must be on the
    original device: cpu but device in use is jax:0")."""
    trainer = getattr(module, "Trainer", None)
    if trainer is None or "training_step" not in vars(trainer):
        return
    trainer.training_step = _on_trainer_device(trainer.training_step)
    if "compute_loss" in vars(trainer):
        trainer.compute_loss = _module_loss_counted_once(trainer.compute_loss)
    own = vars(trainer).get("__init_subclass__")  # the Trainer's own, if a release defines one

    def __init_subclass__(cls, **kwargs):
        if own is not None:
            own.__get__(None, cls)(**kwargs)
        else:
            super(trainer, cls).__init_subclass__(**kwargs)
        if "training_step" in vars(cls):
            cls.training_step = _on_trainer_device(vars(cls)["training_step"])

    trainer.__init_subclass__ = classmethod(__init_subclass__)


def _count_the_processes(module) -> None:
    """accelerate's ``PartialState`` looks for its process group's backend among CUDA-like
    devices and torch_xla only. On a TPU VM or a CPU host it found none and took the run for
    one process: ``num_processes`` 1 and ``process_index`` 0 on every host, so on several hosts
    the DeepSpeed batch size it fills counted one process (refused: "train_batch_size is not
    equal to ... world_size"), and each host would have loaded the same batches. On its
    DeepSpeed route the backend is the host group ``deepspeed.comm`` runs (gloo); then it
    counts the processes from ``torch.distributed``, as with DeepSpeed on GPUs."""
    state = getattr(module, "PartialState", None)
    prepare = getattr(state, "_prepare_backend", None)
    if prepare is None or getattr(prepare, "_spmdzero_wrapped", False):
        return

    @functools.wraps(prepare)
    def _prepare_backend(self, cpu=False, sagemaker_dp=False, backend=None):
        found, kind = prepare(self, cpu, sagemaker_dp, backend)
        deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
        if found is None and not cpu and deepspeed and int(os.environ.get("LOCAL_RANK", -1)) != -1:
            return "gloo", kind
        return found, kind

    _prepare_backend._spmdzero_wrapped = True
    state._prepare_backend = _prepare_backend


# what is changed in each module as it loads: {module: function of the loaded module}
_PATCHES = {"transformers.utils.import_utils": _answer_bf16, "transformers.trainer": _loss_on_trainer_device,
            "accelerate.state": _count_the_processes}


class _PatchOnLoad(importlib.abc.MetaPathFinder):
    """Loads the modules of ``_PATCHES`` as usual, then applies their patch."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _PATCHES:
            return None
        sys.meta_path.remove(self)  # find the real module with the other finders
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            sys.meta_path.insert(0, self)
        if spec is None or spec.loader is None:
            return None
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _PATCHES[fullname](module)

        spec.loader.exec_module = exec_module
        return spec
