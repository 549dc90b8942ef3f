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

What a step reads and writes is one value, ``engine.state`` (``programs/train_state.py``), made
by ``initial_state``; the programs are plain functions of its arrays, built from what they need
(``programs/``: ``build_forward``, ``build_backward``, ``build_update``). The engine holds the state
and is made of parts, each owning its own bookkeeping and reading the others only through what
they offer: ``placement`` (puts values on the mesh), ``host`` (the wrapped module on the host and
its edits, ``host_module.HostCopy``), ``forwards`` (placing inputs, the programs by key, outputs
as torch tensors, ``forward.Forwards``), ``gradients`` (each forward's gradient until its backward,
``backward.Gradients``), ``updates`` (the optimizer step, ``update.Updates``) and ``generation``
(``generate`` on the devices, ``generation.Generation``). The checkpoint protocol and the traced
step are functions of the engine (``state``, ``traced_step``). This class builds it all and
answers DeepSpeed's API with them; the API common to both backends is ``train/engine_base.py``.
"""

from __future__ import annotations

import collections
import functools
from typing import Any, Optional

import numpy as np
import torch

from spmdzero.sharding.batch import BatchSizes
from spmdzero.config.schema import DeepSpeedConfig
from spmdzero.observe.monitor import RecompileGuard, StepLogger, ThroughputTimer, notice_nonfinite
from spmdzero.optim.optimizers import SpmdOptimizer, ZeroOptimizer
from spmdzero.train.engine_base import NO_GRADIENTS, EngineBase
from spmdzero.train.scan_layers import stacked_layers
from spmdzero.sharding.plan import ShardingPlan
from spmdzero.optim.precision import precision_policy
from spmdzero.runtime.out_of_memory import raises_torch_out_of_memory
from spmdzero.backends.torchax.engine import host_reads, module_calls, other_engines, state as state_io, traced_step
from spmdzero.backends.torchax.outputs import host_tensors
from spmdzero.backends.torchax.optim import optimizer_state_dict
from spmdzero.backends.torchax.engine.mesh import jax_devices, mesh_devices
from spmdzero.sharding.mesh import data_parallel_axes, resolve_hybrid_shape
from spmdzero.backends.torchax.lowering import attention, autocast, lowerings, traced_checks
from spmdzero.backends.torchax.patches import moe_rows
from spmdzero.backends.torchax.engine.release import drain
from spmdzero.backends.torchax.outputs.output_tensor import output_tensor_class
from spmdzero.backends.torchax.engine.host_module import (HostCopy, engine_attribute, optimizer_state_through_engine,
                                                          sync_before_state_dict, watch_parameters,
                                                          zero_grad_through_engine)
from spmdzero.backends.torchax.engine.placement import Placement, broadcast_from_first_process
from spmdzero.backends.torchax.engine.initial_state import initial_state
from spmdzero.backends.torchax.lowering.values import as_jax
from spmdzero.backends.torchax.engine.backward import Gradients
from spmdzero.backends.torchax.engine.forward import Forwards
from spmdzero.backends.torchax.programs.setup import ProgramSetup
from spmdzero.backends.torchax.engine.update import Updates
from spmdzero.backends.torchax.engine.generation import Generation


class TorchaxEngine(EngineBase):
    """DeepSpeed's engine API over jitted programs and the engine's parts (see the module docstring)."""

    SHAPE_BUCKETS_BY_DEFAULT = True  # its outputs are cut back outside the compiled step (train.shape_buckets)

    def __init__(self, module: torch.nn.Module, optimizer: SpmdOptimizer, lr_scheduler: Any, cfg: DeepSpeedConfig,
                 batch: BatchSizes, plan: ShardingPlan, mesh_shape: dict[str, int], device_count: int,
                 training_dataloader: Any = None, config_dict: Optional[dict] = None, devices=None,
                 shape_only: bool = False):
        import jax
        import torchax
        from jax.sharding import AbstractMesh, Mesh

        # shape-only (spmdzero aot): the mesh names no device and every array of the state is a
        # jax.ShapeDtypeStruct with its layout, so any topology's step lowers on any machine and
        # no parameter is ever materialized (``trace_step``)
        self.shape_only = shape_only
        if shape_only:
            self.processes = 1
        else:
            dcn = None if cfg.spmd.dcn_mesh is None else resolve_hybrid_shape(cfg.spmd.mesh, cfg.spmd.dcn_mesh,
                                                                               device_count)[1]
            if devices is None:  # before any JAX array; else a mesh given to initialize, in its order
                devices = mesh_devices(jax_devices(device_count), mesh_shape, dcn)
            self.processes = jax.process_count()  # hosts joined by jax.distributed; 1 without
        seed = torch.initial_seed()
        if self.processes > 1:
            seed = broadcast_from_first_process(module, seed)
        self.env = torchax.default_env()  # torch ops on JAX
        lowerings.install(self.env)  # torch's values where torchax's lowerings differ (masked rows, padding_idx)
        autocast.install()  # torch.autocast regions on the device (a script's around its loss; the module's own)
        host_tensors.name_devices_by_type(self.env)  # x.to(0) in a traced forward
        traced_checks.install()  # torch._check_tensor_all_with and f"{t}" of a traced value: no host read
        self.output_tensor = output_tensor_class()  # the class of the tensors handed back (outputs/output_tensor.py)
        self.basic_optimizer = optimizer
        # DeepSpeed's ZeRO optimizer face, as the torch_xla engine's; None without an optimizer (a model
        # only evaluated, or only given gradients: DeepSpeed-Chat's reference and reward models)
        self.optimizer = None if optimizer is None else ZeroOptimizer(optimizer, self)
        # a torch.optim optimizer's own step runs in the update (torch_optim), not spmdzero's math
        self.torch_optimizer = optimizer is not None and not isinstance(optimizer, SpmdOptimizer)
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
        self.placement = Placement(self.mesh, self.processes, shape_only, batch, plan)
        # the platform the step compiles for (a shape-only step is a TPU's): which kernels it takes,
        # SDPA's (spmd.attention) and the experts' grouped matmuls (moe_rows)
        self.platform = "tpu" if shape_only else self.mesh.devices.flat[0].platform
        axes = data_parallel_axes(mesh_shape)
        self.attention_kernels = attention.AttentionChoice.resolve(
            cfg.spmd.attention, self.platform, mesh=self.mesh,
            batch_axes=axes, batch_devices=int(np.prod([mesh_shape[a] for a in axes])))
        self.expert_matmuls = moe_rows.Split(self.mesh, axes, self.platform)
        self.state, self.trained = initial_state(module, optimizer, plan, self.placement, self.precision,
                                                 self.torch_optimizer)
        self.params_version = 0  # changes with the parameters (an update, a load, a change taken from the host)
        self._last_loss = None
        self._window_loss = self._step_loss = None  # the mean loss of the accumulation window, a JAX array
        self._step_logger = StepLogger(cfg, device_clock=None, process_index=self.global_rank)  # no torch_xla clock
        self.tput_timer = ThroughputTimer(self)  # DeepSpeed's; here the time between dispatched steps
        self._rows_since_step = 0  # training rows fed: global_samples
        self.samples_last_step = 0  # rows the last optimizer step trained on (the monitors' throughput)
        self._global_grad_norm = None
        self._warned_fewer_rows = False
        self.traces: collections.Counter = collections.Counter()  # by program kind, counted while tracing
        self.runs: collections.Counter = collections.Counter()  # programs executed, by kind
        # training programs traced after warm-up: a warning, or an error past spmd.max_recompiles
        self.recompile_guard = RecompileGuard(cfg.spmd.max_recompiles, "JAX_LOG_COMPILES=1 logs each compilation.")
        self._traces_at_step = 0
        self._input_shapes: tuple = ()  # the last training forward's, to name a shape change
        # programs whose trace reads a value on the host run eagerly (host_reads)
        self.host_reads = host_reads.Fallback(self, type(module).__name__)
        # what the programs are built from (programs/setup.py): they read nothing else of the engine
        self.setup = ProgramSetup(
            env=self.env, module=module, trained=self.trained.names, plan=plan, sharding=self.placement.sharding,
            param_specs=self.trained.param_specs, grad_specs=self.trained.grad_specs, policy=self.precision,
            attention_kernels=self.attention_kernels, expert_matmuls=self.expert_matmuls, processes=self.processes,
            count_trace=self.count_trace, compile=self.host_reads)
        # the parts (see the module docstring)
        self.host = HostCopy(self, module, cfg.spmd.host_parameters)
        self.gradients = Gradients(self, divisor=float(self.gradient_accumulation_steps()))
        self.forwards = Forwards(self)
        self.updates = Updates(self, lr_scheduler)
        self.generation = Generation(self, cfg.spmd.generate)
        watch_parameters(module, self)
        if optimizer is not None:
            optimizer_state_through_engine(optimizer, self)
            zero_grad_through_engine(optimizer, self)
        sync_before_state_dict(module, self)
        module_calls.register(module, self)  # the script's own calls to the module train as the engine's
        self.reseed(seed)  # process 0's
        other_engines.register(self)
        optimizer_state_dict.take_given_state(self)  # a torch optimizer resumed before initialize

    def reseed(self, seed: int) -> None:
        """The key dropout draws from (folded with the micro-step); its seed is what a
        checkpoint saves as ``rng.xla``."""
        import jax

        self.rng_seed = int(seed)  # torch_xla's seeds are 64-bit unsigned, JAX's signed
        key = functools.partial(jax.random.key, self.rng_seed % (1 << 63))
        if self.shape_only:
            shape = jax.eval_shape(key)
            self.state = self.state._replace(rng=jax.ShapeDtypeStruct(shape.shape, shape.dtype,
                                                                      sharding=self.placement.replicated))
            return
        # one key for every process: a global array when the mesh spans processes
        self.state = self.state._replace(rng=key() if self.processes == 1 else jax.jit(
            key, out_shardings=self.placement.replicated)())

    def count_trace(self, kind: str) -> None:
        """A program of ``kind`` is being traced (a trace is a compile: the recompile guard reads the count)."""
        self.traces[kind] += 1

    # ---- the training step: forward, backward, step ---------------------------------------
    def __call__(self, *inputs, **kwargs):
        return self.forward(*inputs, **kwargs)

    @raises_torch_out_of_memory
    def forward(self, *inputs, **kwargs):
        """Run the module in one jitted program; in training (train mode, grad enabled) it also
        takes the gradient of the loss the module returns (see the module docstring). A forward
        that reads a tensor's value on the host runs eagerly (``host_reads``)."""
        return self.forwards.run(inputs, kwargs)

    @raises_torch_out_of_memory
    def backward(self, loss, retain_graph: bool = False, scale_wrt_gas: bool = True):
        """Commit the gradients of ``loss`` as torch's backward of it would, scaled by
        1/gradient_accumulation_steps (and fp16's loss scale) as DeepSpeed does
        (``Gradients.backward``). Returns the loss scaled by 1/gradient_accumulation_steps, as
        DeepSpeed does."""
        self._rows_since_step += self.gradients.backward(loss, retain_graph, scale_wrt_gas)
        self._last_loss = loss
        gas = self.gradient_accumulation_steps()
        term = as_jax(loss, self.env).astype("float32") / gas  # a JAX op: no device read
        self._window_loss = term if self._window_loss is None else self._window_loss + term
        return loss / gas if gas > 1 else loss

    def scale(self, loss):
        """DeepSpeed's ``engine.scale(loss)``, for a backward the script runs itself: ``loss``
        times fp16's loss scale (``Gradients.scale``); ``loss`` itself in bf16 and fp32."""
        return self.gradients.scale(loss)

    @raises_torch_out_of_memory
    def step(self, lr_kwargs: Optional[dict] = None) -> None:
        """Apply the update at an accumulation boundary; count every call; hold the step's
        traces to the recompile guard."""
        boundary = self.is_gradient_accumulation_boundary()
        self.gradients.settle()  # a forward that no backward followed adds nothing
        if boundary:
            if self.optimizer is None:
                raise RuntimeError("engine.step() needs an optimizer: pass optimizer= to initialize() or add an "
                                   "'optimizer' section to the config")
            if self.state.accum is None:
                raise RuntimeError(NO_GRADIENTS)
            self._take_model_step(lr_kwargs)
        self.micro_steps += 1
        self.state = self.state._replace(draw_step=self.state.draw_step + 1)
        # the training programs traced since the last step (a trace is a compile); an evaluation
        # forward's program is not the step's, nor a generation's (one per bucket)
        traces = sum(n for kind, n in self.traces.items() if kind not in ("forward", "generate"))
        self.recompile_guard.check(traces - self._traces_at_step, self.global_steps, boundary, self._input_shapes,
                                   warmup=self.new_shape_bucket())
        self._traces_at_step = traces

    def _take_model_step(self, lr_kwargs: Optional[dict]) -> None:
        """The engine's optimizer step: the update, then the schedule, the counters and the step
        log, as DeepSpeed's ``engine._take_model_step``."""
        self.apply_update(lr_kwargs, clipped=True)
        self.updates.step_schedule(lr_kwargs)
        self.global_steps += 1
        self.global_samples += self.consume_samples()
        self._step_logger.after_boundary(self)  # reads the device at print steps only
        self.tput_timer.after_boundary()
        self.run_post_step_hooks()

    def apply_update(self, lr_kwargs: Optional[dict], clipped: bool) -> None:
        """The update program on the accumulated gradients (``Updates.apply``; ``clipped``: with
        the config's gradient clipping), the window's loss and the gradient norm kept for reports."""
        self._global_grad_norm = self.updates.apply(lr_kwargs, clipped)
        self.host.params_changed()
        self._step_loss, self._window_loss = self._window_loss, None

    def zero_grad(self) -> None:
        """DeepSpeed's ``engine.zero_grad()``: it sets the parameters' ``.grad`` to None, which
        drops the gradients accumulated since the last optimizer step only where the ZeRO stage
        still keeps them there (``zero_grad_keeps_gradients``): at stage 0, and at stage 1
        before the boundary's backward. A forward whose backward is still to come keeps its
        gradient: its backward takes it again without the dropped ones, as torch's would."""
        self.gradients.zero_grad(by_optimizer=False)

    def optimizer_step(self) -> None:
        """``engine.optimizer.step()``: DeepSpeed's ZeRO optimizer stepped by the caller, as the
        torch_xla backend has it (``optimizer_semantics``)."""
        from spmdzero.backends.torchax.optim.optimizer_step import optimizer_step

        optimizer_step(self)

    def optimizer_zero_grad(self) -> None:
        """DeepSpeed's ZeRO ``optimizer.zero_grad()`` (``engine.optimizer.zero_grad()``)."""
        self.gradients.zero_grad(by_optimizer=True)

    def refresh_fp32_params(self) -> None:
        """DeepSpeed's ``optimizer.refresh_fp32_params()``: the fp32 master weights take the
        module's weights changed by hand. This backend takes such changes at every forward
        anyway; this takes them now."""
        self.host.take_changes()

    def trace_step(self, *inputs, **kwargs) -> "traced_step.TracedStep":
        """One training step at the boundary, traced as ONE program and not run (``spmdzero aot``)."""
        return traced_step.trace_step(self, inputs, kwargs)

    def collectives_report(self, *inputs, loss_fn=None, **kwargs):
        """The collectives of one training step on these inputs (``traced_step.collectives_report``)."""
        return traced_step.collectives_report(self, inputs, kwargs, loss_fn)

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

    # ---- the module (host_module.py) ----------------------------------------------------------
    @property
    def module(self) -> torch.nn.Module:
        """The torch module; its parameters come up to date from the devices at their first
        torch op after a step (``HostCopy.current``)."""
        return self.host.current(parameters=False)

    def train(self, mode: bool = True) -> "TorchaxEngine":
        self.host.wrapped.train(mode)
        return self

    def eval(self) -> "TorchaxEngine":
        return self.train(False)

    @property
    def training(self) -> bool:
        return self.host.wrapped.training

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
        return {"module": self.host.wrapped}

    def __getattr__(self, name: str):
        """Attributes the engine lacks come from the module, as in DeepSpeed; a method of the
        model's own classes computes on the devices (``host_module.engine_attribute``)."""
        if name.startswith("_") or name in ("host", "forwards", "gradients", "updates", "generation"):
            raise AttributeError(name)  # a part asked for before it exists (in __init__)
        return engine_attribute(self, name)

    # ---- the state protocol: what checkpoints use (state.py, spmdzero.io) --------------------
    def optimized_names(self) -> dict[torch.Tensor, str]:  # {target: checkpoint name} (``state.optimized_names``)
        return state_io.optimized_names(self)

    def stacked_layers(self) -> dict[str, str]:
        """{stacked parameter name: its stack's name} under ``spmd.scan_layers='stacked'`` (else
        empty): checkpoints record it so that they load into either form of the model, on
        either backend."""
        return stacked_layers(self.host.wrapped)

    @property
    def scales_loss(self) -> bool:
        """Whether the loss is scaled (fp16): the loss scaler is then part of the state."""
        return self.state.loss_scale is not None

    @property
    def lazy_optimizer_state(self) -> bool:
        """Whether the optimizer creates its states at its first step (a torch.optim optimizer;
        spmdzero's make theirs up front)."""
        return self.torch_optimizer

    def placeholder_optimizer_state(self) -> list:
        """States for a load to write into, before a torch optimizer's first step (``state.placeholder_optimizer_state``)."""
        return state_io.placeholder_optimizer_state(self)

    def drop_optimizer_state(self, targets) -> None:  # none until the next step (``state.drop_optimizer_state``)
        state_io.drop_optimizer_state(self, targets)

    def state_shards(self):
        """The device side of checkpoints (``spmdzero.io.shards.StateShards``)."""
        from spmdzero.backends.torchax.engine.checkpoint import TorchaxStateShards

        return TorchaxStateShards(self)

    def load_state(self, values: dict[str, Any]) -> None:
        """Loaded values in place of the live ones, in their dtype and layout (``state.load_state``)."""
        state_io.load_state(self, values)

    def take_host_optimizer_state(self) -> None:  # after a load (``state.take_host_optimizer_state``)
        state_io.take_host_optimizer_state(self)

    def loaded(self, new_window: bool) -> None:
        """A checkpoint load has written the state (``state.loaded``)."""
        state_io.loaded(self)

    def save_checkpoint(self, save_dir, tag=None, client_state={}, save_latest=True,  # noqa: B006 (DeepSpeed's)
                        exclude_frozen_parameters=False) -> bool:
        """DeepSpeed's ``save_checkpoint``, in the torch_xla backend's format (docs/checkpoints.md)."""
        return state_io.save_checkpoint(self, save_dir, tag, client_state, save_latest, exclude_frozen_parameters)

    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False, trust_client_state=None):
        """DeepSpeed's ``load_checkpoint``: returns ``(load_path, client_state)``; loads either
        backend's checkpoints and DeepSpeed ZeRO-1/2 ones, on any device count."""
        return state_io.load_checkpoint(self, load_dir, tag, load_module_strict, load_optimizer_states,
                                        load_lr_scheduler_states, load_module_only, trust_client_state)

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
        return self.global_steps > 0 and (self.updates.last_skip is None or not bool(self.updates.last_skip))

    def overflow(self) -> bool:
        """Whether the last optimizer step was skipped for non-finite gradients; reads the device."""
        return self.updates.last_skip is not None and bool(self.updates.last_skip)

    def current_loss_scale(self) -> float:
        """The loss scale in use (reads the device under fp16 scaling); 1.0 without one."""
        return 1.0 if self.state.loss_scale is None else float(self.state.loss_scale.scale)

    def last_loss(self) -> Optional[float]:
        """The loss last passed to ``backward``; reads the device."""
        loss = None if self._last_loss is None else float(as_jax(self._last_loss, self.env))
        notice_nonfinite(self, loss, "loss")
        return loss

    def optimizer_states(self) -> dict[str, dict[str, Any]]:
        """The optimizer states by parameter name and key, as JAX arrays (laid out by the plan);
        the step counter is one array, the same in every parameter's states."""
        return {n: {**st, **self.state.shared_state} for n, st in self.state.opt_state.items()}

    def state_tensors(self) -> dict[str, tuple[Any, tuple]]:
        """Every device array of the training state by checkpoint key, with its partition spec
        (``state.state_tensors``): the torch_xla engine's keys, so that both backends' state reads
        the same."""
        return state_io.state_tensors(self)

    def master_weights(self) -> dict[str, torch.Tensor]:
        """The fp32 master weights by parameter name (empty in fp32 training), as torchax tensors
        over the JAX arrays (laid out by the plan's master spec), as the engine's outputs are."""
        return {n: self.output_tensor(a, self.env) for n, a in self.state.masters.items()}

    def grad_buffers(self) -> dict[str, torch.Tensor]:
        """The gradients accumulated since the last optimizer step by parameter name, as torchax
        tensors (``accumulated_gradients`` as JAX arrays); empty between steps."""
        self.gradients.settle()
        return {n: self.output_tensor(a, self.env) for n, a in (self.state.accum or {}).items()}

    def accumulated_gradients(self) -> dict[str, Any]:
        """The gradients committed since the last optimizer step, by parameter name, as JAX
        arrays laid out by the plan's gradient spec; empty between steps."""
        self.gradients.settle()
        return dict(self.state.accum or {})

    def params(self) -> dict[str, Any]:
        """The trainable parameters by name, as JAX arrays (replicated)."""
        return self.state.params

    def wait(self) -> None:
        """Block until the dispatched programs have run and the arrays they consumed are released
        (``release.drain``: what the devices hold is then what the engine keeps)."""
        import jax

        jax.block_until_ready((self.state.params, self.state.opt_state, self.state.accum))
        drain()
