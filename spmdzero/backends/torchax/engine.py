"""The torchax backend (``"spmd": {"backend": "torchax"}``): the same engine API and sharding
plan, with the module traced once by JAX instead of re-traced by torch_xla every step.

torch_xla traces the forward and the backward again at every step (several ms per GPT-2 layer
on the host, docs/benchmarks.md). Here the module runs as a pure function of its parameters
under ``jax.jit`` through torchax (torch ops lowered to JAX), so a step is two cached programs:

* ``engine(batch)`` in training runs ONE program: the outputs and ``jax.value_and_grad`` of
  the loss the module returns, the gradients constrained to the plan's gradient spec (the
  ZeRO-2 shards) and added to the accumulated ones, held with the loss it returns.
  ``engine.backward(loss)`` commits that loss's gradient; only when the accumulation changed
  since its forward (another loss's backward, a ``zero_grad``) is it taken again, by the same
  program on the same inputs, as torch's backward of that loss would give it;
* ``engine.step()`` at the boundary runs ONE program: DeepSpeed's global-norm clipping and the
  config optimizer's own math (``SpmdOptimizer._math``, the function the torch_xla engine's
  fused update runs under JAX too), parameters replicated, optimizer states laid out by the
  plan, the old buffers donated. The hyperparameters (lr from the schedule included) are a
  traced input, so a changing lr does not recompile.

A forward that reads a tensor's value on the host (``if t:``, ``.item()``, ``x[mask]``) cannot be
one program: the program whose trace stops at the read runs eagerly instead (``host_reads``).

The fused training program needs the module to return its loss: a scalar, a dict with a
``"loss"`` key, an object with ``.loss`` (Hugging Face outputs), or a tuple whose first item is
the scalar loss. Otherwise (or when inputs require grad) the training forward runs a VJP program
instead, and a loss the script computes from the outputs reaches a compiled backward program
through torch autograd (``outside_loss``). The outputs come back as torchax tensors (JAX arrays
seen as torch tensors; torch ops on them run eagerly in JAX), tied into torch autograd.

Its devices: JAX's own, as ``import spmdzero`` gave them to JAX (every TPU chip on a TPU VM, else
``CPU_NUM_DEVICES`` CPU devices; ``spmdzero.runtime.jax_runtime``), and torch_xla is never imported;
under ``SPMDZERO_BACKEND=torch_xla``, JAX CPU devices as many as torch_xla's runtime has, since that
runtime holds any TPU (``mesh.jax_devices``). Several hosts (``jax.distributed``,
``spmdzero.runtime.jax_runtime``) make one global mesh: each process
starts from process 0's parameters (as DeepSpeed broadcasts them) and places only its own rows
of a batch (``jax.make_array_from_process_local_data``); losses and norms read back are the
global values, the same on every process. fp32, or
bf16 or fp16 with fp32 master weights and DeepSpeed's overflow skip (fp16: its loss scaler); what it refuses is checked by
``check_config`` (docs/config.md, ``spmd.backend``). Checkpoints are the torch_xla backend's
(``spmdzero.io``), this engine's arrays moved through ``checkpoint.TorchaxStateShards``.

The host module's parameters are a step behind the devices until read; their torch ops (an
edit, a read, ``.data``) bring the trained values back first, and the next forward takes what
the host changed (``TorchaxEngine._host_use``, ``_take_host_changes``).

Why one module: the two jitted programs and the host-side bookkeeping between them (each
forward's gradient until its backward, the host parameters' edits, outputs as torchax tensors,
arrays released off the training thread) are one unit; the DeepSpeed API around them is
``train/engine_base.py``.
"""

from __future__ import annotations

import collections
import functools
import gc
import warnings
import weakref
from collections.abc import Mapping
from types import SimpleNamespace
from typing import Any, NamedTuple, Optional

import numpy as np
import torch
from torch.utils import _pytree as torch_pytree

from spmdzero.sharding.batch import BatchSizes
from spmdzero.config.schema import DeepSpeedConfig
from spmdzero.train.batch_inputs import note_replicated
from spmdzero.train.data import like, model_pad_id
from spmdzero.observe.monitor import RecompileGuard, StepLogger, ThroughputTimer, notice_nonfinite
from spmdzero.observe.reports import sharding_report
from spmdzero.optim.ops import jax_ops
from spmdzero.optim.optimizers import SpmdOptimizer, ZeroOptimizer
from spmdzero.optim.schedules import LRSchedule
from spmdzero.optim.update import LossScale, boundary_update, init_loss_scale, sum_of_squares, update_group
from spmdzero.train.engine_base import EngineBase, NO_GRADIENTS
from spmdzero.sharding.plan import ShardingPlan, replicated
from spmdzero.optim.precision import precision_policy
from spmdzero.train.build import move_in_place
from spmdzero.train.scan_layers import stacked_layers
from spmdzero.backends.torchax import batchnorm
from spmdzero.backends.torchax import frozen
from spmdzero.backends.torchax import host_reads
from spmdzero.backends.torchax import host_tensors
from spmdzero.backends.torchax.mesh import jax_devices, mesh_devices
from spmdzero.sharding.mesh import resolve_hybrid_shape
from spmdzero.backends.torchax.outside_loss import tie
from spmdzero.backends.torchax import process_rows
from spmdzero.backends.torchax import torch_optim
from spmdzero.backends.torchax import lowerings, trace_view
from spmdzero.backends.torchax import remat
from spmdzero.backends.torchax import cross_entropy
from spmdzero.backends.torchax.release import drain, release_in_background

NOT_FROM_ENGINE = ("engine.backward(loss) was given a loss that depends on no output of this engine's forward "
                   "with grad enabled: compute it from what engine(...) returned in training (not under "
                   "torch.no_grad(), not from a .detach()ed or .cpu() copy)")
BACKWARD_TWICE = ("engine.backward(loss) was given a loss whose gradients an earlier backward already committed: "
                  "call it once per forward's loss, or pass retain_graph=True to the first call (as torch, which "
                  "refuses to backward through a graph a second time)")
PARAMETERS_CHANGED = ("engine.backward(loss) was given the loss of a forward whose gradients must be taken again "
                      "(the gradients accumulated since that forward changed: another backward, or a zero_grad that "
                      "dropped them), but the parameters changed since that forward (an optimizer step, a "
                      "checkpoint load, an edit on the host): the torchax backend takes the gradient inside the "
                      "traced forward and keeps no graph at the old values. Call backward on each loss before the "
                      "optimizer step")


def _as_dicts(obj):
    """Every non-dict mapping in ``obj`` (a ``BatchEncoding``) as a dict, for torch's pytree."""
    if isinstance(obj, Mapping):
        pairs = ((k, _as_dicts(v)) for k, v in obj.items())
        return like(obj, pairs) if isinstance(obj, dict) else dict(pairs)
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_as_dicts(v) for v in obj)
    return obj


def _as_jax(t: torch.Tensor, env):
    """A tensor's value as a JAX array: a torchax tensor's own, a host tensor's copy."""
    return t._elem if _is_torchax_tensor(t) else env.t2j_copy(t.detach())


def _is_torchax_tensor(t: torch.Tensor) -> bool:
    from torchax import tensor as ttensor

    return isinstance(t, ttensor.Tensor)


def _jax_dtype(dtype: torch.dtype):
    import jax.numpy as jnp

    return jnp.dtype(str(dtype).removeprefix("torch."))


def _placed_dtype(dtype: torch.dtype):
    """The dtype of the JAX array ``_put`` makes of a tensor of ``dtype`` (int64 is int32 unless
    JAX runs with x64), for a shape-only engine, which makes none."""
    import jax
    from torchax.ops import mappings

    return jax.dtypes.canonicalize_dtype(mappings.t2j_dtype(dtype))


INT64_TRUNCATED = r"Explicitly requested dtype .*int64.* requested in .* is not available"


@functools.lru_cache(maxsize=None)
def _output_tensor_class():
    """torchax tensors whose torch ops run in the torchax environment, whoever calls them, so
    the outputs a training loop reads (``loss.item()``, ``logits.argmax(-1)``, ``loss * 2``)
    work outside it; their results are such tensors too."""
    import jax
    import torchax
    from torchax import tensor as ttensor

    env = torchax.default_env()

    class Output(ttensor.Tensor):
        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            written = host_tensors.write_back(func, args, kwargs or {})  # `total += loss`: into a host tensor
            # host tensors mixed in (a target on the CPU) are copied to JAX, as the module's inputs
            args, kwargs = torch_pytree.tree_map_only(
                torch.Tensor, lambda t: t if isinstance(t, ttensor.Tensor) else ttensor.Tensor(env.t2j_copy(t), env),
                (args, kwargs or {}))
            with env, warnings.catch_warnings():
                # torch's int64 (labels, argmax) is int32 under JAX without x64, as torchax intends:
                # JAX's warning at each such op is noise in a loop (cifar's accuracy count printed it)
                warnings.filterwarnings("ignore", INT64_TRUNCATED, UserWarning)
                result = func(*args, **kwargs)
            if written is not None:
                written(args, kwargs)
            return torch_pytree.tree_map_only(ttensor.Tensor, lambda t: Output(t._elem, env), result)

        def detach(self):
            return Output(jax.lax.stop_gradient(self._elem), env)

        @property
        def data(self):
            # torchax logs "In-place to .data modifications still results a copy" at each read; a
            # loop reads outputs.data (cifar's torch.max(outputs.data, 1)): a detached view, as torch's
            return self.detach()

        @data.setter
        def data(self, other):
            ttensor.Tensor.data.fset(self, other)

    return Output


class TracedStep(NamedTuple):
    """``TorchaxEngine.trace_step``'s answer: the traced step (``jax.stages.Traced``: ``.lower()``
    gives its StableHLO) and what a report needs that the program does not say."""

    traced: Any
    loss_index: int  # the loss among the forward's output tensors (the step's last outputs)
    trained: dict  # trained parameter name -> shape
    communication_dtype: torch.dtype  # the gradients' dtype on the wire
    micro_batch: int  # rows per data-parallel device per micro-step (the config's)
    accumulation_steps: int
    rows: Optional[int]  # global rows of the traced batch, when known


class _NoLoss(Exception):
    """Raised while tracing a training forward whose output holds no scalar loss."""


def _find_loss(output) -> Optional[torch.Tensor]:
    def scalar(t):
        return isinstance(t, torch.Tensor) and t.numel() == 1 and t.is_floating_point()

    if scalar(output):
        return output
    # a dict with a "loss" key, as the torch_xla backend and DeepSpeed take it
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if scalar(loss):
        return loss
    if isinstance(output, (tuple, list)) and output and scalar(output[0]):
        return output[0]
    return None


# The torch_xla engine's public names this engine lacks (tests/test_torchax_backend.py checks
# the list against both classes): asking for one says which backend has it.
TORCH_XLA_ONLY = frozenset({
    "capture_steps", "lay_out_state",
    "restore_snapshot", "snapshot", "trained_parameters",
})


class TorchaxEngine(EngineBase):
    """DeepSpeed's engine API over two jitted programs (see the module docstring)."""

    def __init__(self, module: torch.nn.Module, optimizer: SpmdOptimizer, lr_scheduler: Any, cfg: DeepSpeedConfig,
                 batch: BatchSizes, plan: ShardingPlan, mesh_shape: dict[str, int], device_count: int,
                 training_dataloader: Any = None, config_dict: Optional[dict] = None, devices=None,
                 shape_only: bool = False):
        import jax
        import torchax
        from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

        self._jax = jax
        # shape-only (spmdzero aot): the mesh names no device and every array of the state is a
        # jax.ShapeDtypeStruct with its layout, so any topology's step lowers on any machine and
        # no parameter is ever materialized (``trace_step``)
        self._shape_only = shape_only
        if shape_only:
            self._processes = 1
        else:
            dcn = None if cfg.spmd.dcn_mesh is None else resolve_hybrid_shape(cfg.spmd.mesh, cfg.spmd.dcn_mesh,
                                                                               device_count)[1]
            if devices is None:  # before any JAX array; else a mesh given to initialize, in its order
                devices = mesh_devices(jax_devices(device_count), mesh_shape, dcn)
            self._processes = jax.process_count()  # hosts joined by jax.distributed; 1 without
        seed = torch.initial_seed()
        if self._processes > 1:
            seed = _broadcast_from_first_process(module, seed)
        self._env = torchax.default_env()
        lowerings.install(self._env)  # torch's values where torchax's lowerings differ (masked rows, padding_idx)
        host_tensors.name_devices_by_type(self._env)  # x.to(0) in a traced forward
        self._Output = _output_tensor_class()
        self._module = module
        self.basic_optimizer = optimizer
        # DeepSpeed's ZeRO optimizer face, as the torch_xla engine's; None without an optimizer (a model
        # only evaluated, or only given gradients: DeepSpeed-Chat's reference and reward models)
        self.optimizer = None if optimizer is None else ZeroOptimizer(optimizer, self)
        groups = [] if optimizer is None else optimizer.param_groups
        self.lr_scheduler = lr_scheduler
        self.training_dataloader = training_dataloader
        self.plan = plan
        self._config = cfg
        self.config = dict(config_dict) if config_dict is not None else cfg.model_dump(exclude_none=True)
        self._batch = batch
        self.dp_world_size = self.world_size = batch.ranks
        self.global_steps = self.global_samples = self.micro_steps = 0
        self.device = torch.device("cpu")  # batches stay on the host (``batch.to(engine.device)``); forward places them
        self.precision = precision_policy(cfg)
        self._boundary_override: Optional[bool] = None
        self.mesh = AbstractMesh(tuple(mesh_shape.values()), tuple(mesh_shape)) if shape_only else Mesh(
            devices, tuple(mesh_shape))
        spec = lambda s: NamedSharding(self.mesh, PartitionSpec(*s))  # noqa: E731
        self._sharding = spec
        self._replicated = spec(())

        # Trainable parameters by plan name; frozen ones and buffers are inputs that are not trained.
        names = {id(p): n for n, p in module.named_parameters()}
        optimized = ({id(p) for g in groups for p in g["params"]} if optimizer is not None else
                     {id(p) for p in module.parameters()})  # no optimizer: backward still gives every gradient
        self._names = [n for n, p in module.named_parameters() if p.requires_grad and id(p) in optimized]
        self._groups = [[names[id(p)] for p in g["params"]] for g in groups]
        trained = set(self._names)
        self._param_specs = {n: spec(plan[n].param) for n in self._names}
        self._grad_specs = {n: spec(plan[n].grad) for n in self._names}
        # Under bf16 the optimizer updates fp32 master weights laid out like its states (plan.master)
        # and the module's parameters are their bf16 casts, as in the torch_xla engine.
        self._master_specs = {n: spec(plan[n].master) for n in self._names} if self.precision.master_weights else {}
        self._masters = {n: self._put(p.float(), self._master_specs[n]) for n, p in module.named_parameters()
                         if n in self._master_specs}
        if self.precision.master_weights:
            move_in_place(module, self.precision.param_dtype)
        self._params = {n: self._put(p.detach(), self._param_specs[n]) for n, p in module.named_parameters()
                        if n in trained}
        self._constants = {n: self._put(t.detach(), self._replicated)
                           for n, t in [*module.named_parameters(), *module.named_buffers()] if n not in trained}
        states, self._state_specs = {}, {}
        # a torch.optim optimizer's own step runs in the update (torch_optim): its first step
        # creates its states, as torch's does
        self._torch_optimizer = optimizer is not None and not isinstance(optimizer, SpmdOptimizer)
        self._static_hyper = torch_optim.static_hyperparameters(optimizer) if self._torch_optimizer else None
        # how the torch optimizer's step gets its lr (torch_optim.LR_MODES)
        self._lr_mode = torch_optim.initial_lr_mode(optimizer) if self._torch_optimizer else "traced"
        for group, group_names in zip(groups, self._groups):
            for p, name in zip(group["params"], group_names):
                initial = {} if self._torch_optimizer else optimizer._initial_state(p.detach().float(), group)
                self._state_specs[name] = {k: spec(plan[name].optimizer_state if tuple(v.shape) == tuple(p.shape)
                                                   else replicated(v.dim())) for k, v in initial.items()}
                states[name] = {k: self._put(v, self._state_specs[name][k]) for k, v in initial.items()}
        # Every parameter steps together here (one update, one overflow skip): the optimizer's step
        # counters are one array, not one per parameter, so fewer arrays pass through every update.
        first = states.get(self._names[0], {}) if self._names else {}
        self._shared_state = {"step": first["step"]} if "step" in first else {}
        self._opt_state = {n: {k: v for k, v in st.items() if k not in self._shared_state} for n, st in states.items()}
        self._state_specs = {n: {k: v for k, v in st.items() if k not in self._shared_state}
                             for n, st in self._state_specs.items()}
        # A training forward's gradient belongs to the loss it returned (``loss._spmdzero_forward``,
        # its inputs and the accumulation with its gradient added), until backward commits it.
        self._accum: Optional[dict] = None  # gradients committed since the last boundary (plan's grad spec)
        self._accum_token = 0  # changes with _accum (_set_accum)
        self._generation = 0  # changes with the parameters (an update, a change taken from the host)
        self._window_reduced = False  # the last backward was at a boundary (zero_grad_keeps_gradients)
        self._retired_inputs: tuple = ()  # the last update's inputs
        self._last_loss = None
        self._loss_divisor = float(self.gradient_accumulation_steps())  # what the training program divides the loss by
        self._anchor = torch.zeros((), requires_grad=True)  # ties every training forward's outputs into autograd
        self._backward_state: Optional[SimpleNamespace] = None  # during _backward_outside
        self._backward_program = None  # built at the first loss computed outside the module
        self._window_loss = self._step_loss = None  # the mean loss of the accumulation window, a JAX array
        self._step_logger = StepLogger(cfg, device_clock=None, process_index=self.global_rank)  # no torch_xla clock
        self.tput_timer = ThroughputTimer(self)  # DeepSpeed's; here the time between dispatched steps
        self._rows_since_step = 0  # training rows fed: global_samples
        self._global_grad_norm = None
        self._skipped = self._put(torch.zeros(()), self._replicated)  # steps skipped for non-finite gradients
        # fp16's loss scaler (DeepSpeed's DynamicLossScaler, or a static scale): device scalars that
        # the training program multiplies the loss by and the update program steps (optim/update.py)
        initial = init_loss_scale(self.precision)
        self._loss_scale = None if initial is None else LossScale(
            *(self._put(torch.tensor(v, dtype=torch.float32), self._replicated) for v in initial))
        self._last_skip = None
        self._module_stale = False
        self._buffers_stale: set[str] = set()  # buffers a forward changed on the devices
        # the host tensors, listed once: reading them per forward costs ~1 us each, walking the module ~1 ms
        self._host_tensors = [*module.named_parameters(), *module.named_buffers()]
        self._host_params = [p for _, p in module.named_parameters()]
        self._trainable = self._requires_grad()
        self._frozen: frozenset = frozenset()  # trained parameters frozen since initialize (frozen.py)
        self._host_versions = self._versions()
        self._touched: set[int] = set()  # host parameters (by id) whose .data was used since the last forward
        _watch_parameters(module, self)
        self._warned_fewer_rows = False
        if optimizer is not None:
            _refuse_optimizer_state(optimizer)
            _zero_grad_through_engine(optimizer, self)
        _sync_before_state_dict(module, self)
        self._seed(seed)  # process 0's
        self._programs: dict = {}  # jitted functions by static structure
        # programs whose trace reads a value on the host run eagerly (host_reads)
        self._host_reads = host_reads.Fallback(self, type(module).__name__)
        self.traces: collections.Counter = collections.Counter()  # by program kind, counted while tracing
        self.runs: collections.Counter = collections.Counter()  # programs executed, by kind
        # training programs traced after warm-up: a warning, or an error past spmd.max_recompiles
        self.recompile_guard = RecompileGuard(cfg.spmd.max_recompiles, "JAX_LOG_COMPILES=1 logs each compilation.")
        self._traces_at_step = 0
        self._input_shapes: tuple = ()  # the last training forward's, to name a shape change
        self._update = self._build_update() if optimizer is not None else None
        self._unclipped_update = None  # engine.optimizer.step()'s at stage 0 in fp32 (_unclipped)
        # DeepSpeed does not step the schedule on a step skipped for overflow, which only the
        # devices know: DeepSpeed's schedules then count and compute their lr there (step_if)
        self._schedule_on_devices = self.precision.check_overflow and isinstance(lr_scheduler, LRSchedule)
        if self.precision.check_overflow and lr_scheduler is not None and not self._schedule_on_devices:
            warnings.warn(f"spmdzero: spmd.backend='torchax' steps the {type(lr_scheduler).__name__} schedule on "
                          "every boundary, including steps skipped for overflow (DeepSpeed does not step it then; "
                          "DeepSpeed's own schedules, from the config, do not either)", stacklevel=4)

    def _seed(self, seed: int) -> None:
        """The key dropout draws from (folded with the micro-step); its seed is what a
        checkpoint saves as ``rng.xla``."""
        self._rng_seed = int(seed)  # torch_xla's seeds are 64-bit unsigned, JAX's signed
        key = functools.partial(self._jax.random.key, self._rng_seed % (1 << 63))
        if self._shape_only:
            shape = self._jax.eval_shape(key)
            self._rng = self._jax.ShapeDtypeStruct(shape.shape, shape.dtype, sharding=self._replicated)
            return
        # one key for every process: a global array when the mesh spans processes
        self._rng = key() if self._processes == 1 else self._jax.jit(key, out_shardings=self._replicated)()

    # ---- placement ---------------------------------------------------------------------
    def _put(self, t: torch.Tensor, sharding):
        """``t``, the whole value (the same on every process), laid out by ``sharding``; from a
        copy: JAX imports a host tensor without copying it, and the first device's buffer would
        then be memory the script can still change (``p.data``, a reused batch buffer) on that
        device alone."""
        from torchax.ops import mappings

        if self._shape_only:
            return self._jax.ShapeDtypeStruct(tuple(t.shape), _placed_dtype(t.dtype), sharding=sharding)
        value = mappings.t2j(t.detach().cpu().clone())
        if self._processes == 1:
            return self._jax.device_put(value, sharding)
        # jax.device_put would compare the value across the processes first (a collective per array)
        value = np.asarray(value)
        return self._jax.make_array_from_callback(value.shape, sharding, lambda index: value[index])

    def _put_rows(self, t: torch.Tensor, sharding, dim: int):
        """``t``, this process's rows of a batch (along ``dim``), as its part of the global batch."""
        if self._processes == 1:
            return self._put(t, sharding)
        from torchax.ops import mappings

        local = np.asarray(mappings.t2j(t.detach().cpu().clone()))  # a copy, as in _put
        shape = (*local.shape[:dim], local.shape[dim] * self._processes, *local.shape[dim + 1:])
        return self._jax.make_array_from_process_local_data(sharding, local, shape)

    def _place_inputs(self, leaves: list, layout) -> list:
        """Tensors to JAX arrays: the inputs that carry the batch (``layout``) split along the
        batch axes on their batch dim (replicated when the rows do not divide), others
        replicated; torchax tensors as they are. With several processes, host tensors that
        carry the batch hold this process's rows of the global batch; the others must be the
        same on every process."""
        from torchax import tensor as ttensor

        local = layout.rows is not None and not layout.on_device  # this process's rows
        rows = None if layout.rows is None else layout.rows * (self._processes if local else 1)
        split = rows is not None and rows % self._batch.dp_devices == 0
        if rows is not None and not split and self._processes == 1:
            note_replicated(rows, self._batch.dp_devices)
        if local and not split and self._processes > 1:
            devices = self._batch.dp_devices // self._processes
            raise ValueError(f"a batch of {layout.rows} rows does not divide over the {devices} data-parallel devices "
                             f"of this process; with several processes ({self._processes}) each one's rows are split "
                             f"over its own devices: use a multiple of {devices} rows per process")
        placed = []
        for t in (t for t in leaves if isinstance(t, torch.Tensor)):
            dim = layout.dim_of(t)
            if isinstance(t, ttensor.Tensor):
                placed.append(t._elem)
            elif split and dim is not None:
                sharding = self._sharding(self.plan.batch_spec(t.dim(), dim))
                placed.append(self._put_rows(t, sharding, dim) if local else self._put(t, sharding))
            else:
                placed.append(self._put(t, self._replicated))
        return placed

    # ---- the module ----------------------------------------------------------------------
    @property
    def module(self) -> torch.nn.Module:
        """The torch module, its parameters brought up to date from the devices when a step
        changed them since the last read (a device-to-host copy)."""
        if self._module_stale or self._buffers_stale:
            from torchax.ops import mappings

            with torch.no_grad(), warnings.catch_warnings(), _unwatched():
                warnings.filterwarnings("ignore", "The given NumPy array is not writable")  # it is copied
                for name, t in self._host_tensors:  # a frozen parameter's value is a constant, as a buffer's
                    if self._module_stale and name in self._params:
                        t.copy_(mappings.j2t(self._params[name], use_dlpack=False))
                    elif name in self._buffers_stale:
                        t.copy_(mappings.j2t(self._constants[name], use_dlpack=False))
            self._module_stale, self._buffers_stale = False, set()
            self._host_versions = self._versions()
        return self._module

    def _versions(self) -> list[int]:
        """Each host parameter's and buffer's in-place version: a change made on the host (a
        ``load_state_dict``, an edit under ``no_grad``) shows as a new version."""
        with _unwatched():
            return [t._version for _, t in self._host_tensors]

    def _requires_grad(self) -> list[bool]:
        with _unwatched():
            return [p.requires_grad for p in self._host_params]

    def _take_host_changes(self) -> None:
        """Before a forward: parameters and buffers changed on the host since the engine last
        wrote or read them go to the devices (fp32 master weights too), as the torch_xla
        engine's module is its device copy. A parameter frozen or unfrozen after initialize is
        treated as DeepSpeed treats it (``frozen``)."""
        if self._requires_grad() != self._trainable:
            self._trainable = self._requires_grad()
            with _unwatched():
                self._frozen = frozen.frozen_since_initialize(self._module, self._names)
        versions, touched = self._versions(), self._touched
        if versions == self._host_versions and not touched:
            return
        self._touched = set()
        # what the host changed wins over a step's results not yet copied back (those are the
        # devices' own and stay there)
        for (name, t), version, before in zip(self._host_tensors, versions, self._host_versions):
            if version == before and (id(t) not in touched or self._same_on_devices(name, t)):
                continue
            with _unwatched():
                t = t.detach()
            if name in self._params:
                self._params[name] = self._put(t, self._param_specs[name])
                if name in self._masters:
                    self._masters[name] = self._put(t.float(), self._master_specs[name])
            else:
                self._constants[name] = self._put(t, self._replicated)
                self._buffers_stale.discard(name)
            self._generation += 1
        self._host_versions = versions

    def _same_on_devices(self, name: str, t: torch.Tensor) -> bool:
        """Whether a host parameter whose ``.data`` was used holds what the devices hold (a
        read, not an edit: the fp32 master weights keep their precision). Reads the device."""
        from torchax.ops import mappings

        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "The given NumPy array is not writable")  # only compared
            device = mappings.j2t(self._params[name] if name in self._params else self._constants[name],
                                  use_dlpack=False)
        with _unwatched():
            return t.shape == device.shape and t.dtype == device.dtype and torch.equal(t.detach(), device)

    def _host_use(self, param: torch.Tensor, through_data: bool) -> None:
        """A torch op on a host parameter (an edit, a read, ``.data``): the trained values are
        brought to the host first (a device-to-host copy when a step changed them), so that it
        sees them as torch would. An edit in place shows as a new version at the next forward;
        one through ``.data`` does not, so the next forward compares the parameter with the
        devices' copy."""
        self.module  # noqa: B018 (the property copies device values to the host when stale)
        if through_data:
            self._touched.add(id(param))

    def train(self, mode: bool = True) -> "TorchaxEngine":
        self._module.train(mode)
        return self

    def eval(self) -> "TorchaxEngine":
        return self.train(False)

    @property
    def training(self) -> bool:
        return self._module.training

    def parameters(self, recurse: bool = True):
        return self.module.parameters(recurse)

    def named_parameters(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        """Named as DeepSpeed's engine names them, under ``module.``."""
        return self.module.named_parameters(prefix=f"{prefix}module", recurse=recurse,
                                            remove_duplicate=remove_duplicate)

    def state_dict(self, destination=None, prefix: str = "", keep_vars: bool = False):
        """The module's state dict, keys under ``module.`` as DeepSpeed's engine (an nn.Module) has them."""
        return self.module.state_dict(destination=destination, prefix=f"{prefix}module.", keep_vars=keep_vars)

    @property
    def _modules(self) -> dict:
        """DeepSpeed's engine is an ``nn.Module`` whose child is ``module``: code that walks
        modules (accelerate's unwrapping) finds it there."""
        return {"module": self._module}

    def __getattr__(self, name: str):
        """Attributes the engine lacks come from the module, as in DeepSpeed."""
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return getattr(self.module, name)
        except AttributeError:
            if name in TORCH_XLA_ONLY:
                raise AttributeError(f"engine.{name} is not supported by the torchax backend (spmd.backend="
                                     "'torchax', see docs/config.md#the-torchax-backend); spmd.backend='torch_xla' "
                                     "has it") from None
            raise AttributeError(f"neither the engine nor its module ({type(self._module).__name__}) has an "
                                 f"attribute {name!r}") from None

    # ---- the training step -----------------------------------------------------------------
    def __call__(self, *inputs, **kwargs):
        return self.forward(*inputs, **kwargs)

    def forward(self, *inputs, **kwargs):
        """Run the module in one jitted program; in training (train mode, grad enabled) it also
        takes the gradient of the loss the module returns (see the module docstring). A forward
        that reads a tensor's value on the host runs eagerly (``host_reads``)."""
        return self._forward(inputs, kwargs)

    def _reads_values(self, err: Exception) -> RuntimeError:
        """The error for tracing the step of a forward that reads a tensor's value on the host
        (``trace_step``): training runs it eagerly (``host_reads``), one traced program cannot."""
        found = str(err).strip().splitlines()[0]
        return RuntimeError(
            f"spmd.backend='torchax': {type(self._module).__name__}'s forward reads a tensor's value on the host"
            f"{host_reads.where(err)} (bool(t), t.item(), t.tolist(), a boolean mask or nonzero), so its step cannot "
            "be traced as one JAX program (trace_step, spmdzero aot); training runs such a forward eagerly instead. "
            "Compute it with tensor ops (torch.where, masks of fixed shape) to compile it, or use "
            f"spmd.backend='torch_xla', which cuts the step in two at the read. JAX said: {found}")

    def _forward(self, inputs: tuple, kwargs: dict):
        leaves, treespec, static, layout, arrays, rng, rows = self._placed(inputs, kwargs)
        training = self._module.training
        grad_enabled = torch.is_grad_enabled()
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        # the inputs whose gradients torch would give (x.grad): differentiated by the VJP program
        which = tuple(i for i, t in enumerate(tensors) if t.requires_grad and t.is_floating_point()) \
            if grad_enabled else ()
        forward = SimpleNamespace(treespec=treespec, static=static, rng=rng, arrays=arrays, rows=rows,
                                  training=training, constants=self._constants, generation=self._generation,
                                  pending=None, accum_token=None, divisor=None, engine=self, which=which,
                                  inputs=[tensors[i] for i in which], dims=[layout.dim_of(tensors[i]) for i in which],
                                  vjp=None, released=False)
        if training and grad_enabled:
            if rows is not None:
                self._check_training_rows(rows)
            self._input_shapes = tuple(tuple(a.shape) for a in arrays)  # named by the recompile guard
            ran = None if which else self._gradient(forward)
            if ran is not None:
                outputs, constants, program = ran
                self._take_constants(constants)
                result = self._outputs(outputs, program, forward)
                program.loss_of(result)._spmdzero_forward = forward
                return result
            # the output holds no loss (found while tracing), or inputs want their gradients: the
            # VJP program, whose backward engine.backward runs from the loss the script computes
            program = self._program("vjp", treespec, static, training, which)
            self.runs["forward"] += 1
            outputs, constants, forward.vjp = program(self._params, self._constants, rng, arrays)
            self._take_constants(constants)
            return self._outputs(outputs, program, forward)
        program = self._program("forward", treespec, static, training)
        self.runs["forward"] += 1
        outputs, constants = program(self._params, self._constants, rng, arrays)
        self._take_constants(constants)
        if not grad_enabled:
            return self._outputs(outputs, program)
        # eval mode with grad enabled (fine-tuning with dropout off): the gradients are taken only
        # if backward asks for them, by the training or VJP program in eval mode
        result = self._outputs(outputs, program, forward)
        loss = _find_loss(result)
        if loss is not None and not which:
            loss._spmdzero_forward = forward
        return result

    def _placed(self, inputs: tuple, kwargs: dict) -> tuple:
        """A forward's inputs as its program takes them: (leaves, their treespec, the non-tensor
        leaves by position, the batch layout, the tensors placed as JAX arrays, the dropout key
        and micro-step, the global rows when known). Changes made on the host go to the devices
        first."""
        inputs, kwargs = self._padded(inputs, kwargs, model_pad_id(self._module))
        # host tensors only: a torchax tensor (an earlier output) is the model's already
        inputs, kwargs = self._in_model_dtype(inputs, kwargs, keep=_is_torchax_tensor)
        # a mapping that is not a dict (transformers' BatchEncoding) is one leaf to torch's pytree
        inputs, kwargs = _as_dicts(inputs), _as_dicts(kwargs)
        leaves, treespec = torch_pytree.tree_flatten((inputs, kwargs))
        static = tuple((i, v) for i, v in enumerate(leaves) if not isinstance(v, torch.Tensor))
        self._take_host_changes()
        layout = self._batch_layout(self._module, inputs, kwargs, on_device=_is_torchax_tensor)
        arrays = self._place_inputs(leaves, layout)
        rng = (self._rng, np.uint32(self.micro_steps))  # dropout draws anew at every micro-step
        rows = layout.rows if layout.on_device else None if layout.rows is None else layout.rows * self._batch.processes
        return leaves, treespec, static, layout, arrays, rng, rows

    def _take_constants(self, changed: dict) -> None:
        """Buffers a forward changed: the devices' values, copied to the module when it is read."""
        if changed:
            self._constants = {**self._constants, **changed}
            self._buffers_stale.update(changed)

    def _gradient(self, forward: SimpleNamespace):
        """Run the training program for ``forward`` (a training forward's inputs, as it saw
        them): its outputs and its gradient added to the gradients accumulated so far, kept in
        ``forward.pending`` until backward commits it. Returns (outputs, changed buffers, the
        program), or None when the module's output holds no loss."""
        program = self._program("train" if self._accum is None else "accumulate", forward.treespec, forward.static,
                                forward.training)
        ran = None if program.no_loss else program(self._params, forward.constants, self._accum, forward.rng,
                                                    forward.arrays)
        if ran is None:
            return None
        self.runs["forward"] += 1
        outputs, constants, forward.pending = ran
        forward.accum_token, forward.divisor = self._accum_token, self._loss_divisor
        return outputs, constants, program

    def _outputs(self, arrays: list, program, record: Optional[SimpleNamespace] = None):
        """The program's outputs as the module returned them; with ``record`` (a forward torch
        could differentiate), tied into torch autograd (``outside_loss``), so that a loss the
        script computes from them reaches the compiled backward."""
        spec, others = program.out_spec
        # several processes: each sees its own rows, as a DeepSpeed rank its micro-batch (process_rows)
        views = [process_rows.local_view(a) for a in arrays] if self._processes > 1 else arrays
        leaves = [self._Output(v, self._env) for v in views]
        if record is not None:
            inexact = self._jax.numpy.inexact  # bf16 is not a numpy float to numpy
            record.floats = [i for i, a in enumerate(arrays) if self._jax.numpy.issubdtype(a.dtype, inexact)]
            # the backward's static description of each float output: its global shape and dtype, and
            # with several processes how its cotangent reaches the global mesh
            kind = (lambda i: (process_rows.SPLIT if process_rows.spans_processes(arrays[i], views[i]) else
                               process_rows.STACKED)) if self._processes > 1 else (lambda i: None)
            record.avals = tuple((tuple(arrays[i].shape), str(arrays[i].dtype), kind(i)) for i in record.floats)
            record.shardings = [(views[i].sharding, arrays[i].sharding) for i in record.floats]
            record.tensors = leaves
            leaves = tie(record, self._anchor, record.inputs)
            record.tensors = None  # the outputs hold the record (their grad_fn), not the reverse
        for i, value in others:
            leaves.insert(i, value)
        return torch_pytree.tree_unflatten(leaves, spec)

    def _program(self, kind: str, treespec, static: tuple, training: bool, which: tuple = ()):
        """The jitted program for ``kind``, these inputs' structure and the module's mode (traced
        in it: dropout on or off); ``which``: the inputs the VJP program differentiates."""
        key = (kind, training, treespec, _hashable(static), which, self._frozen)
        if key not in self._programs:
            self._programs[key] = self._build_forward(kind, treespec, static, which)
        return self._programs[key]

    def _build_forward(self, kind: str, treespec, static: tuple, which: tuple = ()):
        """A jitted run of the module for one input structure: ``kind`` "forward":
        ``(params, constants, rng, inputs) -> (outputs, changed buffers)``; "train" (the first
        micro-step) and "accumulate" (later ones): ``(params, constants, accum, rng, inputs) ->
        (outputs, changed buffers, accumulated gradients)``, or None when the output holds no loss;
        "vjp": ``(params, constants, rng, inputs) -> (outputs, changed buffers, VJP)``, the VJP of
        the float outputs with respect to the parameters and the inputs at positions ``which``
        (what ``_backward_through`` gives the cotangents)."""
        import jax

        env, module, names, policy = self._env, self._module, set(self._names), self.precision
        frozen_now = self._frozen  # part of the program's key (_program)
        out_spec: list = []  # (treespec, [(index, non-tensor leaf)]), filled while tracing
        batch_norms = [bn for _, bn in batchnorm.tracked(module)]  # their running statistics are updated in training
        loss_leaf: list = []

        def flatten_output(output) -> list:
            """The output's tensors as JAX arrays; its other leaves are kept if they are plain
            values, else dropped (None): a transformers cache holds traced arrays."""
            leaves, spec = torch_pytree.tree_flatten(output)
            plain = (int, float, str, bool, type(None))
            out_spec[:] = [spec, [(i, v if isinstance(v, plain) else None) for i, v in enumerate(leaves)
                                  if not isinstance(v, torch.Tensor)]]
            return [env.t2j_iso(t) for t in leaves if isinstance(t, torch.Tensor)]

        def run(params, constants, rng, arrays, differentiated: bool = True):
            leaves = list(arrays)
            for i, value in static:
                leaves.insert(i, value)
            inputs, kwargs = torch_pytree.tree_unflatten(leaves, treespec)
            tensors = env.j2t_iso({**frozen.held(params, frozen_now), **constants})
            inputs, kwargs = env.j2t_iso((inputs, kwargs))
            # functional_call puts the host tensors back when it returns, except under a submodule
            # registered twice (``self.alias = self.shared``): there the traced ones stayed. Put back here.
            held = [(m, dict(m._parameters), dict(m._buffers)) for m in module.modules()]
            try:
                with env, env.override_property(prng=jax.random.fold_in(*rng)), trace_view.tracing(differentiated), \
                        remat.rematerializing(env, tensors.values()), cross_entropy.fused(env), \
                        batchnorm.updating_running_statistics(batch_norms):
                    output = torch.func.functional_call(module, tensors, inputs, kwargs)
            finally:
                for m, params, buffers in held:
                    m._parameters.update(params)
                    m._buffers.update(buffers)
            # buffers the module updated in place (running statistics) are returned as new values
            changed = {n: t._elem for n, t in tensors.items() if n not in names and t._elem is not constants[n]}
            return output, changed

        def program_forward(params, constants, rng, arrays):
            self.traces["forward"] += 1
            output, changed = run(params, constants, rng, arrays, differentiated=False)
            return flatten_output(output), changed

        def program_train(params, constants, accum, rng, arrays, loss_scale, divisor):
            self.traces["train_forward"] += 1

            def objective(params):
                output, changed = run(params, constants, rng, arrays)
                loss = _find_loss(output)
                if loss is None:
                    raise _NoLoss
                outputs = flatten_output(output)
                tensors = [t for t in torch_pytree.tree_leaves(output) if isinstance(t, torch.Tensor)]
                loss_leaf[:] = [next(i for i, t in enumerate(tensors) if t is loss)]
                value = env.t2j_iso(loss).reshape(())
                # DeepSpeed's backward scales the loss by 1/gradient_accumulation_steps (unless
                # backward(scale_wrt_gas=False): 1), then by fp16's loss scale (inputs: a new
                # value is not a new program)
                value = value / divisor
                return (value if loss_scale is None else value * loss_scale), (outputs, changed)

            grads, (outputs, changed) = jax.grad(objective, has_aux=True)(params)
            # reduced in communication_data_type, accumulated in grad_accum_dtype (both the model's by default)
            comm, accumulated = _jax_dtype(policy.communication_dtype), _jax_dtype(policy.grad_accum_dtype)
            grads = {n: self._laid_out_gradient(n, g.astype(comm)).astype(accumulated) for n, g in grads.items()}
            if kind == "accumulate":
                grads = {n: jax.lax.with_sharding_constraint(accum[n] + g, self._grad_specs[n])
                         for n, g in grads.items()}
            return outputs, changed, grads

        def program_vjp(params, constants, rng, arrays):
            self.traces["vjp_forward"] += 1
            floats: list = []  # positions of the float outputs, found while tracing

            def differentiable(params, chosen):
                placed = list(arrays)
                for i, array in zip(which, chosen):
                    placed[i] = array
                output, changed = run(params, constants, rng, placed)
                outputs = flatten_output(output)
                floats[:] = [i for i, o in enumerate(outputs) if jax.numpy.issubdtype(o.dtype, jax.numpy.inexact)]
                return [outputs[i] for i in floats], (outputs, changed)

            _, vjp, (outputs, changed) = jax.vjp(differentiable, params, [arrays[i] for i in which], has_aux=True)
            return outputs, changed, vjp

        if kind == "vjp":
            jitted = self._host_reads.vjp_program(program_vjp)

            def call(params, constants, rng, arrays):
                return jitted(params, constants, rng, arrays)
        elif kind != "forward":
            jitted = self._host_reads.program(program_train, kind)

            def call(params, constants, accum, rng, arrays):
                scale = None if self._loss_scale is None else self._loss_scale.scale
                try:
                    return jitted(params, constants, accum, rng, arrays, scale, np.float32(self._loss_divisor))
                except _NoLoss:
                    call.no_loss = True
                # the failed trace's frames (JAX's among them) refer to each other and hold its inputs
                # (the parameters, the accumulated gradients): freed now, once per program, not when
                # Python's cycle collector next runs (a second gradient on the devices until then)
                gc.collect()
                return None
        else:
            jitted = self._host_reads.program(program_forward, kind)

            def call(params, constants, rng, arrays):
                return jitted(params, constants, rng, arrays)
        call.no_loss = False
        call.jitted = jitted  # for trace_step, which composes it with the update
        call.loss_index = lambda: loss_leaf[0]  # the loss among the output tensors, once traced
        call.out_spec = out_spec
        call.loss_of = lambda result: [t for t in torch_pytree.tree_leaves(result)
                                       if isinstance(t, torch.Tensor)][loss_leaf[0]]
        return call

    def backward(self, loss, retain_graph: bool = False, scale_wrt_gas: bool = True):
        """Commit the gradients of ``loss``, as torch's backward of it would, scaled by
        1/gradient_accumulation_steps (and fp16's loss scale) as DeepSpeed does. The loss the
        module returned: the gradient its training forward already took is committed; it is taken
        again, by the same program on the same inputs and dropout draw, when the accumulation it
        was added to has changed since (a backward of another forward's loss, a ``zero_grad`` that
        dropped it) or when the forward ran in eval mode. Any other loss (computed outside the
        module from the outputs): torch autograd takes it back to the outputs, and the compiled
        backward takes it on (``outside_loss``). Returns the loss scaled by
        1/gradient_accumulation_steps, as DeepSpeed does."""
        forward = getattr(loss, "_spmdzero_forward", None) if isinstance(loss, torch.Tensor) else None
        if forward is _COMMITTED:
            raise RuntimeError(BACKWARD_TWICE)
        gas = self.gradient_accumulation_steps()
        if forward is None:
            if not isinstance(loss, torch.Tensor) or loss.grad_fn is None:
                raise RuntimeError(NOT_FROM_ENGINE)
            rows = self._backward_outside(loss, retain_graph, gas if scale_wrt_gas else 1)
        else:
            # the next forwards scale the loss as this backward asks (the HF Trainer passes
            # scale_wrt_gas=False at every step); this one is taken again if it scaled otherwise
            self._loss_divisor = float(gas if scale_wrt_gas else 1)
            self._commit_traced(forward)
            if not retain_graph:
                loss._spmdzero_forward = _COMMITTED
            rows = forward.rows or 0
        self._last_loss = loss
        self._rows_since_step += rows
        self._window_reduced = self.is_gradient_accumulation_boundary()
        term = _as_jax(loss, self._env).astype("float32") / gas  # a JAX op: no device read
        self._window_loss = term if self._window_loss is None else self._window_loss + term
        return loss / gas if gas > 1 else loss

    def _commit_traced(self, forward: SimpleNamespace) -> None:
        """Commit the gradient a training forward took of the module's loss (taking it again when
        the accumulation changed since, see ``backward``)."""
        if (forward.pending is None or forward.accum_token != self._accum_token
                or forward.divisor != self._loss_divisor):
            if forward.generation != self._generation:
                raise RuntimeError(PARAMETERS_CHANGED)
            if not forward.training and forward.rows is not None:
                self._check_training_rows(forward.rows)  # an eval-mode forward trains only now
            if self._gradient(forward) is None:  # its buffer changes were taken by the forward itself
                raise RuntimeError("engine.backward(loss): the module returned this loss in eval mode, but no loss "
                                   "when traced to take its gradient")
        self._take_accum(forward.pending)
        forward.pending = None

    def _take_accum(self, accum: dict) -> None:
        # the sum this one replaces is released now (off this thread): kept a micro-step longer it
        # was a second gradient held between micro-steps (ZeRO's accounting holds one)
        release_in_background(self._accum)
        self._set_accum(accum)

    def _backward_outside(self, loss: torch.Tensor, retain_graph: bool, divide: int) -> int:
        """torch autograd from ``loss`` (scaled as DeepSpeed scales it: fp32, times fp16's loss
        scale, over ``divide``) back to the engine's outputs, whose nodes run the compiled backward
        (``_backward_through``). Returns the training rows of the forwards it reached."""
        scaled = loss.float()
        if self._loss_scale is not None:
            scaled = scaled * self._Output(self._loss_scale.scale, self._env)
        if divide > 1:
            scaled = scaled / divide
        state = self._backward_state = SimpleNamespace(retain=retain_graph, rows=0, forwards=0)
        try:
            torch.autograd.backward(scaled, retain_graph=retain_graph)
        finally:
            self._backward_state = None
        if not state.forwards:
            raise RuntimeError(NOT_FROM_ENGINE)
        return state.rows

    def _backward_through(self, record: SimpleNamespace, cotangents: tuple) -> list:
        """The compiled backward of one forward (``outside_loss.TiedOutputs.backward``): its
        gradients, from the cotangents of its outputs, added to the accumulated ones; returns the
        gradients of its inputs that require grad (host tensors for host inputs)."""
        if record.released:
            raise RuntimeError(BACKWARD_TWICE)
        vjp = record.vjp
        if vjp is None:  # the forward took the module's loss's gradient only: its VJP, on the same inputs
            if record.generation != self._generation:
                raise RuntimeError(PARAMETERS_CHANGED)
            if not record.training and record.rows is not None:
                self._check_training_rows(record.rows)  # an eval-mode forward trains only now
            program = self._program("vjp", record.treespec, record.static, record.training, record.which)
            _, _, vjp = program(self._params, record.constants, record.rng, record.arrays)
        state = self._backward_state
        cts = tuple(None if cotangents[i] is None else _as_jax(cotangents[i], self._env) for i in record.floats)
        if self._processes > 1:  # this process's cotangents, onto the global mesh
            cts = tuple(None if c is None else process_rows.global_cotangent(c, view, whole, shape, kind, self.mesh)
                        for c, (view, whole), (shape, _, kind) in zip(cts, record.shardings, record.avals))
        if self._backward_program is None:
            self._backward_program = self._build_backward()
        self.runs["backward"] += 1
        grads, input_grads = self._backward_program(vjp, cts, self._accum, record.avals)
        self._take_accum(grads)
        if state is not None:
            state.rows += record.rows or 0
            state.forwards += 1
        if state is None or not state.retain:
            record.vjp, record.released = None, True
        return [self._input_gradient(record, k, g) for k, g in enumerate(input_grads)]

    def _input_gradient(self, record: SimpleNamespace, k: int, grad):
        """The gradient of the ``k``-th input that required grad, as torch gives it: a torchax
        tensor for a torchax input, a host tensor (this process's rows) for a host input."""
        from torchax.ops import mappings

        t = record.inputs[k]
        if _is_torchax_tensor(t):
            return self._Output(grad, self._env)
        array = record.arrays[record.which[k]]
        if self._processes > 1 and record.dims[k] is not None:  # this process's rows of the global gradient
            grad = self._jax.device_put(grad, array.sharding)
            dim, seen, parts = record.dims[k], set(), []
            for shard in sorted(grad.addressable_shards, key=lambda s: s.index[dim].start or 0):
                start = shard.index[dim].start or 0
                if start not in seen:
                    seen.add(start)
                    parts.append(np.asarray(shard.data))
            grad = np.concatenate(parts, axis=dim)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "The given NumPy array is not writable")  # it is copied
            return mappings.j2t(np.asarray(grad), use_dlpack=False).to(t.dtype)

    def _build_backward(self):
        """``(VJP, cotangents, accum, avals) -> (accumulated gradients, input gradients)``, jitted:
        the compiled backward of a loss computed outside the module. A cotangent that is None (an
        output the loss does not use) is zeros of that output's shape; with several processes the
        processes' cotangents make the gradient of their mean loss (``process_rows.combine``). The
        gradients are reduced and accumulated as the training program does (the plan's gradient
        spec)."""
        import jax
        import jax.numpy as jnp

        policy = self.precision
        comm, accumulated = _jax_dtype(policy.communication_dtype), _jax_dtype(policy.grad_accum_dtype)

        def backward(vjp, cotangents, accum, avals):
            self.traces["backward"] += 1
            cts = [jnp.zeros(shape, dtype) if c is None else
                   (c if kind is None else process_rows.combine(c, kind, self._processes)).astype(dtype)
                   for c, (shape, dtype, kind) in zip(cotangents, avals)]
            grads, input_grads = vjp(cts)
            grads = {n: self._laid_out_gradient(n, g.astype(comm)).astype(accumulated) for n, g in grads.items()}
            if accum is not None:
                grads = {n: jax.lax.with_sharding_constraint(accum[n] + g, self._grad_specs[n])
                         for n, g in grads.items()}
            return grads, input_grads

        return self._host_reads.backward(backward, static_argnums=(3,))

    def _laid_out_gradient(self, name: str, grad):
        """A fresh gradient laid out by the plan's gradient spec; on a mesh with two fsdp axes,
        through the plan's stages in turn (``TensorPlan.grad_stages``: rows over ``fsdp``, then
        columns over ``fsdp_inner``), as the torch_xla engine lays it out. libtpu 0.0.21 does not
        reduce-scatter a gradient 16 ways in one go: straight to its final spec, every block
        matrix of a GPT-2 was all-reduced in full on v5e:4x4 (1.53 x the data-parallel minimum
        against 1.17, ``spmdzero aot``). With one stage the gradient goes straight to its spec,
        which libtpu reduce-scatters (a replicated pin first, as the torch_xla engine has it,
        all-reduced a position table that this reduce-scatters on v5e:2x2)."""
        jax = self._jax
        for layout in self.plan[name].grad_stages[:-1]:
            grad = jax.lax.with_sharding_constraint(grad, self._sharding(layout))
        return jax.lax.with_sharding_constraint(grad, self._grad_specs[name])

    def _set_accum(self, accum: Optional[dict]) -> None:
        """The gradients accumulated since the last optimizer step; a new token tells the
        forwards whose gradient was added to the old ones that it must be taken again."""
        self._accum = accum
        self._accum_token += 1

    def step(self, lr_kwargs: Optional[dict] = None) -> None:
        """Apply the update at an accumulation boundary; count every call; hold the step's
        traces to the recompile guard."""
        boundary = self.is_gradient_accumulation_boundary()
        if boundary:
            if self.optimizer is None:
                raise RuntimeError("engine.step() needs an optimizer: pass optimizer= to initialize() or add an "
                                   "'optimizer' section to the config")
            if self._accum is None:
                raise RuntimeError(NO_GRADIENTS)
            self._take_model_step(lr_kwargs)
        self.micro_steps += 1
        # the training programs traced since the last step (a trace is a compile); an evaluation
        # forward's program is not the step's
        traces = sum(n for kind, n in self.traces.items() if kind != "forward")
        self.recompile_guard.check(traces - self._traces_at_step, self.global_steps, boundary, self._input_shapes)
        self._traces_at_step = traces

    def _hyper_array(self, values: list):
        """One group's hyperparameters, the update's input: a host array, or a device one where
        a DeepSpeed schedule keeps its lr on the devices (JAX values: no host read)."""
        if all(isinstance(v, (int, float)) for v in values):
            return np.array(values, dtype=np.float32)
        jnp = self._jax.numpy
        stacked = jnp.stack([jnp.asarray(v, dtype=jnp.float32).reshape(()) for v in values])
        return self._jax.device_put(stacked, self._replicated)  # one layout every step: one trace

    def _device_count(self, value: float):
        """The schedule's step count as a replicated JAX scalar."""
        return self._jax.device_put(self._jax.numpy.float32(value), self._replicated)

    def _take_model_step(self, lr_kwargs: Optional[dict]) -> None:
        """The engine's optimizer step: the update, then the schedule, the counters and the step
        log, as DeepSpeed's ``engine._take_model_step``."""
        self._apply_update(lr_kwargs, clipped=True)
        if self.lr_scheduler is not None:
            if self._schedule_on_devices and not lr_kwargs:
                self.lr_scheduler.step_if(self._jax.numpy.logical_not(self._last_skip))
            else:
                self.lr_scheduler.step(**(lr_kwargs or {}))
        self.global_steps += 1
        self.global_samples += self._consume_samples()
        self._step_logger.after_boundary(self)  # reads the device at print steps only
        self.tput_timer.after_boundary()
        self._run_post_step_hooks()

    def _apply_update(self, lr_kwargs: Optional[dict], clipped: bool) -> None:
        """Run the update program (``_build_update``; ``clipped``: with the config's gradient
        clipping, else without) on the accumulated gradients, which it consumes: the parameters,
        master weights and optimizer states are its outputs."""
        def update(*args):
            return (self._update if clipped else self._unclipped())(*args)

        if self._schedule_on_devices and not lr_kwargs:  # as the previous step left it (a load: from the host)
            self.lr_scheduler.keep_on_device(None, put=self._device_count, ops=jax_ops())
        if self._torch_optimizer:
            constant = self._lr_mode == "constant"
            hyper = [] if constant else [self._hyper_array([g["lr"]]) for g in self.basic_optimizer.param_groups]
            static = torch_optim.static_hyperparameters(self.basic_optimizer, with_lr=constant)
            if static != self._static_hyper:  # constants of the update program: built for the new ones
                self._static_hyper, self._update, self._unclipped_update = static, self._build_update(), None
        else:
            hyper = [self._hyper_array(list(self.basic_optimizer._hyper_values(g).values()))
                     for g in self.basic_optimizer.param_groups]
        # The inputs, donated, are released at the next boundary: dropping the last reference to an
        # array that a dispatched program still uses blocks the host until that program has run.
        release_in_background(self._retired_inputs)
        self._retired_inputs = (self._params, self._masters, self._opt_state, self._shared_state, self._accum,
                                self._skipped, self._loss_scale)
        self._set_accum(None)
        self._window_reduced = False
        self._generation += 1
        self.runs["update"] += 1
        with warnings.catch_warnings():  # the gradients are donated to be freed, not to hold results
            warnings.filterwarnings("ignore", "Some donated buffers were not usable")
            try:
                updated = update(*self._retired_inputs, hyper)
            except self._jax.errors.ConcretizationTypeError:
                if not self._torch_optimizer or self._lr_mode != "traced":
                    raise
                # its step reads the lr as a Python number (SGD's alpha=-lr); the trace failed
                # before anything ran, so the donated inputs are intact (torch_optim.LR_MODES)
                self._lr_mode = torch_optim.fallback_lr_mode(self.basic_optimizer)
                if self._lr_mode == "constant":
                    warnings.warn(f"spmdzero: {type(self.basic_optimizer).__name__}'s step needs the lr as a Python number "
                                  "on the torchax backend: each new lr compiles the update again (a schedule changing "
                                  "it every step recompiles every step)", stacklevel=4)
                    hyper = []
                self._static_hyper = torch_optim.static_hyperparameters(self.basic_optimizer,
                                                                        with_lr=self._lr_mode == "constant")
                self._update, self._unclipped_update = self._build_update(), None
                updated = update(*self._retired_inputs, hyper)
            (self._params, self._masters, self._opt_state, self._shared_state, self._global_grad_norm, self._skipped,
             self._last_skip, self._loss_scale) = updated
        # the gradients are the one donated input no output reuses (JAX keeps such a buffer): released
        # now, off this thread, not held to the next boundary beside the next window's gradients
        release_in_background(self._retired_inputs[4])
        self._retired_inputs = (*self._retired_inputs[:4], None, *self._retired_inputs[5:])
        self._module_stale = True
        self._step_loss, self._window_loss = self._window_loss, None

    def _unclipped(self):
        """The update program without gradient clipping (``optimizer_step`` at stage 0 in fp32),
        built at its first use."""
        if self._unclipped_update is None:
            self._unclipped_update = self._build_update(clipping=0.0)
        return self._unclipped_update

    def _build_update(self, clipping: Optional[float] = None):
        """``(params, masters, states, shared states, grads, skipped, loss scale, hyperparameters) ->
        (params, masters, states, shared states, norm, skipped, skip, loss scale)``, jitted, all but
        the hyperparameters donated: the engine's boundary step (clipping, the optimizer's math, the
        overflow skip under fp16 and bf16's check, fp16's loss scaler). The shared states (the step
        counter) are every parameter's."""
        import jax
        import jax.numpy as jnp

        optimizer, ops = self.basic_optimizer, jax_ops()
        clipping = self._config.gradient_clipping if clipping is None else clipping
        groups = [] if self._torch_optimizer else [
            (names, list(optimizer._hyper_values(g)), {k: v for k, v in g.items() if isinstance(v, bool)})
            for names, g in zip(self._groups, optimizer.param_groups)]
        order, policy = self._names, self.precision
        param_dtype = _jax_dtype(policy.param_dtype)

        def update(params, masters, states, shared, grads, skipped, loss_scale, hyper):
            self.traces["update"] += 1
            targets = masters if masters else params

            def apply(scale):
                if self._torch_optimizer:
                    lrs = [[g["lr"]] for g in optimizer.param_groups] if self._lr_mode == "constant" else hyper
                    new_targets, new_states = torch_optim.traced_step(
                        optimizer, self._groups, targets, grads, states, lrs, scale.multiplier, scale.skip, self._env,
                        self._lr_mode)
                    new_states = {n: {k: jax.lax.with_sharding_constraint(v, self._state_spec(n, v))
                                      for k, v in st.items()} for n, st in new_states.items()}
                    return {**targets, **new_targets}, {**states, **new_states}, dict(shared)
                new_targets, new_states, new_shared = dict(targets), dict(states), dict(shared)
                for (names, keys, static), values in zip(groups, hyper):
                    hp = {k: values[i] for i, k in enumerate(keys)}
                    group_targets, group_states = update_group(
                        optimizer, [targets[n] for n in names], [grads[n] for n in names],
                        [{**states[n], **shared} for n in names], hp, static, scale, ops)
                    for name, new_target, new_state in zip(names, group_targets, group_states):
                        new_shared.update((k, new_state.pop(k)) for k in shared)  # the same value for every parameter
                        new_targets[name], new_states[name] = new_target, new_state
                return new_targets, new_states, new_shared

            # the torch_xla engine's global norm: fp32, in parameter order
            sum_sq = sum_of_squares([grads[name] for name in order], ops)
            result = boundary_update(sum_sq, loss_scale, clipping, policy, ops, apply)
            new_targets, new_states, new_shared = result.applied
            norm, skip = result.scale.norm, result.scale.skip
            skip = jnp.zeros((), bool) if skip is None else skip
            if not masters:
                return new_targets, masters, new_states, new_shared, norm, skipped + skip, skip, result.loss_scale
            new_params = {n: t.astype(param_dtype) for n, t in new_targets.items()}  # all-gathered in bf16/fp16
            return new_params, new_targets, new_states, new_shared, norm, skipped + skip, skip, result.loss_scale

        rep = self._replicated
        scaler = None if self._loss_scale is None else LossScale(*(rep,) * len(LossScale._fields))
        # a torch optimizer's states appear at its first step: laid out inside the program (_state_spec)
        states = None if self._torch_optimizer else self._state_specs
        shardings = (self._param_specs, self._master_specs, states, {k: rep for k in self._shared_state},
                     rep, rep, rep, scaler)
        self._update_shardings = shardings  # trace_step's outputs are laid out as the update's
        # keep_unused: under master weights the update reads no parameter, and an input jit prunes is
        # not donated: the old bf16 parameters stayed beside the new ones until the next boundary
        return jax.jit(update, out_shardings=shardings, donate_argnums=(0, 1, 2, 3, 4, 5, 6), keep_unused=True)

    def trace_step(self, *inputs, **kwargs) -> "TracedStep":
        """One training step at an accumulation boundary for a batch of ``inputs``, traced by JAX
        as ONE program and not run: the training program (forward, the gradient of the loss the
        module returns, laid out by the plan's gradient spec and added to the accumulated ones
        when the config accumulates) and the update program (clipping, the optimizer, the
        parameters replicated and the states laid out by the plan), the state donated to the
        outputs as the update donates it. What ``spmdzero aot`` lowers for a TPU topology and
        compiles: the two programs this engine runs, composed, so that the compiler sees one
        step as the torch_xla backend's capture gives it. The forward's outputs are outputs of
        the step (the training program returns them: they are in memory while the update runs).

        On a shape-only engine (``build(..., shape_only=True)``) every argument is a
        ``jax.ShapeDtypeStruct`` on an abstract mesh: nothing is materialized, and any topology
        traces on any machine. On a live engine the arguments are its arrays (traced, not read).
        The engine is left as it was (its trace counters included: the recompile guard does not
        count this trace)."""
        import jax

        if self.optimizer is None:
            raise ValueError("trace_step traces a training step, which needs an optimizer: pass optimizer= to "
                             "initialize() or add an 'optimizer' section to the config")
        traces = collections.Counter(self.traces)
        try:
            _, treespec, static, _, arrays, rng, rows = self._placed(inputs, kwargs)
            accumulate = self.gradient_accumulation_steps() > 1  # the boundary's gradient joins the window's
            program = self._program("accumulate" if accumulate else "train", treespec, static, self._module.training)
            rep = self._replicated
            accum = None
            if accumulate:
                dtype = _jax_dtype(self.precision.grad_accum_dtype)
                accum = {n: jax.ShapeDtypeStruct(tuple(self.plan[n].shape), dtype, sharding=self._grad_specs[n])
                         for n in self._names}
            scalar = jax.ShapeDtypeStruct((), np.float32, sharding=rep)

            def step(params, masters, states, shared, accum, skipped, loss_scale, constants, rng, arrays, divisor,
                     hyper):
                scale = None if loss_scale is None else loss_scale.scale
                outputs, changed, grads = program.jitted(params, constants, accum, rng, arrays, scale, divisor)
                return self._update(params, masters, states, shared, grads, skipped, loss_scale, hyper), changed, \
                    outputs

            def traced():
                shardings = self._update_shardings
                if shardings[2] is None and self._opt_state and all(self._opt_state.values()):
                    # a torch optimizer's states, once they exist, come out as they went in: laid out
                    # so, each updates its input in place (donated) instead of being a new buffer
                    states = {n: {k: v.sharding for k, v in st.items()} for n, st in self._opt_state.items()}
                    shardings = (*shardings[:2], states, *shardings[3:])
                jitted = jax.jit(step, out_shardings=(shardings, None, None), donate_argnums=(0, 1, 2, 3, 4, 5, 6))
                return jitted.trace(self._params, self._masters, self._opt_state, self._shared_state, accum,
                                    self._skipped, self._loss_scale, self._constants, rng, arrays, scalar,
                                    self._abstract_hyper())

            try:
                try:
                    result = traced()
                except jax.errors.ConcretizationTypeError as err:
                    if not self._torch_optimizer or self._lr_mode != "traced":
                        raise self._reads_values(err) from err
                    # as the first real step does: its step reads the lr as a Python number (torch_optim.LR_MODES)
                    self._lr_mode = torch_optim.fallback_lr_mode(self.basic_optimizer)
                    self._static_hyper = torch_optim.static_hyperparameters(
                        self.basic_optimizer, with_lr=self._lr_mode == "constant")
                    self._update = self._build_update()
                    try:
                        result = traced()
                    except jax.errors.ConcretizationTypeError as again:  # the forward's, then
                        raise self._reads_values(again) from again
            except _NoLoss:
                raise ValueError(f"the module's output holds no scalar loss ({type(self._module).__name__}): the "
                                 "torchax backend's step compiles the training program, which takes the gradient of "
                                 "the loss the module returns (a scalar, a dict with a 'loss' key, an object with "
                                 ".loss, or a tuple whose first item is the loss)") from None
        finally:
            self.traces = traces
        return TracedStep(result, program.loss_index(), {n: tuple(self.plan[n].shape) for n in self._names},
                          self.precision.communication_dtype, self.train_micro_batch_size_per_gpu(),
                          self.gradient_accumulation_steps(), rows)

    def _abstract_hyper(self) -> list:
        """The update's hyperparameter input as ``jax.ShapeDtypeStruct``s: one float32 vector per
        param group, as ``_take_model_step`` gives it (none when a torch optimizer's lr is a
        constant of the program)."""
        import jax

        rep = self._replicated
        if self._torch_optimizer:
            return [] if self._lr_mode == "constant" else [
                jax.ShapeDtypeStruct((1,), np.float32, sharding=rep) for _ in self.basic_optimizer.param_groups]
        return [jax.ShapeDtypeStruct((len(self.basic_optimizer._hyper_values(g)),), np.float32, sharding=rep)
                for g in self.basic_optimizer.param_groups]

    def _state_spec(self, name: str, value):
        """An optimizer state's layout: the plan's for a parameter-shaped one, else replicated."""
        planned = self.plan[name]
        return self._sharding(planned.optimizer_state if tuple(value.shape) == tuple(planned.shape)
                              else replicated(value.ndim))

    def zero_grad(self) -> None:
        """DeepSpeed's ``engine.zero_grad()``: it sets the parameters' ``.grad`` to None, which
        drops the gradients accumulated since the last optimizer step only where the ZeRO stage
        still keeps them there (``zero_grad_keeps_gradients``): at stage 0, and at stage 1
        before the boundary's backward. A forward whose backward is still to come keeps its
        gradient: its backward takes it again without the dropped ones, as torch's would."""
        self._zero_grad(by_optimizer=False)

    def _zero_grad(self, by_optimizer: bool) -> None:
        if self._accum is not None and not self.zero_grad_keeps_gradients(by_optimizer, self._window_reduced):
            release_in_background(self._accum)
            self._set_accum(None)
            self._window_reduced = False

    # ---- reporting -------------------------------------------------------------------------------
    def get_global_grad_norm(self) -> Optional[float]:
        """The pre-clip global gradient norm of the last boundary step (reads the device; a
        non-finite fp32 norm is told once)."""
        norm = None if self._global_grad_norm is None else float(self._global_grad_norm)
        notice_nonfinite(self, norm, "gradient norm of the last step")
        return norm

    def step_loss(self) -> Optional[float]:
        """The mean of the losses passed to ``backward`` in the last optimizer step's
        accumulation window (what the step log and monitors report); reads the device."""
        loss = None if self._step_loss is None else float(self._step_loss)
        notice_nonfinite(self, loss, "loss")
        return loss

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for non-finite gradients (fp16, bf16's overflow check); reads the device."""
        return int(self._skipped)

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self._skipped = self._put(torch.tensor(float(value)), self._replicated)

    def was_step_applied(self) -> bool:
        """Whether the last optimizer step changed the parameters (False before the first)."""
        return self.global_steps > 0 and (self._last_skip is None or not bool(self._last_skip))

    def overflow(self) -> bool:
        """Whether the last optimizer step was skipped for non-finite gradients; reads the device."""
        return self._last_skip is not None and bool(self._last_skip)

    def loss_scale(self) -> float:
        """DeepSpeed's: the configured static fp16 loss scale (0 for dynamic scaling), 1.0 under
        bf16, 0 in fp32. The scale in use is ``current_loss_scale()``."""
        if self.fp16_enabled():
            return self._config.fp16.loss_scale
        return 1.0 if self.bfloat16_enabled() else 0

    def optimizer_step(self) -> None:
        """``engine.optimizer.step()``: DeepSpeed's ZeRO optimizer stepped by the caller, as the
        torch_xla backend has it (``optimizer_semantics``)."""
        from spmdzero.backends.torchax.optimizer_step import optimizer_step

        optimizer_step(self)

    def optimizer_zero_grad(self) -> None:
        """DeepSpeed's ZeRO ``optimizer.zero_grad()`` (``engine.optimizer.zero_grad()``)."""
        self._zero_grad(by_optimizer=True)

    def refresh_fp32_params(self) -> None:
        """DeepSpeed's ``optimizer.refresh_fp32_params()``: the fp32 master weights take the
        module's weights changed by hand. This backend takes such changes at every forward
        anyway; this takes them now."""
        self._take_host_changes()

    def current_loss_scale(self) -> float:
        """The loss scale in use (reads the device under fp16 scaling); 1.0 without one."""
        return 1.0 if self._loss_scale is None else float(self._loss_scale.scale)

    def last_loss(self) -> Optional[float]:
        """The loss last passed to ``backward``; reads the device."""
        loss = None if self._last_loss is None else float(_as_jax(self._last_loss, self._env))
        notice_nonfinite(self, loss, "loss")
        return loss

    def optimizer_states(self) -> dict[str, dict[str, Any]]:
        """The optimizer states by parameter name and key, as JAX arrays (laid out by the plan);
        the step counter is one array, the same in every parameter's states."""
        return {n: {**st, **self._shared_state} for n, st in self._opt_state.items()}

    def state_tensors(self) -> dict[str, tuple[Any, tuple]]:
        """Every device array of the training state by checkpoint key, with the partition spec
        the plan gives it: the torch_xla engine's keys (``model.*``, ``buffer.*``, ``master.*``,
        ``optim.<param>.<key>``), so that both backends' state reads the same. Reading only: a
        change made on the host since the last forward is not in it yet."""
        out: dict[str, tuple[Any, tuple]] = {}
        parameters = {name for name, _ in self._module.named_parameters()}
        for name, _ in self._host_tensors:
            if name in self._params:
                out[f"model.{name}"] = (self._params[name], tuple(self.plan[name].param))
            elif name in self._constants:
                kind = "model" if name in parameters else "buffer"
                out[f"{kind}.{name}"] = (self._constants[name], replicated(self._constants[name].ndim))
        for name, master in self._masters.items():
            out[f"master.{name}"] = (master, tuple(self.plan[name].master))
        for name, states in self.optimizer_states().items():
            shape = tuple(self._params[name].shape)
            for key, value in states.items():
                if self._torch_optimizer and key in torch_optim.HOST_KEYS:
                    continue  # in the host state (save_checkpoint), as torch_xla's torch optimizer keeps it
                spec = self.plan[name].optimizer_state if tuple(value.shape) == shape else replicated(value.ndim)
                out[f"optim.{name}.{key}"] = (value, tuple(spec))
        if self._loss_scale is not None:
            for field, value in zip(self._loss_scale._fields, self._loss_scale):
                out[f"loss_scale.{field}"] = (value, ())
        return out

    def master_weights(self) -> dict[str, torch.Tensor]:
        """The fp32 master weights by parameter name (empty in fp32 training), as torchax tensors
        over the JAX arrays (laid out by the plan's master spec), as the engine's outputs are."""
        return {n: self._Output(a, self._env) for n, a in self._masters.items()}

    def grad_buffers(self) -> dict[str, torch.Tensor]:
        """The gradients accumulated since the last optimizer step by parameter name, as torchax
        tensors (``accumulated_gradients`` as JAX arrays); empty between steps."""
        return {n: self._Output(a, self._env) for n, a in (self._accum or {}).items()}

    def accumulated_gradients(self) -> dict[str, Any]:
        """The gradients committed since the last optimizer step, by parameter name, as JAX
        arrays laid out by the plan's gradient spec; empty between steps."""
        return dict(self._accum or {})

    def sharding_report(self):
        """Per parameter: the layout and per-device bytes of the param, its gradient, master
        weight and optimizer states, read from the JAX arrays' shardings; totals against stage 0
        and ZeRO's accounting (as the torch_xla backend's)."""
        return sharding_report(self)

    def params(self) -> dict[str, Any]:
        """The trainable parameters by name, as JAX arrays (replicated)."""
        return self._params

    def wait(self) -> None:
        """Block until the dispatched programs have run and the arrays they consumed are released
        (``release.drain``: what the devices hold is then what the engine keeps)."""
        self._jax.block_until_ready((self._params, self._opt_state, self._accum))
        drain()

    def compile(self, *args, **kwargs) -> None:
        """DeepSpeed's ``engine.compile()`` (``torch.compile`` of the module; accelerate calls it
        when dynamo is on): this engine's programs are compiled by ``jax.jit`` already, so there
        is nothing more to compile. Said once; ``is_compiled`` is then True, as in DeepSpeed."""
        from spmdzero.observe.console import say_once

        say_once(["engine.compile(): the torchax backend's programs are already compiled by jax.jit; nothing "
                  "changes"])
        self._compiled = True

    @property
    def is_compiled(self) -> bool:
        return self.__dict__.get("_compiled", False)

    def collectives_report(self, *inputs, loss_fn=None, **kwargs):
        """The collectives of one training step on these inputs, compiled for XLA:CPU on this
        engine's devices, against the data-parallel minimum, as the torch_xla engine reports them.
        ``loss_fn(output)`` (or the module's own loss) is the loss; the step is traced
        (``trace_step``), not run, and the engine is left as it was."""
        from spmdzero.tpu.capture import JaxStepCapture

        module = self._module
        programs, own = self._programs, module.__dict__.get("forward")
        if loss_fn is not None:  # traced with the loss inside the forward, in programs of its own
            forward = module.forward
            self._programs = {}
            module.forward = lambda *args, **kw: _host_tensors_as_constants(loss_fn, forward(*args, **kw))
        try:
            step = JaxStepCapture(self, self.trace_step(*inputs, **kwargs))
        finally:
            if loss_fn is not None:
                self._programs = programs
                if own is None:
                    del module.forward
                else:
                    module.forward = own
        return step.collectives_report()

    # ---- the state protocol: what checkpoints use (spmdzero.io) ------------------------------------
    def optimized_names(self) -> dict[torch.Tensor, str]:
        """{optimizer target: its name in checkpoints}: the module's host parameters, which the
        optimizer's param groups hold (their values and states live on the devices)."""
        params = dict(self._module.named_parameters())
        return {params[name]: name for name in self._names}

    def stacked_layers(self) -> dict[str, str]:
        """{stacked parameter name: its stack's name} under ``spmd.scan_layers='stacked'`` (else
        empty): checkpoints record it so that they load into either form of the model, on
        either backend."""
        return stacked_layers(self._module)

    @property
    def scales_loss(self) -> bool:
        """Whether the loss is scaled (fp16): the loss scaler is then part of the state."""
        return self._loss_scale is not None

    @property
    def lazy_optimizer_state(self) -> bool:
        """Whether the optimizer creates its states at its first step (a torch.optim optimizer;
        spmdzero's make theirs up front)."""
        return self._torch_optimizer

    def placeholder_optimizer_state(self) -> list:
        """Give each trained parameter without optimizer states (a torch optimizer before its
        first step) the states that step creates, laid out by the plan, values meaning nothing,
        for a checkpoint load to write into; the host-kept ones (``torch_optim.HOST_KEYS``) go
        in ``optimizer.state``, as the torch_xla backend keeps them. On a shape-only engine each
        is a ``jax.ShapeDtypeStruct`` among the device states, where a later step has them all
        (what ``trace_step`` traces). Returns those parameters."""
        if not self._torch_optimizer:
            return []
        pending = [n for n in self._names if not self._opt_state[n]]
        if not pending:
            return []
        shapes = torch_optim.state_shapes(self.basic_optimizer, self._groups, self._masters or self._params, self._env,
                                          self._lr_mode)
        hosts = {name: p for p, name in self.optimized_names().items()}
        jax = self._jax
        for name in pending:
            device, host = {}, {}
            for key, shape in shapes[name].items():
                if self._shape_only:  # the states of a later step, all on the devices: what trace_step takes
                    device[key] = jax.ShapeDtypeStruct(shape.shape, shape.dtype, sharding=self._state_spec(name, shape))
                elif key in torch_optim.HOST_KEYS:
                    host[key] = torch.zeros(shape.shape, dtype=getattr(torch, str(shape.dtype)))
                else:
                    device[key] = jax.jit(functools.partial(jax.numpy.zeros, shape.shape, shape.dtype),
                                          out_shardings=self._state_spec(name, shape))()
            self._opt_state = {**self._opt_state, name: device}
            if host:
                self.basic_optimizer.state[hosts[name]] = host
        return [hosts[name] for name in pending]

    def drop_optimizer_state(self, targets) -> None:
        """Take the optimizer states of ``targets`` back to none (the next step creates them)."""
        names = self.optimized_names()
        for target in targets:
            self._opt_state = {**self._opt_state, names[target]: {}}
            self.basic_optimizer.state.pop(target, None)

    def _host_optimizer_state(self) -> None:
        """A torch optimizer's host-kept states (``torch_optim.HOST_KEYS``) copied into
        ``optimizer.state``, where a checkpoint saves them (a device read)."""
        for target, name in self.optimized_names().items():
            kept = {k: torch.tensor(np.asarray(v)) for k, v in self._opt_state[name].items()
                    if k in torch_optim.HOST_KEYS}
            if kept:
                self.basic_optimizer.state[target] = kept

    def _take_host_optimizer_state(self) -> None:
        """After a load: the host-kept states it wrote into ``optimizer.state`` go to the devices."""
        for target, name in self.optimized_names().items():
            kept = self.basic_optimizer.state.pop(target, {})
            values = {k: self._put(torch.as_tensor(v, dtype=torch.float32), self._replicated) for k, v in kept.items()
                      if k in torch_optim.HOST_KEYS}
            if values:
                self._opt_state = {**self._opt_state, name: {**self._opt_state[name], **values}}

    def state_shards(self):
        """The device side of checkpoints (``spmdzero.io.shards.StateShards``)."""
        from spmdzero.backends.torchax.checkpoint import TorchaxStateShards

        return TorchaxStateShards(self)

    def _load_state(self, values: dict[str, Any]) -> None:
        """Put loaded values (JAX arrays by checkpoint key, any dtype and layout) in place of the
        live ones, in the live dtype and layout: the programs see the same inputs as before and
        are not traced again."""
        jax = self._jax

        def like(live, value):
            return jax.device_put(value.astype(live.dtype), live.sharding)

        for key, value in values.items():
            kind, _, rest = key.partition(".")
            if kind == "model" and rest in self._params:
                self._params = {**self._params, rest: like(self._params[rest], value)}
                self._module_stale = True
            elif kind in ("model", "buffer") and rest in self._constants:
                self._constants = {**self._constants, rest: like(self._constants[rest], value)}
                self._buffers_stale.add(rest)
            elif kind == "loss_scale" and self._loss_scale is not None:
                self._loss_scale = self._loss_scale._replace(**{rest: like(getattr(self._loss_scale, rest), value)})
            elif kind == "master":
                self._masters = {**self._masters, rest: like(self._masters[rest], value)}
            elif kind == "optim":
                name, _, state = rest.rpartition(".")
                if state in self._shared_state:  # one counter for every parameter: each saved copy is the same
                    self._shared_state = {**self._shared_state, state: like(self._shared_state[state], value)}
                else:
                    self._opt_state = {**self._opt_state,
                                       name: {**self._opt_state[name], state: like(self._opt_state[name][state], value)}}
            else:
                raise KeyError(f"{key!r} is not a state tensor of this engine")  # _select picks live keys only
        jax.block_until_ready((self._params, self._constants, self._masters, self._opt_state, self._shared_state,
                               self._loss_scale))

    def loaded(self, new_window: bool) -> None:
        """A checkpoint load has written the state: drop the gradients accumulated before it (they
        go with the weights they were computed at); a forward before it has no backward (its
        gradient would be another weights'). The host module is brought up to date when it is
        next read."""
        self._set_accum(None)
        self._window_reduced = False
        self._generation += 1
        self._last_skip = None
        if self._torch_optimizer:
            self._take_host_optimizer_state()

    # ---- checkpoints (spmdzero.io) -----------------------------------------------------------------
    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True,  # noqa: B006 (DeepSpeed's)
                        exclude_frozen_parameters=False) -> bool:
        """DeepSpeed's ``save_checkpoint``, in the torch_xla backend's format (docs/checkpoints.md)."""
        from spmdzero.io.save import save_checkpoint

        self._take_host_changes()  # what the script changed on the module since the last forward is saved
        if not self._torch_optimizer:
            return save_checkpoint(self, save_dir, tag, client_state, save_latest, exclude_frozen_parameters)
        self._host_optimizer_state()
        try:
            return save_checkpoint(self, save_dir, tag, client_state, save_latest, exclude_frozen_parameters)
        finally:
            self.basic_optimizer.state.clear()

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False, trust_client_state=None):
        """DeepSpeed's ``load_checkpoint``: returns ``(load_path, client_state)``; loads either
        backend's checkpoints and DeepSpeed ZeRO-1/2 ones, on any device count."""
        from spmdzero.io.restore import load_checkpoint

        self._take_host_changes()  # the load then writes over the host's changes, not the reverse
        return load_checkpoint(self, load_dir, tag, load_module_strict, load_optimizer_states,
                               load_lr_scheduler_states, load_module_only, trust_client_state)

def _host_tensors_as_constants(fn, output):
    """``fn(output)`` traced, its host tensors (a target the loss function closes over) taken
    as constants of the program: torchax refuses math between its tensors and host ones. A move
    to a device (``y.to(engine.device)``, ``.cpu()``) keeps the value where the program has it:
    a traced value cannot be copied to the host."""
    import torchax
    from torchax import tensor as ttensor

    env = torchax.default_env()

    class HostTensorsAsConstants(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func in (torch.Tensor.cpu, torch.Tensor.cuda):
                return args[0]
            if func is torch.Tensor.to:  # only a dtype change stays
                dtype = kwargs.get("dtype", next((a for a in args[1:] if isinstance(a, torch.dtype)), None))
                args, kwargs = (args[0],) if dtype is None else (args[0], dtype), {}
            args, kwargs = torch_pytree.tree_map_only(
                torch.Tensor, lambda t: t if _is_torchax_tensor(t) else ttensor.Tensor(env.t2j_copy(t.detach()), env),
                (args, kwargs))
            return func(*args, **kwargs)

    with HostTensorsAsConstants():
        return fn(output)


def _broadcast_from_first_process(module: torch.nn.Module, seed: int) -> int:
    """Process 0's parameters and buffers copied into every process's ``module`` (DeepSpeed's
    engine broadcasts them from rank 0 at initialize, so each rank may seed or load its own),
    and process 0's ``seed``, returned. One program over every process's devices."""
    from jax.experimental import multihost_utils
    from torchax.ops import mappings

    tensors = [t for _, t in [*module.named_parameters(), *module.named_buffers()]]
    host = [np.asarray(mappings.t2j(t.detach().cpu())) for t in tensors]
    # booleans are summed as bytes (the broadcast adds process 0's values to the others' zeros)
    host = [h.view(np.uint8) if h.dtype == np.bool_ else h for h in host]
    seed_words = np.array([seed >> 32, seed & 0xFFFFFFFF], dtype=np.uint32)
    *values, seed_words = multihost_utils.broadcast_one_to_all([*host, seed_words])
    with torch.no_grad(), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The given NumPy array is not writable")  # it is copied
        for t, value in zip(tensors, values):
            value = np.asarray(value)
            t.copy_(mappings.j2t(value.view(np.bool_) if t.dtype == torch.bool else value, use_dlpack=False))
    return int(seed_words[0]) << 32 | int(seed_words[1])


def _refuse_optimizer_state(optimizer) -> None:
    """This backend keeps the optimizer states on the devices, as JAX arrays: the torch
    optimizer's own (empty) state dict would save nothing and load nothing, silently."""
    def refuse(*args, **kwargs):
        raise NotImplementedError("optimizer.state_dict()/load_state_dict() are not supported by the torchax backend "
                                  "(spmd.backend='torchax'): its optimizer states live on the devices "
                                  "(engine.optimizer_states()); engine.save_checkpoint/load_checkpoint save and load them")

    optimizer.state_dict = optimizer.load_state_dict = refuse


def _sync_before_state_dict(module: torch.nn.Module, engine: TorchaxEngine) -> None:
    """``model.state_dict()`` (``save_pretrained``, ``torch.save``) on the script's own reference
    to the model first brings the trained weights back from the devices, as ``engine.module``
    does. A weak reference: the hook does not keep the engine alive."""
    import weakref

    ref = weakref.ref(engine)

    def sync(*_):
        live = ref()
        if live is not None:
            live.module  # noqa: B018 (the property copies device values to the host when stale)

    # one engine's hooks per model: a model initialized again (a re-run notebook cell) is the
    # new engine's, and the old one must not write its values back into it
    for handle in getattr(module, "_spmdzero_state_dict_hooks", ()):
        handle.remove()
    module._spmdzero_state_dict_hooks = [sub.register_state_dict_pre_hook(sync) for sub in module.modules()]


def _zero_grad_through_engine(optimizer, engine: TorchaxEngine) -> None:
    """``engine.optimizer.zero_grad()`` is DeepSpeed's ZeRO optimizer's: it drops the
    accumulated gradients as that optimizer's does, stage by stage (``zero_grad_keeps_gradients``);
    the torch optimizer's own would clear the host parameters' ``.grad``, which hold nothing here."""
    ref = weakref.ref(engine)

    def zero_grad(set_to_none: bool = True):
        live = ref()
        if live is not None:
            live._zero_grad(by_optimizer=True)

    optimizer.zero_grad = zero_grad


# The engine sees the host's edits of the module's parameters at the next forward (as new
# in-place versions), and the host's values are a step behind until read. So the parameters get
# a subclass of their class (``_watched_class``) whose torch ops first bring the trained values
# to the host (``TorchaxEngine._host_use``): an edit in place or a read then sees them, as in
# torch. ``p.data`` is a tensor with a version counter of its own: its use is noted, and the
# next forward compares that parameter with the devices' copy.
_COMMITTED = object()  # ``loss._spmdzero_forward`` after backward committed that forward's gradient
_unwatched = torch._C.DisableTorchFunctionSubclass  # the engine's own reads and writes of the host parameters
_METADATA = frozenset({"__hash__", "size", "dim", "numel", "stride", "element_size", "is_floating_point",
                       "is_contiguous", "data_ptr"})  # tensor methods that read no values


@functools.cache
def _watchers():
    """host parameter -> a weak reference to the engine that trains it (by identity: tensors
    compare by value)."""
    from torch.utils.weak import WeakIdKeyDictionary

    return WeakIdKeyDictionary()


def _host_use(func, args: tuple, kwargs: dict) -> None:
    """Tell the engines of the watched parameters among an op's arguments, unless the op reads
    only what a step leaves alone (a shape, ``requires_grad``, a hash: no device read for those)."""
    owner = getattr(func, "__self__", None)
    through_data = owner is torch._C.TensorBase.data  # its getter or setter
    metadata = getattr(func, "__name__", None) in _METADATA or type(owner).__name__ == "getset_descriptor"
    if metadata and not through_data:
        return
    for t in torch_pytree.tree_leaves((args, kwargs)):
        if getattr(type(t), "_spmdzero_watched", False):
            ref = _watchers().get(t)
            engine = ref() if ref is not None else None
            if engine is not None:
                engine._host_use(t, through_data)


@functools.cache
def _watched_class(cls: type) -> type:
    """``cls`` (``nn.Parameter`` or a subclass) whose torch ops, ``.data`` included, tell the
    engine first. Pickled (``torch.save(model)``), such a parameter is a plain ``cls`` again."""

    def __torch_function__(klass, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        _host_use(func, args, kwargs)
        return cls.__torch_function__(func, types, args, kwargs)

    def __repr__(self):  # as the parameter prints without the subclass
        _host_use(None, (self,), {})
        with _unwatched():
            return repr(torch.Tensor._make_subclass(cls, self.detach(), self.requires_grad))

    return type(cls.__name__, (cls,), {"__torch_function__": classmethod(__torch_function__), "__repr__": __repr__,
                                       "_spmdzero_watched": True, "__module__": cls.__module__,
                                       "__qualname__": cls.__qualname__})


def _watch_parameters(module: torch.nn.Module, engine: TorchaxEngine) -> None:
    """The module's parameters' torch ops tell ``engine`` first (a model initialized again is
    the new engine's)."""
    ref, watchers = weakref.ref(engine), _watchers()
    for p in module.parameters():
        if not getattr(type(p), "_spmdzero_watched", False):
            p.__class__ = _watched_class(type(p))
        watchers[p] = ref


def _hashable(static: tuple) -> tuple:
    try:
        hash(static)
        return static
    except TypeError:
        return tuple((i, repr(v)) for i, v in static)
