"""The DeepSpeed JSON config, parsed once into typed models.

Loading accepts a dict, a path to a JSON/HJSON file, or ``args.deepspeed_config``.
Sections spmdzero reads are pydantic models that refuse unknown keys; unknown
*top-level* keys are ignored, as DeepSpeed does. Batch sizes are resolved with
DeepSpeed's arithmetic, the world size given by the batch rule (``resolve_batch``).
Every other key DeepSpeed 0.19 reads at stage 0-2 is classified, as data: keys with no
meaning under GSPMD are accepted, listed in ``NOOP_KEYS`` with the reason, and warned
about once when switched on; keys whose feature would change the math are refused when
switched on (``REFUSED_KEYS``)."""

from __future__ import annotations
import typing
from typing import Annotated, Any, Literal, Mapping, Optional, Union
from pydantic import (BaseModel, ConfigDict, Field, NonNegativeInt, PrivateAttr, field_validator,
                      model_validator)


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



FLOAT32_MAX = 3.4028234663852886e38  # the largest finite float32
FLOAT32_MAX_POWER = 127  # the largest power of 2 below it


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

    @field_validator("initial_scale_power")
    @classmethod
    def _scale_power_in_float32(cls, power: int) -> int:
        if power > FLOAT32_MAX_POWER:
            raise ValueError(f"must be at most {FLOAT32_MAX_POWER}: the loss scale 2**initial_scale_power is kept in "
                             "float32 on the device, where 2**128 is infinite (the scale could never come down)")
        return power

    @field_validator("loss_scale", "min_loss_scale")
    @classmethod
    def _scale_in_float32(cls, scale: float) -> float:
        if scale > FLOAT32_MAX:
            raise ValueError(f"must be at most {FLOAT32_MAX:.4g}: the loss scale is kept in float32 on the device, "
                             "where a larger value is infinite")
        return scale


class Bf16Config(Section):
    enabled: bool = False
    check_grad_overflow: bool = True
    # DeepSpeed 0.19's low-precision ZeRO: the optimizer updates the bf16 parameters themselves (no
    # fp32 master copy) and the gradients stay bf16; with bf16_optimizer_states its states are bf16 too
    bf16_master_weights_and_grads: bool = False
    bf16_optimizer_states: bool = False


DTYPE_NAMES = ("fp32", "float32", "float", "fp16", "float16", "half", "bf16", "bfloat16", "bfloat")


def _check_dtype_name(value: Optional[str]) -> Optional[str]:
    """A dtype name as DeepSpeed reads them: any case, ``torch.`` in front or not."""
    if value is None:
        return None
    name = value.lower().removeprefix("torch.") if isinstance(value, str) else value
    if name not in DTYPE_NAMES:
        raise ValueError(f"must be one of {', '.join(DTYPE_NAMES)} (any case, 'torch.' in front or not)")
    return name


class TorchAutocastConfig(Section):
    """DeepSpeed's ``torch_autocast``: the forward runs under ``torch.autocast`` with ``dtype``,
    the parameters, gradients and optimizer states stay fp32. ``lower_precision_safe_modules``
    names the modules whose gradients DeepSpeed reduces in ``dtype``: here the compiler reduces
    every gradient in fp32, so the list changes no value."""

    enabled: bool = False
    dtype: str = "bfloat16"
    lower_precision_safe_modules: Optional[list[str]] = None

    _dtype = field_validator("dtype")(classmethod(lambda cls, v: _check_dtype_name(v)))


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
    # Which dim of the forward's inputs is the batch (spmdzero.train.batch_inputs): one for every input
    # (1: a sequence-first model), or per forward argument ({"src": 1, "prototypes": null}; null: not a batch).
    batch_dim: Union[NonNegativeInt, dict[str, Optional[NonNegativeInt]]] = 0
    # Shape buckets (spmdzero.train.shape_buckets): dict inputs with an attention_mask padded along
    # their sequence dim (data.PAD_VALUES) to powers of two from 128 up to the model's positions; on
    # by default on the torchax backend (None), off on torch_xla; false: as fed.
    shape_buckets: Optional[bool] = None
    # ... to a multiple of this instead (on either backend).
    pad_to_multiple_of: Optional[int] = Field(None, gt=0)
    mesh: Optional[MeshConfig] = None
    dcn_mesh: Optional[DcnMeshConfig] = None
    max_recompiles: Optional[int] = Field(None, ge=0)
    compile_cache_dir: Optional[str] = None
    trust_client_state: bool = False  # unpickle a checkpoint's client_state even if it is not plain data
    # load_checkpoint also sets torch's, Python's and NumPy's global RNGs to the saved states. DeepSpeed
    # leaves them as the script set them (a script that seeds, then loads, draws from its own seed), so off.
    restore_host_rng: bool = False
    # Trace and compile the model's identical blocks once (spmdzero.backends.torch_xla.scan); "stacked": each block
    # parameter name is one parameter [layers, ...] (the step's cost then does not grow with depth).
    scan_layers: Union[bool, Literal["stacked"]] = False
    # What the backward keeps of each scanned layer (torchax; spmdzero.backends.torchax.engine.scan): "none" (everything
    # JAX saves), "full" (only the layer's input: the layer is recomputed), "save_matmuls" (the matmul results).
    remat: Literal["none", "full", "save_matmuls"] = "none"
    # Which kernel F.scaled_dot_product_attention runs (torchax; spmdzero.backends.torchax.lowering.attention): "auto"
    # (Pallas's flash kernel on TPU, the exact XLA path elsewhere), "flash" (the kernel everywhere: off TPU in
    # Pallas's interpreter, to check it) or "exact" (the XLA path, which holds the [L, S] scores).
    attention: Literal["auto", "flash", "exact"] = "auto"
    # "torchax" (the default): the module traced once under jax.jit through torchax
    # (spmdzero.backends.torchax.engine.engine); "torch_xla": re-traced by torch_xla every step. Unset, it is
    # the backend whose runtime holds the process's devices (SPMDZERO_BACKEND; spmdzero.initialize).
    backend: Literal["torch_xla", "torchax"] = "torchax"
    # Where a transformers LM's generate() runs on the torchax backend (spmdzero.backends.torchax.engine.generation):
    # "devices" (compiled, from the engine's weights) or "host" (the host module's own: PyTorch's draws exactly).
    generate: Literal["devices", "host"] = "devices"
    # At ZeRO-3, whether the host module keeps whole parameters (torchax;
    # spmdzero.backends.torchax.engine.host_placeholders): "auto" (placeholders from 1 GiB of them), "placeholders"
    # (DeepSpeed's: empty, with ds_shape/ds_numel/ds_status; GatheredParameters brings them whole) or "whole".
    host_parameters: Literal["auto", "placeholders", "whole"] = "auto"

    @field_validator("scan_layers", mode="before")
    @classmethod
    def _scan_layers(cls, v: Any) -> Any:
        if v is True or v is False or v == "stacked":
            return v
        raise ValueError('must be true, false or "stacked"')

    @model_validator(mode="after")
    def _remat_needs_a_scanned_stack(self):
        if self.remat != "none" and not self.scan_layers:
            raise ValueError(f'remat={self.remat!r} applies to a scanned layer stack: set "scan_layers": true (or '
                             '"stacked") too, or checkpoint blocks in the model (torch.utils.checkpoint, '
                             'gradient_checkpointing_enable())')
        return self


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
    torch_autocast: TorchAutocastConfig = Field(default_factory=TorchAutocastConfig)
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
