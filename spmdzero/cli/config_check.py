"""``spmdzero config check``: what a DeepSpeed config means to spmdzero before anything runs
(resolved batch sizes, mesh, stage, optimizer and schedule, no-op keys) and the per-device
bytes of model states, with no device touched."""

from __future__ import annotations
from typing import Optional

from spmdzero.config.schema import DeepSpeedConfig
from spmdzero.config.load import load_config, noop_reason, read_config_file, without_integration_autos
from spmdzero.sharding.batch import resolve_batch
from spmdzero.sharding.mesh import data_parallel_size, fsdp_size, resolve_mesh_shape


# Optimizer state bytes per fp32 parameter, by config name (None: unknown torch.optim class).
STATE_BYTES = {"adam": 8, "adamw": 8, "lamb": 8, "lion": 4, "adagrad": 4}


def optimizer_state_bytes(cfg: DeepSpeedConfig) -> Optional[int]:
    if cfg.optimizer is None:
        return 0
    name = cfg.optimizer.type.lower()
    if name == "sgd":
        fp32 = 4 if cfg.optimizer.params.get("momentum", 0) else 0
    else:
        fp32 = STATE_BYTES.get(name)
    if fp32 is not None and cfg.bf16.enabled and cfg.bf16.bf16_optimizer_states:
        return fp32 // 2  # the states in bf16
    return fp32


def model_state_estimate(params: int, stage: int, fsdp: int, state_bytes: int, param_bytes: int = 4,
                         grad_bytes: int = 4, master_bytes: int = 0) -> dict[str, float]:
    """ZeRO's accounting: bytes per device by category. Parameters are replicated below stage 3
    and sharded at it; gradients sharded from stage 2; fp32 master weights (bf16/fp16,
    ``master_bytes`` 4) and optimizer states from stage 1."""
    grads = grad_bytes * params / (fsdp if stage >= 2 else 1)
    weights = param_bytes * params / (fsdp if stage >= 3 else 1)
    states = state_bytes * params / (fsdp if stage >= 1 else 1)
    masters = master_bytes * params / (fsdp if stage >= 1 else 1)
    out = {"params": weights, "grads": grads}
    if master_bytes:
        out["master weights"] = masters
    out["optimizer states"] = states
    out["total"] = weights + grads + masters + states
    return out


def _validate_optimizer_and_scheduler(cfg: DeepSpeedConfig) -> None:
    """Build them on a stand-in parameter: their params are checked by their constructors."""
    import torch

    from spmdzero.optim.optimizers import build_optimizer
    from spmdzero.optim.schedules import build_scheduler

    if cfg.optimizer is None:
        return
    optimizer = build_optimizer(cfg.optimizer, [torch.nn.Parameter(torch.zeros(1))])
    if cfg.scheduler is not None:
        build_scheduler(cfg.scheduler, optimizer)


def config_check(path: str, devices: int, params: Optional[int]) -> str:
    raw = read_config_file(path)
    notes = []
    if isinstance(raw, dict):
        raw, auto, scheduler_dropped = without_integration_autos(raw)
        if auto:
            notes.append(f"optimizer.params {', '.join(auto)} are \"auto\": the Hugging Face Trainer or accelerate "
                         "fills them in from its arguments (checked here with the optimizer's defaults)")
        if scheduler_dropped:
            notes.append("scheduler.params hold \"auto\": the Hugging Face Trainer or accelerate fills them in "
                         "(the scheduler is not checked here)")
        batch_keys = ("train_batch_size", "train_micro_batch_size_per_gpu")
        if all(raw.get(k) in (None, "auto") for k in batch_keys) and "auto" in (raw.get(k) for k in batch_keys):
            raw = {**raw, "train_micro_batch_size_per_gpu": 1}
            notes.append("the batch sizes are \"auto\": the Hugging Face Trainer or accelerate fills them in "
                         "(shown here for a micro batch of 1 per rank)")
    cfg = load_config(config=raw)
    shape = resolve_mesh_shape(cfg.spmd.mesh, devices)
    batch = resolve_batch(cfg, data_parallel_size(shape))  # one process: the CLI checks a single host
    _validate_optimizer_and_scheduler(cfg)
    lines = [f"config {path}: OK", ""]
    mesh = " x ".join(f"{axis}={size}" for axis, size in shape.items())
    lines += [
        f"  mesh                      {mesh} ({devices} devices, data-parallel size {batch.dp_devices})",
        f"  backend (spmd.backend)    {_backend(cfg)}",
        f"  ZeRO stage                {cfg.zero_stage}",
        f"  batch rule (spmd.rank)    {batch.rule} (DeepSpeed world size {batch.ranks})"
        + ("" if "rank" in cfg.spmd.model_fields_set else
           "; spmdzero.initialize's default: under spmdzero launch (deepspeed.initialize) it is 'process', "
           "one rank per host"),
        f"  train_batch_size          {batch.global_batch}",
        f"  micro batch per device    {batch.rows_per_device or 'replicated (does not divide)'}",
        f"  gradient accumulation     {batch.accumulation_steps}",
        f"  gradient clipping         {cfg.gradient_clipping or 'off'}",
        f"  optimizer                 {_describe(cfg.optimizer)}",
        f"  scheduler                 {_describe(cfg.scheduler)}",
    ]
    lines += [f"  note: {note}" for note in notes]
    noop = cfg.noop_keys
    lines += ["", "no-op keys under GSPMD:" if noop else "no-op keys under GSPMD: none"]
    lines += [f"  {key}: {noop_reason(key)}" for key in noop]
    if params is not None:
        from spmdzero.optim.precision import precision_policy

        policy = precision_policy(cfg)
        state_bytes = optimizer_state_bytes(cfg)
        dtype = str(policy.param_dtype).removeprefix("torch.")
        lines += ["", f"per-device bytes of model states for {params:,} {dtype} params (ZeRO accounting):"]
        if state_bytes is None:
            lines.append(f"  unknown state size for optimizer {cfg.optimizer.type!r}; assuming 8 bytes/param")
            state_bytes = 8
        estimate = model_state_estimate(params, cfg.zero_stage, fsdp_size(shape), state_bytes,
                                        param_bytes=policy.param_dtype.itemsize,
                                        grad_bytes=policy.grad_accum_dtype.itemsize,
                                        master_bytes=4 if policy.master_weights else 0)
        for name, value in estimate.items():
            lines.append(f"  {name:<17}{value:>18,.0f} B  ({value / params:5.2f} bytes/param)")
    return "\n".join(lines)


def _backend(cfg: DeepSpeedConfig) -> str:
    """The backend ``initialize`` would build, and why when the config names none."""
    from spmdzero.initialize import with_backend
    from spmdzero.runtime import jax_runtime

    backend = with_backend(cfg, jax_devices=jax_runtime.from_environment()).spmd.backend
    if "backend" in cfg.spmd.model_fields_set:
        return backend
    return f"{backend} (the config names none: the default, or SPMDZERO_BACKEND's)"


def _describe(section) -> str:
    if section is None:
        return "none"
    params = ", ".join(f"{k}={v}" for k, v in section.params.items())
    return f"{section.type}({params})"
