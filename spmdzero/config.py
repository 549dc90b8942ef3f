"""The DeepSpeed JSON config, parsed once into typed models.

Loading accepts a dict, a path to a JSON/HJSON file, or ``args.deepspeed_config``.
Sections spmdzero reads are pydantic models that refuse unknown keys; unknown
*top-level* keys are ignored, as DeepSpeed does. Batch sizes are resolved with
DeepSpeed's arithmetic, the world size given by the batch rule (``resolve_batch``).
Every other key DeepSpeed 0.19 reads at stage 0-2 is classified, as data: keys with no
meaning under GSPMD are accepted, listed in ``NOOP_KEYS`` with the reason, and warned
about once when switched on; keys whose feature would change the math are refused when
switched on (``REFUSED_KEYS``).
"""

from __future__ import annotations

import difflib
import json
import os
import warnings
import typing
from dataclasses import dataclass
from typing import Annotated, Any, Literal, Mapping, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator


class ConfigError(ValueError):
    """A config value that spmdzero cannot accept. The message names the key."""


OFFLOAD_REASON = ("CPU/NVMe offload is not implemented: optimizer states and parameters stay in device memory "
                  "(ZeRO sharding still divides them over the devices)")
ZERO3_REASON = "ZeRO-3 only; DeepSpeed ignores it at stage 0-2 too (never warned)"
# ZeRO-3 tuning knobs, by DeepSpeed's JSON names (stage3_* aliases and field names).
ZERO3_KEYS = (
    "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold", "stage3_model_persistence_threshold",
    "stage3_max_live_parameters", "stage3_max_reuse_distance", "stage3_gather_16bit_weights_on_model_save",
    "stage3_gather_fp16_weights_on_model_save", "stage3_module_granularity_threshold",
    "stage3_use_all_reduce_for_fetch_params", "stage3_allgather_sequential", "prefetch_bucket_size",
    "param_persistence_threshold", "model_persistence_threshold", "max_live_parameters", "max_reuse_distance",
    "gather_16bit_weights_on_model_save", "module_granularity_threshold", "use_all_reduce_for_fetch_params",
    "allgather_sequential", "sub_group_size", "zero_hpz_partition_size", "zero_quantized_weights",
    "zero_quantized_nontrainable_weights", "zero_quantized_gradients", "zeropp_loco_param", "mics_shard_size",
    "mics_hierarchical_params_gather", "memory_efficient_linear", "pipeline_loading_checkpoint",
    "override_module_apply", "save_muon_momentum_buffer_in_memory", "leaf_module",
)
# Values that mean "off" beyond false/null/"none"/{"enabled": false}: DeepSpeed's defaults.
OFF_VALUES: dict[str, tuple] = {
    "gradient_predivide_factor": (1, 1.0),
    "gradient_allreduce_op": ("mean", "MEAN", "Mean"),
    "checkpoint.tag_validation": ("Warn", "WARN", "warn", "Ignore", "IGNORE", "ignore"),
    "tensor_parallel": ({"autotp_size": 0}, {"autotp_size": 1}),
    "seq_parallel_communication_data_type": ("fp32",),  # DeepSpeed's default, stated
}

# No-op keys whose values DeepSpeed still checks (and refuses when invalid): checked here too.
NOOP_VALID_VALUES: dict[str, tuple[str, ...]] = {
    "checkpoint.tag_validation": ("ignore", "warn", "fail"),
    "seq_parallel_communication_data_type": ("fp32", "fp16", "bf16"),
}

# DeepSpeed 0.19 keys (dotted paths) that have no effect under GSPMD at stage 0-2: accepted,
# dropped before validation, and warned about once when enabled (see ``_enabled``).
NOOP_KEYS: dict[str, str] = {
    "zero_optimization.overlap_comm": "XLA schedules and overlaps collectives itself",
    "zero_optimization.contiguous_gradients": "XLA owns buffer layout; there are no gradient buckets to pack",
    "zero_optimization.reduce_scatter": "the compiler always emits a reduce-scatter for sharded gradients",
    "zero_optimization.reduce_bucket_size": "XLA's collective combiner sizes fused collectives",
    "zero_optimization.allgather_bucket_size": "XLA's collective combiner sizes fused collectives",
    "zero_optimization.allgather_partitions": "the compiler always all-gathers updated parameters",
    "zero_optimization.round_robin_gradients": "no per-rank gradient ownership to balance under SPMD",
    "zero_optimization.use_multi_rank_bucket_allreduce": "no buckets under SPMD",
    "zero_optimization.legacy_stage1": "there is one ZeRO-1 implementation",
    "zero_optimization.load_from_fp32_weights": "checkpoints always hold fp32 state",
    "zero_optimization.elastic_checkpoint": "checkpoints are resharded by torch.distributed.checkpoint",
    "zero_optimization.ignore_unused_parameters": "unused parameters get zero gradients in the graph",
    "zero_optimization.log_trace_cache_warnings": "there is no ZeRO-3 trace cache",
    "zero_optimization.enable_sanity_checks": "there are no hand-made partitions to check",
    # CPU/NVMe offload: one warning for all of them (same reason text).
    "zero_optimization.offload_optimizer": OFFLOAD_REASON,
    "zero_optimization.offload_param": OFFLOAD_REASON,
    "zero_optimization.cpu_offload": OFFLOAD_REASON,
    "zero_optimization.cpu_offload_param": OFFLOAD_REASON,
    "zero_optimization.cpu_offload_use_pin_memory": OFFLOAD_REASON,
    "aio": OFFLOAD_REASON,
    **{f"zero_optimization.{key}": ZERO3_REASON for key in ZERO3_KEYS},
    # Gradient averaging: DeepSpeed divides each rank's gradient by the world size before
    # (prescale) or partly before (predivide factor f: x/f, all-reduce, x*f/N) its all-reduce
    # sum; every variant yields the mean over ranks and differs only in fp16 rounding. Under
    # SPMD the loss is over the whole batch, so the gradient is that mean with no rank sum.
    "prescale_gradients": "the gradient is the mean over the global batch inside one graph; there is no "
                          "per-rank sum to pre-scale (the result equals DeepSpeed's up to rounding)",
    "gradient_predivide_factor": "the gradient is the mean over the global batch inside one graph; there is no "
                                 "per-rank sum to pre-divide (the result equals DeepSpeed's up to rounding)",
    "sparse_gradients": "gradients are dense under XLA (same values as the sparse ones)",
    "disable_allgather": "the compiler emits the all-gathers",
    "seq_parallel_communication_data_type": "there is no sequence parallelism",
    "use_data_before_expert_parallelism": "there is no expert parallelism",
    "bf16.immediate_grad_update": "gradients are folded into the ZeRO buffers inside the traced step",
    "optimizer.legacy_fusion": "the optimizer update is one traced XLA graph",
    "zero_allow_untested_optimizer": "any torch.optim optimizer is accepted",
    "zero_force_ds_cpu_optimizer": "there is no CPU optimizer (no offload)",
    "graph_harvesting": "CUDA graphs do not apply; XLA compiles the step once",
    "dump_state": "use engine.sharding_report()",
    "memory_breakdown": "use engine.sharding_report() and torch_xla's memory info",
    "flops_profiler": "the step log prints an estimated model TFLOP/s",
    "comms_logger": "use engine.collectives_report()",
    "autotuning": "not available",
    "timers": "steps_per_print logs samples/sec",
    "eigenvalue": "only consumed by DeepSpeed's quantizer and progressive layer drop, not available",
    "activation_checkpointing": "configures DeepSpeed's deepspeed.checkpointing, which spmdzero does not provide; "
                                "the engine does not checkpoint activations itself (use torch.utils.checkpoint in "
                                "the model, or a transformers model's gradient_checkpointing_enable())",
    "pipeline": "applies to PipelineModule only (pipeline parallelism is out of scope)",
    "compile": "spmdzero always compiles the step with XLA",
    "log_level": "spmdzero logs through the 'spmdzero' logger",
    "checkpoint.tag_validation": "one process per host saves a single tag",
    "checkpoint.load_universal": "spmdzero checkpoints load on any mesh; convert DeepSpeed checkpoints "
                                 "with `spmdzero checkpoint import-deepspeed`",
    "checkpoint.use_node_local_storage": "every host writes its own shards",
    "checkpoint.parallel_write": "torch.distributed.checkpoint writes shards in parallel",
    "nebula": "checkpoints are written by torch.distributed.checkpoint",
    "datastates_ckpt": "checkpoints are written by torch.distributed.checkpoint",
}

# Keys whose feature would change the training math, or is out of scope: refused when enabled.
REFUSED_KEYS: dict[str, str] = {
    "zero_optimization.zenflow": "ZenFlow updates part of the gradients asynchronously on the CPU; not available",
    "amp": "NVIDIA apex AMP does not exist on XLA; use the bf16 (or fp16) section",
    "torch_autocast": "autocast regions are not traced by spmdzero; use the bf16 (or fp16) section",
    "gradient_allreduce_op": "'sum' would add the ranks' gradients instead of averaging them; spmdzero "
                             "computes the mean over the global batch",
    "fp16.fp16_master_weights_and_grads": "spmdzero keeps fp32 master weights and gradients",
    "bf16.bf16_master_weights_and_grads": "spmdzero keeps fp32 master weights and gradients",
    "bf16.bf16_optimizer_states": "spmdzero keeps fp32 optimizer states",
    "data_types.buffer_dtype": "module buffers keep their dtype",
    "progressive_layer_drop": "progressive layer drop is not available",
    "curriculum_learning": "curriculum learning (legacy) is not available",
    "data_efficiency": "DeepSpeed's data efficiency library is not available",
    "compression_training": "DeepSpeed compression is not available",
    "quantize_training": "quantized training (MoQ) is not available",
    "weight_quantization": "weight quantization is not available",
    "sparse_attention": "sparse attention is out of scope",
    "elasticity": "elastic batch sizing is not available; checkpoints resume on any mesh",
    "hybrid_engine": "the hybrid engine (RLHF generation) is out of scope",
    "tensor_parallel": "tensor parallelism is out of scope",
    "expert_parallel": "mixture-of-experts parallelism is out of scope",
}

# Strict types: a JSON boolean is not a number nor a number a boolean, a string is neither
# ("stage": true, "train_batch_size": "16" and "enabled": "false" are refused, not coerced),
# and Infinity/NaN are not numbers. Integers are accepted for floats.
STRICT = ConfigDict(strict=True, allow_inf_nan=False)


def whole_floats_as_ints(model: type[BaseModel], data: Any) -> Any:
    """``"steps_per_print": 1e5`` (a common idiom) or ``"min_loss_scale": 1.0`` for an integer
    key: DeepSpeed reads them as the numbers they are. Other floats stay refused, and so do
    whole ones beyond 2**53, where a float no longer holds every integer (``1e30``)."""
    if not isinstance(data, Mapping):
        return data
    ints = {name for name, field in model.model_fields.items()
            if field.annotation is int or int in typing.get_args(field.annotation)}
    return {k: int(v) if k in ints and isinstance(v, float) and v.is_integer() and abs(v) <= 2**53 else v
            for k, v in data.items()}


class Section(BaseModel):
    """A config section: unknown keys refused; ``"auto"`` dropped so the default applies
    (DeepSpeed's rule for its pydantic sections); types strict (``STRICT``)."""

    model_config = ConfigDict(extra="forbid", frozen=True, **STRICT)

    @model_validator(mode="before")
    @classmethod
    def _drop_auto(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            return {k: v for k, v in data.items() if v != "auto"}
        return data

    _whole_floats = model_validator(mode="before")(classmethod(lambda cls, data: whole_floats_as_ints(cls, data)))


class ZeroConfig(Section):
    """``stage``; the other ZeRO keys DeepSpeed reads are in ``NOOP_KEYS`` / ``REFUSED_KEYS``."""

    stage: int = Field(0, ge=0, le=3)

    @field_validator("stage")
    @classmethod
    def _no_stage3(cls, stage: int) -> int:
        if stage == 3:
            raise ValueError(
                "ZeRO stage 3 (sharded parameters) is out of scope for spmdzero; use torch_xla's "
                "FSDPv2 (torch_xla.experimental.spmd_fully_sharded_data_parallel) for it"
            )
        return stage


class Fp16Config(Section):
    enabled: bool = False
    auto_cast: bool = False
    loss_scale: float = Field(0, ge=0)
    initial_scale_power: int = Field(16, ge=0)
    loss_scale_window: int = Field(1000, gt=0)
    hysteresis: int = Field(2, gt=0)
    consecutive_hysteresis: bool = False
    min_loss_scale: int = Field(1, gt=0)
    fp16_master_weights_and_grads: bool = False


class Bf16Config(Section):
    enabled: bool = False
    check_grad_overflow: bool = True


DTYPE_NAMES = ("fp32", "float32", "float", "fp16", "float16", "half", "bf16", "bfloat16", "bfloat")


def _check_dtype_name(value: Optional[str]) -> Optional[str]:
    """A dtype name as DeepSpeed reads them: any case, ``torch.`` in front or not."""
    if value is None:
        return None
    name = value.lower().removeprefix("torch.") if isinstance(value, str) else value
    if name not in DTYPE_NAMES:
        raise ValueError(f"must be one of {', '.join(DTYPE_NAMES)} (any case, 'torch.' in front or not)")
    return name


class DataTypesConfig(Section):
    grad_accum_dtype: Optional[str] = None
    param_dtype: Optional[str] = None  # must agree with fp16/bf16 (checked in parse_config), as in DeepSpeed

    _dtype = field_validator("grad_accum_dtype", "param_dtype")(classmethod(lambda cls, v: _check_dtype_name(v)))


class TensorBoardConfig(Section):
    enabled: bool = False
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"


class CsvMonitorConfig(Section):
    enabled: bool = False
    output_path: str = ""
    job_name: str = "DeepSpeedJobName"


class WandbConfig(Section):
    enabled: bool = False
    group: Optional[str] = None
    team: Optional[str] = None
    project: str = "deepspeed"


class CometConfig(Section):
    enabled: bool = False
    samples_log_interval: int = Field(100, gt=0)
    project: Optional[str] = None
    workspace: Optional[str] = None
    api_key: Optional[str] = None
    experiment_name: Optional[str] = None
    experiment_key: Optional[str] = None
    online: Optional[bool] = None
    mode: Optional[str] = None


class _TypedParams(Section):
    type: str
    params: dict[str, Any] = Field(default_factory=dict)

    @field_validator("params")
    @classmethod
    def _no_auto(cls, params: dict) -> dict:
        for key, value in params.items():
            if value == "auto":
                raise ValueError(f"{key!r} is 'auto', which only an integration such as the HF Trainer can "
                                 "fill in; set a value")
        return params


class OptimizerConfig(_TypedParams):
    pass


class SchedulerConfig(_TypedParams):
    pass


class MeshConfig(Section):
    data: int = 1
    fsdp: int = -1
    # fsdp = outer x fsdp_inner mesh axes (spmdzero.mesh): "auto" splits from 16 fsdp devices
    # on, where libtpu reduce-scatters only one axis at a time; 1 keeps a single axis.
    fsdp_inner: Union[Literal["auto"], Annotated[int, Field(ge=1)]] = "auto"

    @field_validator("data", "fsdp")
    @classmethod
    def _positive_or_fill(cls, v: int) -> int:
        if v != -1 and v < 1:
            raise ValueError("must be a positive device count or -1 (fill the remaining devices)")
        return v


class DcnMeshConfig(Section):
    """Across TPU slices (data-center network). ZeRO's ``fsdp`` axis stays within a slice."""

    data: int = Field(1, ge=1)
    fsdp: int = Field(1, ge=1, le=1)


class SpmdConfig(Section):
    # What one DeepSpeed "rank" is in the batch arithmetic (docs/migrating.md, "The batch rule"):
    # a data-parallel device, or a process (one per host, what torch.distributed counts).
    rank: Literal["device", "process"] = "device"
    # Shape buckets: pad the sequence dim of dict inputs to a multiple of this (data.PAD_VALUES).
    pad_to_multiple_of: Optional[int] = Field(None, gt=0)
    mesh: Optional[MeshConfig] = None
    dcn_mesh: Optional[DcnMeshConfig] = None
    max_recompiles: Optional[int] = Field(None, ge=0)
    compile_cache_dir: Optional[str] = None
    trust_client_state: bool = False  # unpickle a checkpoint's client_state even if it is not plain data
    # Trace and compile the model's identical blocks once (spmdzero.scan); "stacked": each block
    # parameter name is one parameter [layers, ...] (the step's cost then does not grow with depth).
    scan_layers: Union[bool, Literal["stacked"]] = False
    # "torchax": the module traced once under jax.jit through torchax (spmdzero.backend_torchax)
    backend: Literal["torch_xla", "torchax"] = "torch_xla"

    @field_validator("scan_layers", mode="before")
    @classmethod
    def _scan_layers(cls, v: Any) -> Any:
        if v is True or v is False or v == "stacked":
            return v
        raise ValueError('must be true, false or "stacked"')


class DeepSpeedConfig(BaseModel):
    """The parts of a DeepSpeed config spmdzero reads. Unknown top-level keys are ignored;
    types are strict (``STRICT``)."""

    model_config = ConfigDict(extra="ignore", frozen=True, **STRICT)

    @model_validator(mode="before")
    @classmethod
    def _resolve_auto(cls, data: Any) -> Any:
        """Top-level "auto" means "infer it": batch numbers from the others and the mesh
        (``resolve_batch``), everything else from its default."""
        if isinstance(data, Mapping):
            return {k: v for k, v in data.items() if v != "auto"}
        return data

    _whole_floats = model_validator(mode="before")(classmethod(lambda cls, data: whole_floats_as_ints(cls, data)))

    train_batch_size: Optional[int] = Field(None, gt=0)
    train_micro_batch_size_per_gpu: Optional[int] = Field(None, gt=0)
    gradient_accumulation_steps: Optional[int] = Field(None, gt=0)
    gradient_clipping: float = Field(1.0, ge=0.0)
    steps_per_print: Optional[int] = Field(None, gt=0)
    wall_clock_breakdown: bool = False
    dataloader_drop_last: bool = False
    zero_optimization: ZeroConfig = Field(default_factory=ZeroConfig)
    optimizer: Optional[OptimizerConfig] = None
    scheduler: Optional[SchedulerConfig] = None
    communication_data_type: Optional[str] = None
    data_types: DataTypesConfig = Field(default_factory=DataTypesConfig)
    fp16: Fp16Config = Field(default_factory=Fp16Config)
    bf16: Bf16Config = Field(default_factory=Bf16Config)
    tensorboard: TensorBoardConfig = Field(default_factory=TensorBoardConfig)
    csv_monitor: CsvMonitorConfig = Field(default_factory=CsvMonitorConfig)
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    comet: CometConfig = Field(default_factory=CometConfig)
    spmd: SpmdConfig = Field(default_factory=SpmdConfig)

    _dtype = field_validator("communication_data_type")(classmethod(lambda cls, v: _check_dtype_name(v)))

    @field_validator("steps_per_print", mode="before")
    @classmethod
    def _infinite_means_never(cls, v: Any) -> Any:
        """accelerate sets ``float("inf")`` to silence DeepSpeed's step log."""
        return None if isinstance(v, float) and v == float("inf") else v

    _noop_keys: tuple[str, ...] = PrivateAttr(default=())

    @property
    def zero_stage(self) -> int:
        return self.zero_optimization.stage

    @property
    def noop_keys(self) -> tuple[str, ...]:
        """The ``NOOP_KEYS`` this config switches on (what the warning names)."""
        return self._noop_keys


_RANK = {"device": "data-parallel device", "process": "process (one per host)"}


@dataclass(frozen=True)
class BatchSizes:
    """The batch numbers, resolved by the batch rule (``spmd.rank``).

    DeepSpeed's arithmetic is ``train_batch_size = micro * accumulation * world size``
    where a "rank" feeds ``micro`` rows per micro-step. Here a rank is either a
    data-parallel device (rule "device") or a process, one per host (rule "process"); the
    rows a rank feeds are split over the data-parallel devices it stands for.
    """

    global_batch: int  # train_batch_size: rows per optimizer step, all hosts
    rows_per_rank: int  # train_micro_batch_size_per_gpu: rows one rank feeds per micro-step
    accumulation_steps: int  # gradient_accumulation_steps
    ranks: int  # DeepSpeed's world size by the rule: data-parallel devices, or processes
    dp_devices: int  # devices the batch is split over (the mesh's data-parallel axes)
    processes: int = 1
    rule: str = "device"

    @property
    def rows_per_micro_step(self) -> int:
        """Rows of one micro-step across all hosts."""
        return self.rows_per_rank * self.ranks

    @property
    def rows_per_process(self) -> int:
        """Rows one process (host) feeds per micro-step."""
        return self.rows_per_micro_step // self.processes

    @property
    def rows_per_device(self) -> Optional[int]:
        """Rows each data-parallel device gets per micro-step; None when the micro-step does
        not divide over the devices (the batch is then replicated along its rows)."""
        if self.rows_per_micro_step % self.dp_devices:
            return None
        return self.rows_per_micro_step // self.dp_devices

    def describe(self) -> list[str]:
        """The resolved numbers, as ``initialize`` prints them."""
        rank = _RANK[self.rule]
        per_device = (f"{self.rows_per_device} per device" if self.rows_per_device is not None
                      else f"replicated on each of the {self.dp_devices} devices (does not divide)")
        return [
            f"batch rule (spmd.rank={self.rule!r}): a DeepSpeed rank is a {rank}; world size {self.ranks}",
            f"global batch {self.global_batch} = {self.rows_per_rank} per rank (train_micro_batch_size_per_gpu) "
            f"x {self.accumulation_steps} accumulation x {self.ranks} ranks",
            f"per micro-step: {self.rows_per_process} rows per process ({self.processes} "
            f"process{'es' if self.processes > 1 else ''}), {per_device} "
            f"({self.dp_devices} data-parallel devices)",
        ]

    def mismatch(self, global_rows: int) -> str:
        """What a training forward of ``global_rows`` rows (all hosts) contradicts, and why."""
        word = "more" if global_rows > self.rows_per_micro_step else "fewer"
        other = "process" if self.rule == "device" else "device"
        other_rows = self.rows_per_rank * (1 if other == "process" else self.dp_devices // self.processes)
        return (f"a training forward got {global_rows // self.processes} rows per process, {word} than the "
                f"{self.rows_per_process} per micro-step that train_micro_batch_size_per_gpu={self.rows_per_rank} "
                f"gives a process under spmd.rank={self.rule!r} (a rank is a {_RANK[self.rule]}); under "
                f"spmd.rank={other!r} it would be {other_rows}. See docs/migrating.md, \"The batch rule\".")

    def host_ranks(self, process_index: int) -> range:
        """The DeepSpeed ranks whose rows host ``process_index`` feeds, in row order."""
        if self.rule == "process":
            return range(process_index, process_index + 1)
        per_host = self.ranks // self.processes
        return range(process_index * per_host, (process_index + 1) * per_host)


def resolve_batch(cfg: DeepSpeedConfig, dp_devices: int, processes: int = 1) -> BatchSizes:
    """Infer the missing batch numbers exactly as DeepSpeed's config does, with DeepSpeed's
    world size given by ``spmd.rank``: ``dp_devices`` (rule "device") or ``processes``."""
    rule = cfg.spmd.rank
    if dp_devices % processes:
        raise ConfigError(f"{dp_devices} data-parallel devices do not divide over {processes} processes")
    tb, mb, gas = cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps
    ws = dp_devices if rule == "device" else processes
    if tb is not None and mb is not None and gas is not None:
        pass
    elif tb is not None and mb is not None:
        gas = tb // mb // ws
    elif tb is not None and gas is not None:
        mb = tb // ws // gas
    elif mb is not None and gas is not None:
        tb = mb * gas * ws
    elif tb is not None:
        gas, mb = 1, tb // ws
    elif mb is not None:
        gas, tb = 1, mb * ws
    else:
        raise ConfigError("Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided")
    unit = "data-parallel devices" if rule == "device" else "processes (spmd.rank: process)"
    for name, value in (("train_batch_size", tb), ("train_micro_batch_size_per_gpu", mb),
                        ("gradient_accumulation_steps", gas)):
        if value <= 0:
            raise ConfigError(f"{name} resolved to {value} with a world size of {ws} {unit}; it must be > 0")
    if tb != mb * gas * ws:
        raise ConfigError(
            "Check batch related parameters. train_batch_size is not equal to "
            f"micro_batch_per_gpu * gradient_acc_step * world_size {tb} != {mb} * {gas} * {ws} "
            f"(world size = {ws} {unit}, see spmd.rank)"
        )
    return BatchSizes(tb, mb, gas, ws, dp_devices, processes, rule)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_value(key: str, value: Any, default: Any, where: str) -> None:
    """The type the constructor's default has, strictly: ``"adam_w_mode": "false"`` would be
    true to Python and ``"weight_decay": "0.01"`` would fail deep inside. A number may be
    given per param group (a list, as DeepSpeed's schedules allow); a parameter without a
    default (``total_num_steps``) is a number. Numbers must be finite."""
    import inspect
    import math

    def numbers(v):
        return _is_number(v) or (isinstance(v, (tuple, list)) and bool(v) and all(_is_number(x) for x in v))

    if default is inspect.Parameter.empty or _is_number(default):
        expected, ok = "a number", numbers(value)
    elif isinstance(default, bool):
        expected, ok = "true or false", isinstance(value, bool)
    elif isinstance(default, (tuple, list)) and default and all(_is_number(d) for d in default):
        expected = f"{ {2: 'two', 3: 'three'}.get(len(default), len(default))} numbers"
        ok = isinstance(value, (tuple, list)) and len(value) == len(default) and numbers(value)
    elif isinstance(default, str):
        expected, ok = "a string", isinstance(value, str)
    else:
        expected, ok = "", True
    section = where.partition(" for ")[0]
    if not ok:
        raise ConfigError(f"{section}.{key} must be {expected}, got {value!r} ({where})")
    for number in (value if isinstance(value, (tuple, list)) else [value]):
        if isinstance(number, float) and not math.isfinite(number):
            raise ConfigError(f"{section}.{key} must be a finite number, got {value!r} ({where})")


def check_params(cls, params: Mapping[str, Any], where: str, skip: tuple[str, ...] = ()) -> None:
    """Refuse keys that ``cls``'s constructor does not take, suggesting the closest one,
    and values of another type than the parameter's default (``check_value``)."""
    import inspect

    try:
        signature = inspect.signature(cls.__init__)
    except (TypeError, ValueError):
        return
    accepted = [n for n, p in signature.parameters.items()
                if n != "self" and n not in skip and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if any(p.kind == p.VAR_KEYWORD for p in signature.parameters.values()):
        return
    for key in params:
        if key not in accepted:
            close = difflib.get_close_matches(key, accepted, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"accepted: {', '.join(accepted)}"
            raise ConfigError(f"{where}: unknown key {key!r} ({hint})")
        check_value(key, params[key], signature.parameters[key].default, where)


def _no_duplicate_keys(pairs: list[tuple[str, Any]], source: str) -> dict:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise ConfigError(f"{source}: duplicate key {key!r}")
        seen[key] = value
    return seen


def read_config_file(path: str | os.PathLike) -> dict:
    """Read a JSON (or HJSON, as DeepSpeed allows) file, refusing duplicate keys."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        decoded = _base64_config(path)
        if decoded is None:
            raise ConfigError(f"DeepSpeed config file not found: {path!r} (nor is it a base64-encoded config)")
        text, path = decoded, "config (base64)"
    else:
        with open(path) as f:
            text = f.read()
    if not text.strip():
        raise ConfigError(f"DeepSpeed config file {path!r} is empty")
    hook = lambda pairs: _no_duplicate_keys(pairs, path)  # noqa: E731
    try:
        return json.loads(text, object_pairs_hook=hook)
    except json.JSONDecodeError as json_err:
        try:
            import hjson
        except ImportError:
            raise ConfigError(f"{path}: not valid JSON ({json_err})") from None
        try:
            return dict(hjson.loads(text, object_pairs_hook=hook))
        except ConfigError:
            raise
        except Exception as err:
            raise ConfigError(f"{path}: neither valid JSON nor HJSON ({err})") from None


def _base64_config(value: str) -> Optional[str]:
    """DeepSpeed also takes the config as base64-encoded JSON (its launcher and autotuner pass
    it so): the decoded text, or None when ``value`` is not that."""
    import base64
    import binascii

    if not value or os.sep in value or value.endswith((".json", ".hjson")):
        return None
    try:
        text = base64.urlsafe_b64decode(value + "=" * (-len(value) % 4)).decode("utf-8")
    except (binascii.Error, ValueError, UnicodeDecodeError):
        return None
    return text if text.lstrip().startswith("{") else None


def _format_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"])
        if e["type"] == "extra_forbidden":
            section_path, bad = e["loc"][:-1], str(e["loc"][-1])
            model: Any = DeepSpeedConfig
            for part in section_path:
                model = model.model_fields[part].annotation
                model = next((a for a in getattr(model, "__args__", ()) if isinstance(a, type)), model)
            valid = list(getattr(model, "model_fields", {}))
            prefix = ".".join(str(p) for p in section_path) + "."
            valid += [k[len(prefix):] for k in {**NOOP_KEYS, **REFUSED_KEYS} if k.startswith(prefix)]
            close = difflib.get_close_matches(bad, valid, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else f" (valid keys: {', '.join(valid)})"
            lines.append(f"unknown key {key!r}{hint}")
        else:
            lines.append(f"{key}: {e['msg']} (got {e.get('input')!r})")
    return "; ".join(lines)


def parse_config(raw: Mapping[str, Any], source: str = "config") -> DeepSpeedConfig:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{source}: a DeepSpeed config must be a JSON object, got {type(raw).__name__}")
    raw = _deepspeed_aliases(dict(raw), source)
    _warn_misspelled_keys(raw, source)
    raw, noop = _classify(raw, source)
    try:
        cfg = DeepSpeedConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(f"{source}: {_format_errors(err)}") from None
    if cfg.fp16.enabled and cfg.bf16.enabled:
        raise ConfigError(f"{source}: fp16 and bf16 cannot both be enabled")
    mode = "fp16" if cfg.fp16.enabled else "bf16" if cfg.bf16.enabled else "fp32"
    param_dtype = cfg.data_types.param_dtype
    if param_dtype is not None and _DTYPE_MODE[param_dtype] != mode:
        raise ConfigError(f"{source}: data_types.param_dtype={param_dtype!r} conflicts with the precision mode "
                          f"({mode}); set the fp16/bf16 'enabled' flag or omit data_types.param_dtype")
    cfg._noop_keys = tuple(noop)
    _warn_noop_keys(cfg)
    return cfg


_DTYPE_MODE = {"fp32": "fp32", "float32": "fp32", "float": "fp32", "fp16": "fp16", "float16": "fp16",
               "half": "fp16", "bf16": "bf16", "bfloat16": "bf16", "bfloat": "bf16"}


def known_top_level_keys() -> set[str]:
    """Every top-level key spmdzero reads, accepts as a no-op or refuses."""
    return (set(DeepSpeedConfig.model_fields) | {k.split(".")[0] for k in (*NOOP_KEYS, *REFUSED_KEYS)}
            | {"bfloat16"})


def _warn_misspelled_keys(raw: Mapping[str, Any], source: str) -> None:
    """DeepSpeed ignores unknown top-level keys, and so does spmdzero (scripts keep their own
    settings there), but a near miss of a DeepSpeed key (``zero_optimisation``) would silently
    train at ZeRO-0 or in fp32: say so, once per key."""
    known = known_top_level_keys()
    for key in raw:
        if key in known or not isinstance(key, str):
            continue
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.8)
        if close:
            _warn_once(f"misspelled:{key}", f"{source}: unknown top-level key {key!r} is ignored, as DeepSpeed "
                                            f"ignores it; did you mean {close[0]!r}?")


def _deepspeed_aliases(raw: dict, source: str) -> dict:
    """DeepSpeed's old spellings: ``"bfloat16"`` for ``"bf16"``, ``"zero_optimization": true``
    for stage 1 (``false``: stage 0)."""
    if "bfloat16" in raw:
        old = raw.pop("bfloat16")
        if "bf16" in raw and raw["bf16"] != old:
            raise ConfigError(f"{source}: 'bf16' and its old name 'bfloat16' are both given, with different values")
        raw.setdefault("bf16", old)
    if isinstance(raw.get("zero_optimization"), bool):
        raw["zero_optimization"] = {"stage": int(raw["zero_optimization"])}
    return raw


def _enabled(key: str, value: Any) -> bool:
    """Whether a DeepSpeed feature is switched on: not null/false/"none"/its off value;
    a section by its ``enabled`` or ``device`` key, else by any enabled entry."""
    if value is None or value is False or value in OFF_VALUES.get(key, ()):
        return False
    if key == "compression_training" and isinstance(value, Mapping):  # each technique's switch
        return any(isinstance(t, Mapping) and _enabled(f"{key}.{name}", t.get("shared_parameters"))
                   for name, t in value.items())
    if isinstance(value, str):
        return value.lower() != "none"
    if isinstance(value, Mapping):
        if "enabled" in value:
            return _enabled(f"{key}.enabled", value["enabled"])
        if "device" in value:
            return _enabled(f"{key}.device", value["device"])
        return any(_enabled(f"{key}.{k}", v) for k, v in value.items())
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return True  # a number is a setting (bucket sizes, factors whose off value is in OFF_VALUES)
    return bool(value)


def _classify(raw: dict, source: str) -> tuple[dict, list[str]]:
    """Refuse the refused keys switched on; drop the classified keys (the typed sections do not
    know them) and return the no-op keys switched on."""
    raw = {k: dict(v) if isinstance(v, Mapping) else v for k, v in raw.items()}
    for key, reason in REFUSED_KEYS.items():
        section, _, name = key.rpartition(".")
        holder = raw.get(section) if section else raw
        if isinstance(holder, dict) and name in holder:
            value = holder.pop(name)
            if _enabled(key, value):
                raise ConfigError(f"{source}: {key}={value!r} is not supported: {reason}")
    noop = []
    for key in NOOP_KEYS:
        section, _, name = key.rpartition(".")
        holder = raw.get(section) if section else raw
        if isinstance(holder, dict) and name in holder:
            value = holder.pop(name)
            valid = NOOP_VALID_VALUES.get(key)
            if valid is not None and value != "auto" and not (isinstance(value, str) and value.lower() in valid):
                raise ConfigError(f"{source}: {key}={value!r} is not one of {', '.join(valid)} (any case), as "
                                  "DeepSpeed requires")
            # ZeRO-3 knobs are dormant: stage 3 itself is refused, so their feature is never on
            if NOOP_KEYS[key] != ZERO3_REASON and value != "auto" and _enabled(key, value):
                noop.append(key)
    return raw, noop


_warned: set[str] = set()


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(f"spmdzero: {message}", stacklevel=4)


def _warn_noop_keys(cfg: DeepSpeedConfig) -> None:
    """One warning per parse for the no-op keys not warned about before (one line per reason)."""
    by_reason: dict[str, list[str]] = {}
    for key in cfg.noop_keys:
        if key not in _warned:
            _warned.add(key)
            by_reason.setdefault(NOOP_KEYS[key], []).append(key)
    if by_reason:
        lines = [f"{', '.join(keys)}: {reason}" for reason, keys in by_reason.items()]
        warnings.warn("spmdzero: these DeepSpeed config keys have no effect under GSPMD (docs/config.md, "
                      "\"No-ops under GSPMD\"):\n  " + "\n  ".join(lines), stacklevel=3)
    for name in ("wandb", "comet"):
        if getattr(cfg, name).enabled:
            _warn_once(f"{name}.enabled", f"{name}.enabled is accepted but spmdzero does not write to it "
                                          "(csv_monitor and tensorboard are supported)")


def load_config(args: Any = None, config: Any = None, config_params: Any = None) -> DeepSpeedConfig:
    """Resolve the one config source, as ``deepspeed.initialize`` does."""
    if config is not None and config_params is not None:
        raise ConfigError("give the DeepSpeed config as `config` or `config_params`, not both")
    config = config if config is not None else config_params
    args_config = getattr(args, "deepspeed_config", None) if args is not None else None
    old_name = getattr(args, "deepscale_config", None) if args is not None else None
    if old_name is not None:  # DeepSpeed's deprecated flag
        if args_config is not None:
            raise ConfigError("give the config as --deepspeed_config or its deprecated name --deepscale_config, "
                              "not both")
        warnings.warn("spmdzero: --deepscale_config is deprecated, use --deepspeed_config", stacklevel=3)
        args_config = old_name
    if config is not None and args_config is not None:
        raise ConfigError(
            "Not sure how to proceed, we were given deepspeed configs in the deepspeed arguments "
            "and deepspeed.initialize() function call"
        )
    config = config if config is not None else args_config
    if config is None:
        raise ConfigError(
            "no DeepSpeed config: pass config= (a dict or a JSON path) or args with .deepspeed_config"
        )
    if isinstance(config, DeepSpeedConfig):
        return config
    if isinstance(config, (str, os.PathLike)):
        return parse_config(read_config_file(config), source=os.fspath(config))
    if isinstance(config, Mapping):
        return parse_config(config)
    raise ConfigError(f"config must be a dict or a path to a JSON file, got {type(config).__name__}")
