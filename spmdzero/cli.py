"""The ``spmdzero`` command: ``config check`` (what a DeepSpeed config means to spmdzero,
before anything runs), ``checkpoint consolidate`` (one plain state dict), which need no
device (the console entry point does not start the XLA runtime for them), and ``launch``
(run a DeepSpeed script, ``spmdzero.launch``), which starts it."""

from __future__ import annotations

import argparse
import sys
from typing import Optional

import numpy as np

from .config import NOOP_KEYS, ConfigError, DeepSpeedConfig, load_config, resolve_batch
from .mesh import data_parallel_size, fsdp_size, resolve_mesh_shape

# Optimizer state bytes per fp32 parameter, by config name (None: unknown torch.optim class).
STATE_BYTES = {"adam": 8, "adamw": 8, "lamb": 8, "lion": 4, "adagrad": 4}


def optimizer_state_bytes(cfg: DeepSpeedConfig) -> Optional[int]:
    if cfg.optimizer is None:
        return 0
    name = cfg.optimizer.type.lower()
    if name == "sgd":
        return 4 if cfg.optimizer.params.get("momentum", 0) else 0
    return STATE_BYTES.get(name)


def model_state_estimate(params: int, stage: int, fsdp: int, state_bytes: int, param_bytes: int = 4,
                         grad_bytes: int = 4, master_bytes: int = 0) -> dict[str, float]:
    """ZeRO's accounting: bytes per device by category. Parameters are replicated; gradients
    sharded from stage 2; fp32 master weights (bf16/fp16, ``master_bytes`` 4) and optimizer
    states from stage 1."""
    grads = grad_bytes * params / (fsdp if stage >= 2 else 1)
    states = state_bytes * params / (fsdp if stage >= 1 else 1)
    masters = master_bytes * params / (fsdp if stage >= 1 else 1)
    out = {"params": param_bytes * params, "grads": grads}
    if master_bytes:
        out["master weights"] = masters
    out["optimizer states"] = states
    out["total"] = param_bytes * params + grads + masters + states
    return out


def _validate_optimizer_and_scheduler(cfg: DeepSpeedConfig) -> None:
    """Build them on a stand-in parameter: their params are checked by their constructors."""
    import torch

    from .optim import build_optimizer
    from .schedules import build_scheduler

    if cfg.optimizer is None:
        return
    optimizer = build_optimizer(cfg.optimizer, [torch.nn.Parameter(torch.zeros(1))])
    if cfg.scheduler is not None:
        build_scheduler(cfg.scheduler, optimizer)


def config_check(path: str, devices: int, params: Optional[int]) -> str:
    cfg = load_config(config=path)
    shape = resolve_mesh_shape(cfg.spmd.mesh, devices)
    batch = resolve_batch(cfg, data_parallel_size(shape))  # one process: the CLI checks a single host
    _validate_optimizer_and_scheduler(cfg)
    lines = [f"config {path}: OK", ""]
    mesh = " x ".join(f"{axis}={size}" for axis, size in shape.items())
    lines += [
        f"  mesh                      {mesh} ({devices} devices, data-parallel size {batch.dp_devices})",
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
    noop = cfg.noop_keys
    lines += ["", "no-op keys under GSPMD:" if noop else "no-op keys under GSPMD: none"]
    lines += [f"  {key}: {NOOP_KEYS[key]}" for key in noop]
    if params is not None:
        from .precision import precision_policy

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


def _describe(section) -> str:
    if section is None:
        return "none"
    params = ", ".join(f"{k}={v}" for k, v in section.params.items())
    return f"{section.type}({params})"


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line naming the argument (exit 2), like every other CLI error."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def main(argv=None) -> int:
    """Exit 0 on success, 2 on any error, reported as one line on stderr."""
    from . import runtime

    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["launch"]:  # its options and the script's pass through untouched
        from .launch import main as launch_main

        return launch_main(argv[1:])
    parser = _Parser(prog="spmdzero", description="spmdzero tools")
    commands = parser.add_subparsers(dest="command", required=True)
    config = commands.add_parser("config", help="inspect a DeepSpeed config").add_subparsers(dest="action",
                                                                                              required=True)
    check = config.add_parser("check", help="resolve and validate a DeepSpeed config")
    check.add_argument("path", help="ds_config.json")
    check.add_argument("--devices", type=positive_int, default=None, help="device count (default: this machine's)")
    check.add_argument("--params", type=positive_int, default=None, help="model parameters, for the memory estimate")
    ckpt = commands.add_parser("checkpoint", help="checkpoint tools").add_subparsers(dest="action", required=True)
    merge = ckpt.add_parser("consolidate", help="one state dict a plain nn.Module loads (like zero_to_fp32.py)")
    merge.add_argument("ckpt_dir")
    merge.add_argument("out")
    merge.add_argument("--tag", default=None, help="checkpoint tag (default: the one in 'latest')")
    merge.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    merge.add_argument("--safetensors", action="store_true", help="write safetensors instead of torch.save")
    importer = ckpt.add_parser("import-deepspeed", help="convert a DeepSpeed ZeRO-1/2 checkpoint")
    importer.add_argument("ds_dir")
    importer.add_argument("out")
    importer.add_argument("--tag", default=None, help="checkpoint tag (default: the one in 'latest')")
    commands.add_parser("launch", help="run a DeepSpeed training script here: `import deepspeed` gives spmdzero "
                                       "(spmdzero launch [LAUNCHER OPTIONS] SCRIPT [ARGS...])")
    aot = commands.add_parser("aot", help="compile the training step for a TPU topology (needs libtpu, not a TPU)")
    from .aot import add_arguments

    add_arguments(aot)
    args = parser.parse_args(argv)
    if args.command == "aot":
        return _run_aot(args)
    if args.command == "checkpoint" and args.action == "import-deepspeed":
        from .checkpoint import CheckpointError
        from .deepspeed_import import import_deepspeed

        try:
            print(f"wrote {import_deepspeed(args.ds_dir, args.out, args.tag)}")
        except (CheckpointError, OSError) as err:
            print(f"checkpoint {args.ds_dir}: {_one_line(err)}", file=sys.stderr)
            return 2
        return 0
    if args.command == "checkpoint":
        from .checkpoint import CheckpointError, consolidate

        try:
            shapes = consolidate(args.ckpt_dir, args.out, args.tag, args.dtype, args.safetensors)
        except (CheckpointError, OSError) as err:
            print(f"checkpoint {args.ckpt_dir}: {_one_line(err)}", file=sys.stderr)
            return 2
        total = sum(int(np.prod(s)) for s in shapes.values())
        print(f"wrote {args.out}: {len(shapes)} tensors, {total:,} values ({args.dtype})")
        return 0
    devices = args.devices if args.devices is not None else runtime.visible_device_count()
    try:
        print(config_check(args.path, devices, args.params))
    except (ConfigError, OSError) as err:
        print(f"config {args.path}: {_one_line(err)}", file=sys.stderr)
        return 2
    return 0


def _one_line(err: Exception) -> str:
    if isinstance(err, OSError) and err.filename is not None:
        return f"{err.strerror}: {err.filename!r}"
    return " ".join(str(err).split())


def _run_aot(args) -> int:
    """Trace in a child process with one CPU device per chip (a quarter of them from 128 chips:
    spmdzero.aot_retarget), then compile for the TPU."""
    import os
    import subprocess

    from .aot import check_traceable

    try:
        devices = check_traceable(args.topology)
    except ValueError as err:
        print(err, file=sys.stderr)
        return 1
    env = {**os.environ, "CPU_NUM_DEVICES": str(devices), "PJRT_DEVICE": "CPU"}
    env.pop("SPMDZERO_NO_RUNTIME", None)
    env.pop("SPMDZERO_BACKEND", None)  # the trace is torch_xla's (the default engine's step), whatever this shell runs
    command = [sys.executable, "-m", "spmdzero.aot", *sys_argv_after(args)]
    return subprocess.run(command, env=env).returncode


def sys_argv_after(args) -> list[str]:
    """The ``aot`` options again, for the child process."""
    from .aot import scan_layers_args

    out = ["--topology", args.topology, "--deepspeed_config", args.deepspeed_config,
           "--stages", ",".join(map(str, args.stages))]
    for flag, value in (("--model", args.model), ("--seq-len", args.seq_len), ("--micro-batch", args.micro_batch)):
        if value is not None:
            out += [flag, str(value)]
    out += [flag for flag, on in (("--materialize", args.materialize), ("--find-max-batch", args.find_max_batch))
            if on]
    return out + scan_layers_args(args.scan_layers) + (["--json"] if args.json else [])
