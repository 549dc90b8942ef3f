"""The ``spmdzero`` command: ``config check`` (what a DeepSpeed config means to spmdzero,
before anything runs), ``checkpoint consolidate`` (one plain state dict), which need no
device (the console entry point does not start the XLA runtime for them), and ``launch``
(run a DeepSpeed script, ``spmdzero.cli.launch``), which starts it."""

from __future__ import annotations
import argparse
import sys
import numpy as np
from spmdzero.config.errors import ConfigError
from spmdzero.aot.command import positive_int
from spmdzero.cli.config_check import config_check


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line naming the argument (exit 2), like every other CLI error."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def main(argv=None) -> int:
    """Exit 0 on success, 2 on any error, reported as one line on stderr."""
    from spmdzero import runtime

    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["launch"]:  # its options and the script's pass through untouched
        from spmdzero.cli.launch import main as launch_main

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
    importer = ckpt.add_parser("import-deepspeed", help="convert a DeepSpeed ZeRO-1, 2 or 3 checkpoint")
    importer.add_argument("ds_dir")
    importer.add_argument("out")
    importer.add_argument("--tag", default=None, help="checkpoint tag (default: the one in 'latest')")
    commands.add_parser("launch", help="run a DeepSpeed training script here: `import deepspeed` gives spmdzero "
                                       "(spmdzero launch [LAUNCHER OPTIONS] SCRIPT [ARGS...])")
    aot = commands.add_parser("aot", help="compile the training step for a TPU topology (needs libtpu, not a TPU)")
    from spmdzero.aot.command import add_arguments

    add_arguments(aot)
    args = parser.parse_args(argv)
    if args.command == "aot":
        return _run_aot(args)
    if args.command == "checkpoint" and args.action == "import-deepspeed":
        from spmdzero.io.checkpoint_format import CheckpointError
        from spmdzero.io.deepspeed_import import import_deepspeed

        try:
            print(f"wrote {import_deepspeed(args.ds_dir, args.out, args.tag)}")
        except (CheckpointError, OSError) as err:
            print(f"checkpoint {args.ds_dir}: {_one_line(err)}", file=sys.stderr)
            return 2
        return 0
    if args.command == "checkpoint":
        from spmdzero.io.checkpoint_format import CheckpointError
        from spmdzero.io.consolidate import consolidate

        try:
            shapes = consolidate(args.ckpt_dir, args.out, args.tag, args.dtype, args.safetensors)
        except (CheckpointError, OSError) as err:
            print(f"checkpoint {args.ckpt_dir}: {_one_line(err)}", file=sys.stderr)
            return 2
        total = sum(int(np.prod(s)) for s in shapes.values())
        print(f"wrote {args.out}: {len(shapes)} tensors, {total:,} values ({args.dtype})")
        return 0
    try:
        devices = args.devices if args.devices is not None else runtime.visible_device_count()
        print(config_check(args.path, devices, args.params))
    except (ConfigError, OSError) as err:
        print(f"config {args.path}: {_one_line(err)}", file=sys.stderr)
        return 2
    except runtime.EnvironmentSettingError as err:  # CPU_NUM_DEVICES, read for the device count
        print(f"config {args.path}: {_one_line(err)}; or pass --devices", file=sys.stderr)
        return 2
    return 0


def _one_line(err: Exception) -> str:
    if isinstance(err, OSError) and err.filename is not None:
        return f"{err.strerror}: {err.filename!r}"
    return " ".join(str(err).split())


def _run_aot(args) -> int:
    """Trace in a child process, then compile for the TPU. The torch_xla backend's step is
    traced with one CPU device per chip (a quarter of them from 128 chips:
    spmdzero.tpu.retarget), in a process whose devices are torch_xla's; the torchax backend's on
    an abstract mesh, in a process whose devices are JAX's CPU ones (torch_xla never imported).
    Which backend: the one the config selects, as ``spmdzero.initialize`` would under this
    shell's ``SPMDZERO_BACKEND`` (``spmdzero.initialize.backend_of``)."""
    import os
    import subprocess

    from spmdzero.tpu.retarget import trace_devices

    from spmdzero.runtime import EnvironmentSettingError

    try:
        backend = _aot_backend(args.deepspeed_config)
    except EnvironmentSettingError as err:
        print(err, file=sys.stderr)
        return 1
    env = {**os.environ, "PJRT_DEVICE": "CPU"}  # never a TPU this machine may have: the compile is libtpu's own
    env.pop("SPMDZERO_NO_RUNTIME", None)
    if backend == "torchax":
        env["SPMDZERO_BACKEND"] = "torchax"
        # transformers imports accelerate, which imports torch_xla whenever it is installed (3-4 s
        # here, an eighth of a small model's whole command) unless USE_TORCH_XLA is off; the
        # torchax trace has no use for it
        env["USE_TORCH_XLA"] = "0"
    else:
        try:
            devices = trace_devices(args.topology)
        except ValueError as err:
            print(err, file=sys.stderr)
            return 1
        env["CPU_NUM_DEVICES"] = str(devices)
        env["SPMDZERO_BACKEND"] = "torch_xla"  # torch_xla's runtime takes the devices at import and traces it
    command = [sys.executable, "-m", "spmdzero.aot", *sys_argv_after(args)]
    return subprocess.run(command, env=env).returncode


def _aot_backend(path: str) -> str:
    """The backend ``spmdzero aot``'s child traces for the config at ``path``, as
    ``spmdzero.initialize`` would pick it under this shell's ``SPMDZERO_BACKEND`` (this
    process, the command's, started no runtime); for a config it cannot read, torch_xla's
    child, which reports the error."""
    import warnings

    from spmdzero.initialize import backend_of
    from spmdzero.config.load import read_config_file
    from spmdzero.runtime import jax_runtime

    jax_devices = jax_runtime.from_environment()  # a SPMDZERO_BACKEND that is no backend: said here
    try:
        with warnings.catch_warnings():  # the config's warnings: the child says them once
            warnings.simplefilter("ignore")
            return backend_of(read_config_file(path), jax_devices=jax_devices)
    except ConfigError:  # the child says it, naming the file
        return "torch_xla"


def sys_argv_after(args) -> list[str]:
    """The ``aot`` options again, for the child process."""
    from spmdzero.aot.command import scan_layers_args

    out = ["--topology", args.topology, "--deepspeed_config", args.deepspeed_config,
           "--stages", ",".join(map(str, args.stages))]
    for flag, value in (("--model", args.model), ("--seq-len", args.seq_len), ("--micro-batch", args.micro_batch),
                        ("--generate", args.generate), ("--tensor-parallel", args.tensor_parallel)):
        if value is not None:
            out += [flag, str(value)]
    out += [flag for flag, on in (("--materialize", args.materialize), ("--find-max-batch", args.find_max_batch),
                                  ("--gradient-checkpointing", args.gradient_checkpointing)) if on]
    return out + scan_layers_args(args.scan_layers) + (["--json"] if args.json else [])
