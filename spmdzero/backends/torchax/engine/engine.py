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

What a step reads and writes is one value, ``engine.state`` (``programs/train_state.py``), and
the programs are plain functions of its arrays, built from what they need, named
(``programs/``: ``build_forward``, ``build_backward``, ``build_update``); ``engine.placement``
puts values on the mesh. The engine holds the state, keeps the programs by key and calls them.
Its host-side bookkeeping between the programs (each forward's gradient until its backward, the
host parameters' edits, outputs as torchax tensors) is written one concern a module, as parts of
this class: ``forward`` (running the forward programs), ``backward``, ``update`` (``step``),
``traced_step`` (the whole step as one program, for ``spmdzero aot``), ``state`` (checkpoints'
state protocol) and ``host_module`` (the wrapped ``nn.Module`` and its parameters on the host).
This module builds the engine and answers DeepSpeed's read-only accessors; the DeepSpeed API
around it all is ``train/engine_base.py``.
"""

from __future__ import annotations

import collections
import functools
import warnings
from types import SimpleNamespace
from typing import Any, Optional

import numpy as np
import torch

from spmdzero.sharding.batch import BatchSizes
from spmdzero.config.schema import DeepSpeedConfig
from spmdzero.observe.monitor import RecompileGuard, StepLogger, ThroughputTimer, notice_nonfinite
from spmdzero.optim.optimizers import SpmdOptimizer, ZeroOptimizer
from spmdzero.optim.schedules import LRSchedule
from spmdzero.optim.update import LossScale, init_loss_scale
from spmdzero.train.engine_base import EngineBase
from spmdzero.sharding.plan import ShardingPlan, replicated
from spmdzero.optim.precision import precision_policy
from spmdzero.train.build import move_in_place
from spmdzero.backends.torchax.engine import host_reads
from spmdzero.backends.torchax.outputs import host_tensors
from spmdzero.backends.torchax.engine import other_engines
from spmdzero.backends.torchax.engine import module_calls
from spmdzero.backends.torchax.optim import optimizer_state_dict
from spmdzero.backends.torchax.engine.mesh import jax_devices, mesh_devices
from spmdzero.sharding.mesh import data_parallel_axes, resolve_hybrid_shape
from spmdzero.backends.torchax.optim import torch_optim
from spmdzero.backends.torchax.lowering import traced_checks
from spmdzero.backends.torchax.lowering import attention, autocast, lowerings
from spmdzero.backends.torchax.patches import moe_rows
from spmdzero.backends.torchax.engine.release import drain
from spmdzero.backends.torchax.outputs.output_tensor import output_tensor_class
from spmdzero.backends.torchax.engine.host_module import (optimizer_state_through_engine, sync_before_state_dict,
                                                   watch_parameters, zero_grad_through_engine)
from spmdzero.backends.torchax.engine.placement import Placement, broadcast_from_first_process
from spmdzero.backends.torchax.lowering.values import as_jax
from spmdzero.backends.torchax.engine.backward import BackwardPrograms
from spmdzero.backends.torchax.engine.forward import ForwardPrograms
from spmdzero.backends.torchax.engine.host_module import HostModule
from spmdzero.backends.torchax.engine.state import StateProtocol
from spmdzero.backends.torchax.engine.traced_step import TracedSteps
from spmdzero.backends.torchax.programs.setup import ProgramSetup
from spmdzero.backends.torchax.programs.train_state import TrainState
from spmdzero.backends.torchax.engine.update import UpdateProgram







class TorchaxEngine(ForwardPrograms, BackwardPrograms, UpdateProgram, TracedSteps, StateProtocol, HostModule, EngineBase):
    """DeepSpeed's engine API over two jitted programs (see the module docstring)."""

    SHAPE_BUCKETS_BY_DEFAULT = True  # its outputs are cut back outside the compiled step (train.shape_buckets)

    def __init__(self, module: torch.nn.Module, optimizer: SpmdOptimizer, lr_scheduler: Any, cfg: DeepSpeedConfig,
                 batch: BatchSizes, plan: ShardingPlan, mesh_shape: dict[str, int], device_count: int,
                 training_dataloader: Any = None, config_dict: Optional[dict] = None, devices=None,
                 shape_only: bool = False):
        import jax
        import torchax
        from jax.sharding import AbstractMesh, Mesh

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
            seed = broadcast_from_first_process(module, seed)
        self._env = torchax.default_env()
        lowerings.install(self._env)  # torch's values where torchax's lowerings differ (masked rows, padding_idx)
        autocast.install()  # torch.autocast regions on the device (a script's around its loss; the module's own)
        host_tensors.name_devices_by_type(self._env)  # x.to(0) in a traced forward
        traced_checks.install()  # torch._check_tensor_all_with and f"{t}" of a traced value: no host read
        self._Output = output_tensor_class()
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
        self.placement = Placement(self.mesh, self._processes, shape_only, batch, plan)
        spec = self.placement.sharding
        # the platform the step compiles for (a shape-only step is a TPU's): which kernels it takes,
        # SDPA's (spmd.attention) and the experts' grouped matmuls (moe_rows)
        self.platform = "tpu" if shape_only else self.mesh.devices.flat[0].platform
        axes = data_parallel_axes(mesh_shape)
        self.attention_kernels = attention.AttentionChoice.resolve(
            cfg.spmd.attention, self.platform, mesh=self.mesh,
            batch_axes=axes, batch_devices=int(np.prod([mesh_shape[a] for a in axes])))
        self.expert_matmuls = moe_rows.Split(self.mesh, axes, self.platform)

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
        masters = {n: self.placement.put(p.float(), self._master_specs[n]) for n, p in module.named_parameters()
                         if n in self._master_specs}
        if self.precision.param_dtype != torch.float32:  # with fp32 masters, or bf16 ones (the parameters)
            move_in_place(module, self.precision.param_dtype)
        params = {n: self.placement.put(p.detach(), self._param_specs[n]) for n, p in module.named_parameters()
                        if n in trained}
        constants = {n: self.placement.put(t.detach(), self.placement.replicated)
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
                # bf16.bf16_optimizer_states: the per-element states in bf16 (step counters as they are)
                initial = {k: v.to(self.precision.state_dtype) if v.dim() and v.is_floating_point() else v
                           for k, v in initial.items()}
                self._state_specs[name] = {k: spec(plan[name].optimizer_state if tuple(v.shape) == tuple(p.shape)
                                                   else replicated(v.dim())) for k, v in initial.items()}
                states[name] = {k: self.placement.put(v, self._state_specs[name][k]) for k, v in initial.items()}
        # Every parameter steps together here (one update, one overflow skip): the optimizer's step
        # counters are one array, not one per parameter, so fewer arrays pass through every update.
        first = states.get(self._names[0], {}) if self._names else {}
        shared_state = {"step": first["step"]} if "step" in first else {}
        opt_state = {n: {k: v for k, v in st.items() if k not in shared_state} for n, st in states.items()}
        self._state_specs = {n: {k: v for k, v in st.items() if k not in shared_state}
                             for n, st in self._state_specs.items()}
        # A training forward's gradient belongs to the loss it returned (``loss._spmdzero_forward``,
        # its inputs and the accumulation with its gradient added), until backward commits it.
        self._accum_token = 0  # changes with _accum (_set_accum)
        self._unconfirmed: list = []  # forwards whose gradient _accum holds before their backward (_settle)
        self._subtract_program = None  # built at the first such forward taken out again
        self._generation = 0  # changes with the parameters (an update, a change taken from the host)
        self._draws_at, self._draws = None, [0, 0]  # forwards of the micro-step so far, by stream (_next_draw)
        self._window_reduced = False  # the last backward was at a boundary (zero_grad_keeps_gradients)
        self._overwrite_at_backward = False  # zero_grad_overwrites_next_backward
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
        self.samples_last_step = 0  # rows the last optimizer step trained on (the monitors' throughput)
        self._global_grad_norm = None
        # fp16's loss scaler (DeepSpeed's DynamicLossScaler, or a static scale): device scalars that
        # the training program multiplies the loss by and the update program steps (optim/update.py)
        initial = init_loss_scale(self.precision)
        loss_scale = None if initial is None else LossScale(
            *(self.placement.put(torch.tensor(v, dtype=torch.float32), self.placement.replicated) for v in initial))
        # draw_step: micro-steps the random stream has passed, folded into each forward's key:
        # micro_steps as counted here, saved as a checkpoint's rng.position and restored exactly (a
        # load puts micro_steps at the window's start instead, global_steps x gradient_accumulation_steps)
        self.state = TrainState(params=params, masters=masters, opt_state=opt_state, shared_state=shared_state,
                                skipped=self.placement.put(torch.zeros(()), self.placement.replicated), loss_scale=loss_scale,
                                constants=constants, accum=None, rng=None, draw_step=0)
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
        watch_parameters(module, self)
        self._warned_fewer_rows = False
        if optimizer is not None:
            optimizer_state_through_engine(optimizer, self)
            zero_grad_through_engine(optimizer, self)
        sync_before_state_dict(module, self)
        module_calls.register(module, self)  # the script's own calls to the module train as the engine's
        self._seed(seed)  # process 0's
        self._programs: dict = {}  # jitted functions by static structure
        self._other_engines: list = []  # engines called inside this one's programs (other_engines.py)
        other_engines.register(self)
        self._forward_swaps: list = []  # what the last trace did to modules' forward attributes
        # programs whose trace reads a value on the host run eagerly (host_reads)
        self._host_reads = host_reads.Fallback(self, type(module).__name__)
        self.traces: collections.Counter = collections.Counter()  # by program kind, counted while tracing
        self.runs: collections.Counter = collections.Counter()  # programs executed, by kind
        # training programs traced after warm-up: a warning, or an error past spmd.max_recompiles
        self.recompile_guard = RecompileGuard(cfg.spmd.max_recompiles, "JAX_LOG_COMPILES=1 logs each compilation.")
        self._traces_at_step = 0
        self._input_shapes: tuple = ()  # the last training forward's, to name a shape change
        # what the programs are built from (programs/setup.py): they read nothing else of the engine
        self._setup = ProgramSetup(
            env=self._env, module=module, trained=tuple(self._names), plan=plan, sharding=spec,
            param_specs=self._param_specs, grad_specs=self._grad_specs, policy=self.precision,
            attention_kernels=self.attention_kernels, expert_matmuls=self.expert_matmuls, processes=self._processes,
            count_trace=self._count_trace, compile=self._host_reads)
        self._update = self._build_update() if optimizer is not None else None
        optimizer_state_dict.take_given_state(self)  # a torch optimizer resumed before initialize
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
            self.state = self.state._replace(rng=self._jax.ShapeDtypeStruct(shape.shape, shape.dtype, sharding=self.placement.replicated))
            return
        # one key for every process: a global array when the mesh spans processes
        self.state = self.state._replace(rng=key() if self._processes == 1 else self._jax.jit(key, out_shardings=self.placement.replicated)())

    def _count_trace(self, kind: str) -> None:
        """A program of ``kind`` is being traced (a trace is a compile: the recompile guard reads the count)."""
        self.traces[kind] += 1

    # ---- reporting -------------------------------------------------------------------------------
    @property
    def skipped_steps(self) -> int:
        """Steps skipped for non-finite gradients (fp16, bf16's overflow check); reads the device."""
        return int(self.state.skipped)

    @skipped_steps.setter
    def skipped_steps(self, value: int) -> None:
        self.state = self.state._replace(skipped=self.placement.put(torch.tensor(float(value)), self.placement.replicated))

    def was_step_applied(self) -> bool:
        """Whether the last optimizer step changed the parameters (False before the first)."""
        return self.global_steps > 0 and (self._last_skip is None or not bool(self._last_skip))

    def overflow(self) -> bool:
        """Whether the last optimizer step was skipped for non-finite gradients; reads the device."""
        return self._last_skip is not None and bool(self._last_skip)

    def optimizer_step(self) -> None:
        """``engine.optimizer.step()``: DeepSpeed's ZeRO optimizer stepped by the caller, as the
        torch_xla backend has it (``optimizer_semantics``)."""
        from spmdzero.backends.torchax.optim.optimizer_step import optimizer_step

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
        return 1.0 if self.state.loss_scale is None else float(self.state.loss_scale.scale)

    def last_loss(self) -> Optional[float]:
        """The loss last passed to ``backward``; reads the device."""
        loss = None if self._last_loss is None else float(as_jax(self._last_loss, self._env))
        notice_nonfinite(self, loss, "loss")
        return loss

    def optimizer_states(self) -> dict[str, dict[str, Any]]:
        """The optimizer states by parameter name and key, as JAX arrays (laid out by the plan);
        the step counter is one array, the same in every parameter's states."""
        return {n: {**st, **self.state.shared_state} for n, st in self.state.opt_state.items()}

    def state_tensors(self) -> dict[str, tuple[Any, tuple]]:
        """Every device array of the training state by checkpoint key, with the partition spec
        the plan gives it: the torch_xla engine's keys (``model.*``, ``buffer.*``, ``master.*``,
        ``optim.<param>.<key>``), so that both backends' state reads the same. Reading only: a
        change made on the host since the last forward is not in it yet."""
        out: dict[str, tuple[Any, tuple]] = {}
        parameters = {name for name, _ in self._module.named_parameters()}
        for name, _ in self._host_tensors:
            if name in self.state.params:
                out[f"model.{name}"] = (self.state.params[name], tuple(self.plan[name].param))
            elif name in self.state.constants:
                kind = "model" if name in parameters else "buffer"
                out[f"{kind}.{name}"] = (self.state.constants[name], replicated(self.state.constants[name].ndim))
        for name, master in self.state.masters.items():
            out[f"master.{name}"] = (master, tuple(self.plan[name].master))
        for name, states in self.optimizer_states().items():
            shape = tuple(self.state.params[name].shape)
            for key, value in states.items():
                if self._torch_optimizer and key in torch_optim.HOST_KEYS:
                    continue  # in the host state (save_checkpoint), as torch_xla's torch optimizer keeps it
                spec = self.plan[name].optimizer_state if tuple(value.shape) == shape else replicated(value.ndim)
                out[f"optim.{name}.{key}"] = (value, tuple(spec))
        if self.state.loss_scale is not None:
            for field, value in zip(self.state.loss_scale._fields, self.state.loss_scale):
                out[f"loss_scale.{field}"] = (value, ())
        return out

    def master_weights(self) -> dict[str, torch.Tensor]:
        """The fp32 master weights by parameter name (empty in fp32 training), as torchax tensors
        over the JAX arrays (laid out by the plan's master spec), as the engine's outputs are."""
        return {n: self._Output(a, self._env) for n, a in self.state.masters.items()}

    def grad_buffers(self) -> dict[str, torch.Tensor]:
        """The gradients accumulated since the last optimizer step by parameter name, as torchax
        tensors (``accumulated_gradients`` as JAX arrays); empty between steps."""
        self._settle()
        return {n: self._Output(a, self._env) for n, a in (self.state.accum or {}).items()}

    def accumulated_gradients(self) -> dict[str, Any]:
        """The gradients committed since the last optimizer step, by parameter name, as JAX
        arrays laid out by the plan's gradient spec; empty between steps."""
        self._settle()
        return dict(self.state.accum or {})

    def params(self) -> dict[str, Any]:
        """The trainable parameters by name, as JAX arrays (replicated)."""
        return self.state.params

    def wait(self) -> None:
        """Block until the dispatched programs have run and the arrays they consumed are released
        (``release.drain``: what the devices hold is then what the engine keeps)."""
        self._jax.block_until_ready((self.state.params, self.state.opt_state, self.state.accum))
        drain()
