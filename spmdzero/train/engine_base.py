"""The engine base: DeepSpeed's engine API as every backend answers it (batch numbers, config
getters, the accumulation boundary, samples counted, learning rates and momenta, the errors),
over a backend's step core. One definition, so the two backends cannot drift apart."""

from __future__ import annotations

import collections
import contextlib
import functools
import os
import warnings
from typing import Optional

import logging
import torch
from spmdzero import runtime
from spmdzero.train.batch_inputs import BatchLayout, batch_layout, forward_argument_names
from spmdzero.observe.console import say_once
from spmdzero.observe.monitor import notice_nonfinite
from spmdzero.observe.reports import sharding_report
from spmdzero.train.data import caller_stacklevel, map_tensors, pad_sequences
from spmdzero.train.shape_buckets import buckets_for, tower_inputs
from spmdzero.train import zero_params


# Keyword inputs that are loss targets (transformers' ``labels``, the usual names): both engines
# keep their dtype where they cast floating inputs to the model dtype (an fp16 cast can overflow
# a regression target; DeepSpeed's fp16.auto_cast leaves keyword inputs alone).
TARGET_NAMES = frozenset({"labels", "label", "target", "targets"})


def no_gradients(call: str = "engine.step() at a gradient accumulation boundary",
                 since: str = "the last optimizer step") -> str:
    """The error for an optimizer step with nothing to apply: ``call`` is what was called."""
    return f"{call} with no engine.backward() since {since}: there are no gradients to apply"


NO_GRADIENTS = no_gradients()


def check_loss_given(loss) -> None:
    """What ``engine.backward(loss)`` is handed must be a tensor. None says more than its type:
    the forward returned no loss (a Hugging Face model computes one only when it is given
    ``labels``), or the script's own loss function returned nothing."""
    if loss is None:
        raise TypeError("engine.backward(loss) was given None: the loss is None. The forward returned no loss (a "
                        "Hugging Face model computes one only when it is given labels=), or the code computing "
                        "it returned nothing; pass the loss tensor")
    if not isinstance(loss, torch.Tensor):
        raise TypeError(f"engine.backward(loss) expects the loss tensor, got a {type(loss).__name__}")


def check_scalable(engine, loss) -> None:
    """What DeepSpeed's ``engine.scale(loss)`` asks of its call: an optimizer (the loss scale is
    its), and a scalar loss that autograd can take back (a non-scalar's backward needs its own
    gradient, ``tensor.backward(grad)``)."""
    if engine.optimizer is None:
        raise RuntimeError("engine.scale(loss) needs an optimizer: pass optimizer= to initialize() or add an "
                           "'optimizer' section to the config")
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
        what = (f"a {type(loss).__name__}" if not isinstance(loss, torch.Tensor) else
                f"a tensor of shape {tuple(loss.shape)}" if loss.numel() != 1 else "a tensor that requires no grad")
        raise ValueError(f"engine.scale(loss) takes a scalar loss tensor with a gradient to take, got {what}; for a "
                         "non-scalar tensor, call tensor.backward(grad)")

logger = logging.getLogger("spmdzero")


@functools.lru_cache(maxsize=None)
def _seen_as_a_module(engine_class: type) -> type:
    """``engine_class`` with ``torch.nn.Module`` among its bases: what ``isinstance`` is shown
    (the torch_xla backend's engine is a module already, and stays its own class)."""
    if issubclass(engine_class, torch.nn.Module):
        return engine_class
    return type(engine_class.__name__, (engine_class, torch.nn.Module),
                {"__module__": engine_class.__module__, "__qualname__": engine_class.__qualname__})


class EngineBase:
    """DeepSpeed's engine API, as both backends' engines answer it. An engine sets ``_batch``
    (sharding.batch.BatchSizes), ``plan``, ``_config``, ``precision``, ``optimizer``,
    ``micro_steps``, ``_boundary_override`` and ``_rows_since_step`` (training rows fed since
    the last optimizer step), ``_global_grad_norm`` and ``_step_loss`` (the last boundary's
    device scalars, or None), and implements the step core: ``forward``, ``backward``,
    ``step``, ``zero_grad``."""

    # ---- reports both backends give alike ------------------------------------------------------
    def get_global_grad_norm(self) -> Optional[float]:
        """The pre-clip, unscaled global gradient norm of the last boundary step (reads the
        device; a non-finite fp32 norm is told once, as at print steps)."""
        norm = None if self._global_grad_norm is None else float(self._global_grad_norm)
        notice_nonfinite(self, norm, "gradient norm of the last step")
        return norm

    def step_loss(self) -> Optional[float]:
        """The mean of the losses passed to ``backward`` in the last optimizer step's
        accumulation window (what the step log and monitors report as ``train_loss``); reads the
        device."""
        loss = None if self._step_loss is None else float(self._step_loss)
        notice_nonfinite(self, loss, "loss")
        return loss

    def loss_scale(self) -> float:
        """DeepSpeed's: the configured static fp16 loss scale (0 for dynamic scaling), 1.0 under
        bf16, 0 in fp32. The scale in use is ``current_loss_scale()``."""
        if self.fp16_enabled():
            return self._config.fp16.loss_scale
        return 1.0 if self.bfloat16_enabled() else 0

    def sharding_report(self):
        """Per parameter: the layout and per-device bytes of the param, its gradient, master
        weight and optimizer states, read from the live arrays' layouts; totals against stage 0
        and ZeRO's accounting. Prints as a table, renders as HTML in Jupyter, ``.to_dict()``."""
        return sharding_report(self)

    # whether dict inputs are padded to shape buckets when the config does not say
    # (train.shape_buckets: a backend that cuts its outputs back outside the compiled step)
    SHAPE_BUCKETS_BY_DEFAULT = False

    @property
    def __class__(self):
        """DeepSpeed's engine is a ``torch.nn.Module``, and libraries branch on that: TRL's GRPO,
        RLOO and online DPO call a reward model given as an engine (``isinstance(reward,
        nn.Module)``) with its tokenized texts, and call anything else as a reward function, with
        prompts and completions (an engine got those, and its model stopped: "You must specify
        exactly one of input_ids or inputs_embeds"). So ``isinstance(engine, torch.nn.Module)``
        holds, as ``unittest.mock``'s ``spec`` makes it hold: the engine's type, attributes and
        behaviour stay its own (``type(engine)`` is unchanged; attributes it lacks still come
        from its module)."""
        return _seen_as_a_module(type(self))

    def register_post_step_hook(self, hook) -> "torch.utils.hooks.RemovableHandle":
        """Call ``hook(engine)`` on the host after every optimizer (boundary) step, once its
        program is dispatched; ``.remove()`` on the returned handle unregisters it. A hook that
        reads device values (a loss, a norm) waits for the step: read them only when needed."""
        from torch.utils.hooks import RemovableHandle

        hooks = self.__dict__.setdefault("_post_step_hooks", collections.OrderedDict())
        handle = RemovableHandle(hooks)  # holds the dict weakly: the engine owns it
        hooks[handle.id] = hook
        return handle

    def run_post_step_hooks(self) -> None:
        for hook in list(self.__dict__.get("_post_step_hooks", {}).values()):
            hook(self)

    @property
    def validated_config(self):
        """The config as spmdzero read it (``config.schema.DeepSpeedConfig``: defaults filled,
        checked); ``engine.config`` is DeepSpeed's, the dict as given."""
        return self._config

    # ---- a forward's inputs, before the backend places them ------------------------
    def padded_inputs(self, inputs: tuple, kwargs: dict, pad_id: int) -> tuple[tuple, dict, tuple]:
        """Shape buckets (``train.shape_buckets``): host sequences padded so that their lengths,
        and so the step's shapes, take few values. Returns the inputs and the cuts that take
        the outputs back to the lengths fed (``shape_buckets.cut_back``); the default buckets
        are said once, the first time they pad."""
        if "_buckets" not in self.__dict__:
            self._buckets = buckets_for(self._config.spmd, self.module, self.SHAPE_BUCKETS_BY_DEFAULT)
        if self._buckets is None:
            return inputs, kwargs, ()
        cuts: list = []
        # positional sequences padded with the keyword ones, under their forward's names:
        # ``model(seq, attention_mask=mask)`` (DeepSpeed-Chat's actor) padded the mask alone
        if getattr(self, "_forward_names", None) is None:
            self._forward_names = forward_argument_names(self.module)
        names = self._forward_names
        named = {names[i]: a for i, a in enumerate(inputs[:len(names)]) if isinstance(a, torch.Tensor)}
        if named and not set(named) & set(kwargs):
            kwargs = {**kwargs, **named}
        else:
            named = {}
        inputs, kwargs = pad_sequences((inputs, kwargs), self._buckets.length, pad_id, cuts,
                                       skip=None if self._buckets.multiple else tower_inputs)
        if named:
            inputs = tuple(kwargs[names[i]] if i < len(names) and names[i] in named else a
                           for i, a in enumerate(inputs))
            kwargs = {k: v for k, v in kwargs.items() if k not in named}
        if not self._buckets.multiple and self._config.spmd.shape_buckets is None and \
                any(padded != fed for _, padded, fed in cuts):
            say_once([f"shape buckets: sequences padded to {self._buckets.describe()}, the mask with 0 and the "
                      "labels with -100, outputs cut back to the length fed: a program per bucket, not per length. "
                      '"spmd": {"shape_buckets": false} feeds them as they are; "pad_to_multiple_of": N pads to '
                      "multiples of N"])
        return inputs, kwargs, tuple(cuts)

    def training_inputs(self, shapes: tuple, bucketed: bool) -> None:
        """A training forward's input shapes (what the recompile guard names when they change)
        and whether the shape buckets padded them (``new_shape_bucket``)."""
        self._input_shapes, self._inputs_bucketed = shapes, bucketed

    @property
    def batch_sizes(self):
        """The config's batch sizes (``sharding.batch.BatchSizes``)."""
        return self._batch

    def new_shape_bucket(self) -> bool:
        """Whether this step's training forward fed input shapes that the shape buckets had not
        fed before (``_inputs_bucketed``: the backend's forward padded them to a bucket): its
        compile is one of a bounded few (a program per bucket), which the recompile guard takes
        as warm-up, not as a recompile to warn of."""
        if self.__dict__.get("_buckets") is None or not self.__dict__.get("_inputs_bucketed"):
            return False
        seen = self.__dict__.setdefault("_bucket_shapes", set())
        new = self._input_shapes not in seen
        seen.add(self._input_shapes)
        return new

    def in_model_dtype(self, inputs: tuple, kwargs: dict, keep=lambda t: False) -> tuple[tuple, dict]:
        """Floating inputs cast to the model dtype, as DeepSpeed's ``fp16.auto_cast`` does; not
        the targets named in ``TARGET_NAMES`` (an fp16 cast can overflow a regression target),
        nor the tensors ``keep`` picks."""
        dtype = self.precision.param_dtype
        if dtype == torch.float32:
            return inputs, kwargs
        cast = lambda t: t.to(dtype) if t.is_floating_point() and not keep(t) else t  # noqa: E731
        return map_tensors(inputs, cast), {k: v if k in TARGET_NAMES else map_tensors(v, cast)
                                           for k, v in kwargs.items()}

    # ---- DeepSpeed batch numbers -------------------------------------------------
    def train_batch_size(self) -> int:
        return self._batch.global_batch

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._batch.rows_per_rank

    def gradient_accumulation_steps(self) -> int:
        return self._batch.accumulation_steps

    def zero_optimization_stage(self) -> int:
        return self.plan.stage

    def gradient_clipping(self) -> float:
        return self._config.gradient_clipping

    def bfloat16_enabled(self) -> bool:
        return self.precision.param_dtype == torch.bfloat16

    def fp16_enabled(self) -> bool:
        return self.precision.param_dtype == torch.float16

    # ---- DeepSpeed's config getters, as scripts call them -------------------------------
    def zero_optimization(self) -> bool:
        return self.plan.stage > 0

    def zero_optimization_partition_gradients(self) -> bool:
        return self.plan.stage >= 2

    def zero_optimization_partition_weights(self) -> bool:
        """Whether the devices hold the parameters sharded: at stage 3."""
        return self.plan.stage >= 3

    def steps_per_print(self) -> Optional[int]:
        return self._config.steps_per_print

    def wall_clock_breakdown(self) -> bool:
        return self._config.wall_clock_breakdown

    def optimizer_name(self) -> Optional[str]:
        """As DeepSpeed: the config's optimizer type, lower-case, else the client optimizer's
        class name; None without an optimizer."""
        if self._config.optimizer is not None:
            return self._config.optimizer.type.lower()
        client = getattr(getattr(self, "optimizer", None), "optimizer", None)
        return type(client).__name__ if client is not None else None

    def dynamic_loss_scale(self) -> bool:
        return self.fp16_enabled() and self._config.fp16.loss_scale == 0

    @property
    def local_rank(self) -> int:
        """This process's rank on its host: 0, as one process drives all of the host's devices."""
        return 0

    @property
    def global_rank(self) -> int:
        """This process's index among the hosts (torch.distributed's rank under ``spmdzero launch``)."""
        return runtime.hosts()[0]

    def save_16bit_model(self, save_dir, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """The module's state dict in the model dtype (bf16/fp16 under mixed precision), written
        by process 0 with ``torch.save``. Every process must call it (the copy to the host reads
        the replicated parameters of every host)."""
        state = self._zero3_consolidated_16bit_state_dict(exclude_frozen_parameters)
        if self.global_rank == 0:
            os.makedirs(save_dir, exist_ok=True)
            torch.save(state, os.path.join(save_dir, save_filename))
        return True

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False) -> dict:
        """DeepSpeed's whole 16-bit state dict at ZeRO-3 (the Hugging Face Trainer and accelerate
        save a stage-3 model through it): the module's state dict in the model dtype, on the
        host, on process 0 (empty on the others, as DeepSpeed gives it on rank 0 only). The host
        module's placeholders (``spmd.host_parameters``) are gathered from the devices for it, all
        at once, as DeepSpeed's rank 0 holds them. Every process must call it."""
        frozen = {n for n, p in self.module.named_parameters() if not p.requires_grad}
        with zero_params.gathered(self.module.parameters(), keep_edits=False):  # placeholders: whole from the devices
            state = collections.OrderedDict((name, t.detach().cpu()) for name, t in self.module.state_dict().items()
                                            if not (exclude_frozen_parameters and name in frozen))
        return state if self.global_rank == 0 else collections.OrderedDict()

    def save_fp16_model(self, save_dir, save_filename: str = "pytorch_model.bin") -> bool:
        return self.save_16bit_model(save_dir, save_filename)

    def batch_layout(self, module: torch.nn.Module, inputs: tuple, kwargs: dict,
                      on_device=lambda t: t.device.type == "xla") -> BatchLayout:
        """Which inputs carry the batch, and along which dim (``train.batch_inputs``, by
        ``spmd.batch_dim``); a likely sequence-first input is hinted at once."""
        if getattr(self, "_forward_names", None) is None:
            self._forward_names = forward_argument_names(module)
        batch = self._batch
        layout = batch_layout(inputs, kwargs, self._forward_names, self._config.spmd.batch_dim,
                              lambda device: batch.rows_per_micro_step if device else batch.rows_per_process,
                              on_device)
        if layout.hint and not getattr(self, "_hinted_batch_dim", False):
            self._hinted_batch_dim = True
            warnings.warn(f"spmdzero: {layout.hint} (noted once)", stacklevel=caller_stacklevel())
        return layout

    def check_training_rows(self, global_rows: int) -> None:
        """A training forward's rows against the configured micro-batch. DeepSpeed never
        compares them (``train_micro_batch_size_per_gpu`` is accounting), so any number is
        trained (samples/s count the rows fed; ``global_samples`` counts ``train_batch_size()``
        per optimizer step, as DeepSpeed does). More rows (a
        reward model's chosen and rejected sequences in one batch) are noted once in the log;
        fewer, once in a warning, since a config that disagrees with the loader on every batch
        makes ``train_batch_size()`` and the LR schedule's notion of an epoch mislead. Needs
        ``_warned_fewer_rows``."""
        batch = self._batch
        if global_rows > batch.rows_per_micro_step and not getattr(self, "_noted_more_rows", False):
            self._noted_more_rows = True
            logger.info("spmdzero: %s; trained as fed: samples/s count the rows fed (noted once)",
                        batch.mismatch(global_rows))
        if global_rows < batch.rows_per_micro_step and not self._warned_fewer_rows:
            self._warned_fewer_rows = True
            warnings.warn(f"spmdzero: {batch.mismatch(global_rows)} This is normal for the last, partial batch "
                          "of an epoch (drop_last=False); if every batch is this small, the config and your "
                          "DataLoader disagree. samples/s count the rows actually fed; global_samples adds "
                          "train_batch_size() per optimizer step, as DeepSpeed's does. "
                          "(warned once)", stacklevel=caller_stacklevel())

    def get_data_parallel_rank(self) -> int:
        """This process's rank among the data-parallel processes (one per host)."""
        return getattr(self, "global_rank", 0)

    def module_state_dict(self, destination=None, prefix: str = "", keep_vars: bool = False,
                          exclude_frozen_parameters: bool = False) -> dict:
        state = self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)
        if exclude_frozen_parameters:
            frozen = {prefix + n for n, p in self.module.named_parameters() if not p.requires_grad}
            state = type(state)((k, v) for k, v in state.items() if k not in frozen)
        return state

    # ---- accumulation boundary -----------------------------------------------------
    def is_gradient_accumulation_boundary(self) -> bool:
        if self._boundary_override is not None:
            return self._boundary_override
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def set_gradient_accumulation_boundary(self, is_boundary: bool) -> None:
        self._boundary_override = is_boundary

    def zero_grad_keeps_gradients(self, by_optimizer: bool, reduced: bool) -> bool:
        """Whether DeepSpeed's ``engine.zero_grad()`` (``by_optimizer``: its ZeRO
        ``optimizer.zero_grad()``) keeps the gradients accumulated since the last optimizer
        step. Both only set the parameters' ``.grad`` to None, so it depends on where the stage
        keeps a window's gradients (DeepSpeed 0.19.8, runtime/zero/stage_1_and_2.py):

        * ZeRO-2: in the optimizer's partitions, reduced after every backward
          (``independent_gradient_partition_epilogue`` sums ``all_grad_tensors``; its
          ``zero_grad`` clears ``p.grad`` and ``p.grad_accum`` only): kept;
        * ZeRO-1: in ``p.grad`` until the boundary's backward reduces them into
          ``averaged_gradients`` (``reduce_gradients``, called only at the boundary): dropped
          before that (``reduced`` False), kept after. With bf16 parameters and fp32
          accumulation DeepSpeed uses its BF16_Optimizer instead, which sums every backward into
          fp32 buffers (``update_hp_grads``): the engine's zero_grad keeps them, the
          optimizer's (``clear_hp_grads``) drops them;
        * stage 0: in ``p.grad`` until the step (runtime/engine.py, ``allreduce_gradients``
          reduces them in place): dropped.

        ZeRO-3 keeps them as ZeRO-2 here; its ``optimizer.zero_grad()`` drops them later, at
        the next backward (``zero_grad_overwrites_next_backward``)."""
        stage = self.plan.stage
        if stage >= 2:
            return True
        if stage == 0:
            return False
        if self.precision.param_dtype == torch.bfloat16 and self.precision.grad_accum_dtype == torch.float32:
            return not by_optimizer
        return reduced

    def zero_grad_overwrites_next_backward(self, by_optimizer: bool) -> bool:
        """Whether DeepSpeed's ZeRO ``optimizer.zero_grad()`` makes the next backward replace the
        gradients accumulated since the last optimizer step rather than add to them. At stage 3
        it does (DeepSpeed 0.19.8, runtime/zero/stage3.py): it resets ``micro_step_id``, and a
        backward at micro-step 0 copies its gradient into the partitions. So the window's earlier
        micro-batches are dropped by that backward, not by the zero_grad: a step with no backward
        in between still applies them. Its ``engine.zero_grad()`` only clears ``param.grad``."""
        return by_optimizer and self.plan.stage >= 3

    # ---- shared by every backend ----------------------------------------------------------
    def get_lr(self) -> list[float]:
        return [float(g["lr"]) for g in self.optimizer.param_groups] if self.optimizer else []

    def get_mom(self) -> list:
        if not self.optimizer:
            return []
        moms = []
        for group in self.optimizer.param_groups:
            if "betas" in group:
                moms.append(tuple(float(b) for b in group["betas"]))
            else:
                moms.append(group.get("momentum"))
        return moms

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate without communication. Refused at ZeRO-2, as in DeepSpeed; under
        SPMD the compiler owns communication, so at stages 0/1 this changes nothing."""
        if self.plan.stage >= 2:
            raise AssertionError("no_sync context manager is incompatible with gradient partitioning "
                                 "logic of ZeRO stage 2")
        yield

    def destroy(self) -> None:
        """DeepSpeed releases its communication buffers and hooks here; spmdzero holds none
        (device memory goes with the tensors), so there is nothing to release."""

    def zero_gather_16bit_weights_on_model_save(self) -> bool:
        """DeepSpeed's ``stage3_gather_16bit_weights_on_model_save``, under any of its names
        (read by callers at ZeRO-3 only: the Hugging Face Trainer then saves whole 16-bit weights
        through ``_zero3_consolidated_16bit_state_dict``, or else a checkpoint for zero_to_fp32;
        ``save_16bit_model`` always saves)."""
        zero = self.config.get("zero_optimization") or {}  # the DeepSpeed dict, as DeepSpeed reads it
        names = ("stage3_gather_16bit_weights_on_model_save", "stage3_gather_fp16_weights_on_model_save",
                 "gather_16bit_weights_on_model_save")
        return any(zero.get(name) is True for name in names)

    def consume_samples(self) -> int:
        """What this optimizer step adds to ``global_samples``: ``train_batch_size()``, as
        DeepSpeed counts at each optimizer step whatever the tensors' shapes (engine.py,
        ``_take_model_step``). ``samples_last_step`` (samples/s, the monitors' throughput) keeps
        the rows the step's training forwards actually fed, or that same number when the
        module was called directly (rows unseen)."""
        rows, self._rows_since_step = self._rows_since_step, 0
        self.samples_last_step = rows or self.train_batch_size()
        return self.train_batch_size()
