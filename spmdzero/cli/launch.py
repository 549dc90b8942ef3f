"""``spmdzero launch [DEEPSPEED LAUNCHER OPTIONS] SCRIPT [ARGS...]``: run an unmodified
DeepSpeed training script the way ``deepspeed SCRIPT ARGS`` does on GPUs, but as one
process per host that drives all of the host's devices.

The script runs in this process (``runpy``) after ``import deepspeed`` has been aliased
to spmdzero's compatibility layer (``spmdzero.compat.alias``). As DeepSpeed's launcher,
it sets ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_SIZE``, ``CROSS_RANK``,
``CROSS_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT``, and passes ``--local_rank=0`` (not with an
accelerate ``--config_file``: accelerate's launcher passes no such argument). On a
pod, run the same command on every host: the process index and count come from the XLA
runtime (JAX's, through the TPU runtime; torch_xla's on a TPU pod under
``SPMDZERO_BACKEND=torch_xla``).

DeepSpeed's ``--num_nodes N --node_rank I --master_addr A --master_port P`` name the hosts
explicitly: they are exported (``WORLD_SIZE``, ``RANK``, ``MASTER_ADDR``, ``MASTER_PORT``)
before the runtime starts, so that the N processes join one global mesh through
``jax.distributed`` (``spmdzero.runtime.jax_runtime``), on CPU hosts too. A run whose config (or
``--spmd``) names ``"backend": "torch_xla"`` gets ``SPMDZERO_BACKEND=torch_xla`` unless the
variable is set, so that torch_xla's runtime takes the devices; it finds its hosts itself, and
there the flags are checked against it.
"""

from __future__ import annotations

import argparse
import json
import os
import runpy
import sys
from typing import Optional

from spmdzero.cli.accelerate_config import read_accelerate_config

DEFAULT_PORT = 29500

# DeepSpeed launcher options that select GPUs, nodes or a remote launcher: under
# spmdzero each host runs one process that drives all of its devices, started on each host
# by the user (--num_nodes/--node_rank name them), so these have no meaning here.
_IGNORED = {
    "--hostfile": str, "--include": str, "--exclude": str,
    "--num_gpus": int, "--num_accelerators": int, "--min_elastic_nodes": int,
    "--max_elastic_nodes": int, "--launcher": str, "--launcher_args": str,
    "--enable_each_rank_log": str, "--autotuning": str, "--bind_core_list": str, "--ssh_port": int,
    "--venv_script": str, "--log_level": str,
}
_IGNORED_FLAGS = ("--no_ssh", "--no_ssh_check", "--force_multi", "--save_pid", "--elastic_training",
                  "--bind_cores_to_rank", "--quiet")
_SHORT = {"--hostfile": "-H", "--include": "-i", "--exclude": "-e", "--quiet": "-q"}  # DeepSpeed's aliases


def _port(text: str) -> int:
    """A TCP port number, 0-65535 (torch.distributed's store would fail on another one later,
    far from the cause)."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port number (0-65535), got {text!r}")
    return port


def _master_port(given: Optional[int]) -> int:
    """``--master_port``, else ``MASTER_PORT`` from the environment, else DeepSpeed's default."""
    if given is not None:
        return given
    text = os.environ.get("MASTER_PORT")
    if text is None:
        return DEFAULT_PORT
    try:
        return _port(text)
    except argparse.ArgumentTypeError:
        raise ValueError(f"MASTER_PORT={text!r} in the environment is not a port number (0-65535): fix it, unset "
                         "it, or pass --master_port") from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="spmdzero launch", allow_abbrev=False,
        description="Run a DeepSpeed training script on this host's XLA devices (one process per host; run the "
                    "same command on every host of a pod). `import deepspeed` resolves to spmdzero.")
    parser.add_argument("--master_addr", default=None, help="address of the first host (several hosts)")
    parser.add_argument("--master_port", type=_port, default=None,
                        help=f"rendezvous port of torch.distributed (default: MASTER_PORT, else {DEFAULT_PORT}); "
                             "JAX's coordinator takes the next one")
    parser.add_argument("--num_nodes", type=int, default=None,
                        help="the number of hosts (one process each); run this command on every host")
    parser.add_argument("--node_rank", type=int, default=None,
                        help="this host's index, 0 to num_nodes - 1 (0 is the master_addr host)")
    parser.add_argument("--module", action="store_true", help="SCRIPT is a module name (python -m)")
    parser.add_argument("--no_local_rank", action="store_true",
                        help="do not pass --local_rank=0 to the script (not passed with --config_file either)")
    parser.add_argument("--spmd", default=None, metavar="JSON",
                        help='spmdzero settings for the script\'s deepspeed.initialize, merged under its config\'s '
                             '"spmd" section, e.g. \'{"pad_to_multiple_of": 64}\' (see docs/config.md)')
    parser.add_argument("--config_file", default=None, metavar="ACCELERATE_CONFIG",
                        help="an accelerate config (YAML or JSON) with distributed_type: DEEPSPEED, as `accelerate "
                             "launch --config_file` takes: its DeepSpeed settings reach the script's Accelerator()")
    parser.add_argument("--no_python", action="store_true", help=argparse.SUPPRESS)
    for name, kind in _IGNORED.items():
        parser.add_argument(name, *filter(None, [_SHORT.get(name)]), type=kind, default=None, help=argparse.SUPPRESS)
    for name in _IGNORED_FLAGS:
        parser.add_argument(name, *filter(None, [_SHORT.get(name)]), action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("user_script", help="the training script (or module with --module)")
    parser.add_argument("user_args", nargs=argparse.REMAINDER, help="the script's arguments")
    return parser


def _ignored_options(args: argparse.Namespace) -> list[str]:
    given = []
    for name in list(_IGNORED) + list(_IGNORED_FLAGS):
        dest = name.lstrip("-").replace("-", "_")
        value = getattr(args, dest, None)
        if value not in (None, False):
            given.append(name if value is True else f"{name}={value}")
    return given


def _master_addr(given: Optional[str], process_count: int) -> str:
    if given:
        return given
    if "MASTER_ADDR" in os.environ:
        return os.environ["MASTER_ADDR"]
    if process_count == 1:
        return "127.0.0.1"
    try:  # a TPU pod: the first worker's address, from the TPU metadata
        from torch_xla._internal import tpu

        return tpu.discover_master_worker_ip()
    except Exception as err:
        raise SystemExit(f"spmdzero launch: {process_count} hosts and no master address: pass --master_addr "
                         f"(the first host's address) or set MASTER_ADDR ({err})") from None


def _hosts_from_flags(args: argparse.Namespace, join: bool) -> tuple[int | None, int] | None:
    """(node_rank, num_nodes) as the flags give them, checked; None without ``--num_nodes`` (the
    runtime finds the hosts). ``join``: JAX will join the hosts they name, so ``--node_rank``
    and the master address are needed; torch_xla's runtime only checks them (node_rank None
    when not given)."""
    if args.num_nodes is None:
        if args.node_rank not in (None, 0):
            raise SystemExit(f"spmdzero launch: --node_rank {args.node_rank} needs --num_nodes (the number of hosts)")
        return None
    if args.num_nodes < 1:
        raise SystemExit(f"spmdzero launch: --num_nodes {args.num_nodes}: the number of hosts, >= 1")
    if args.num_nodes == 1:
        return 0, 1
    if (args.node_rank is None and join) or not 0 <= (args.node_rank or 0) < args.num_nodes:
        raise SystemExit(f"spmdzero launch: --num_nodes {args.num_nodes} needs --node_rank, this host's index "
                         f"(0 to {args.num_nodes - 1}), got {args.node_rank}")
    if join and not (args.master_addr or os.environ.get("MASTER_ADDR")):
        raise SystemExit(f"spmdzero launch: --num_nodes {args.num_nodes} needs --master_addr (the address of the "
                         "host with --node_rank 0) or MASTER_ADDR")
    return args.node_rank, args.num_nodes


CONFIG_FLAGS = ("--deepspeed_config", "--deepspeed")  # DeepSpeed's own, and the HF Trainer's


def configured_backend(spmd: dict, script_args: list[str]) -> Optional[str]:
    """The backend the run asks for: ``--spmd``'s ``backend``, else the ``spmd.backend`` of the
    config file the script is given (``--deepspeed_config PATH``, ``--deepspeed PATH``). None when
    neither names one, or the file cannot be read here (``initialize`` reports that)."""
    if isinstance(spmd.get("backend"), str):
        return spmd["backend"]
    from spmdzero.config.load import read_config_file

    for i, arg in enumerate(script_args):
        flag, _, path = arg.partition("=")
        if flag not in CONFIG_FLAGS:
            continue
        path = path or (script_args[i + 1] if i + 1 < len(script_args) else "")
        try:
            section = read_config_file(path).get("spmd")
        except Exception:  # not a file (``--deepspeed`` as a bare flag), or not a config
            continue
        if isinstance(section, dict) and isinstance(section.get("backend"), str):
            return section["backend"]
    return None


def set_launcher_env(process_index: int, process_count: int, master_addr: str, master_port: int) -> None:
    """What DeepSpeed's launcher exports to each process, for one process per host."""
    os.environ.update({
        "RANK": str(process_index), "LOCAL_RANK": "0", "WORLD_SIZE": str(process_count), "LOCAL_SIZE": "1",
        "CROSS_RANK": str(process_index), "CROSS_SIZE": str(process_count),
        "MASTER_ADDR": master_addr, "MASTER_PORT": str(master_port),
    })


def main(argv: Optional[list[str]] = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.no_python:
        print("spmdzero launch: --no_python is not supported (the script runs inside this Python process)",
              file=sys.stderr)
        return 2
    ignored = _ignored_options(args)
    if args.config_file is not None:
        try:
            accelerate = read_accelerate_config(args.config_file)
        except ValueError as err:
            print(f"spmdzero launch: {err}", file=sys.stderr)
            return 2
        os.environ.update(accelerate.env)  # as accelerate's launcher exports them, over the environment
        for flag, value in accelerate.hosts.items():  # the command line's own flags win
            if getattr(args, flag) is None:
                setattr(args, flag, value)
        ignored += accelerate.ignored
    if ignored:
        print(f"spmdzero launch: ignoring {', '.join(ignored)}: one process per host drives every local device; "
              "on a pod, run this same command on every host", file=sys.stderr)

    spmd = {}
    if args.spmd:
        try:
            spmd = json.loads(args.spmd)
        except json.JSONDecodeError as err:
            print(f"spmdzero launch: --spmd is not JSON ({err}): {args.spmd!r}", file=sys.stderr)
            return 2
        if not isinstance(spmd, dict):
            print(f"spmdzero launch: --spmd must be a JSON object, got {args.spmd!r}", file=sys.stderr)
            return 2

    os.environ.pop("SPMDZERO_NO_RUNTIME", None)  # the console entry point sets it for its other commands
    from spmdzero import runtime
    from spmdzero.compat import alias
    from spmdzero.runtime import jax_runtime

    if configured_backend(spmd, args.user_args) == "torch_xla" and not os.environ.get(jax_runtime.VARIABLE):
        # torch_xla's runtime must take the devices at start (on a TPU, JAX would hold the chips)
        os.environ[jax_runtime.VARIABLE] = "torch_xla"
    try:  # before the runtime starts: a bad value costs no startup
        port = _master_port(args.master_port)
        join = jax_runtime.from_environment()
    except ValueError as err:  # MASTER_PORT, SPMDZERO_BACKEND
        print(f"spmdzero launch: {err}", file=sys.stderr)
        return 2
    given = _hosts_from_flags(args, join)
    if given is not None and join:  # before JAX starts: it joins the hosts these name
        set_launcher_env(*given, _master_addr(args.master_addr, given[1]), port)
    try:
        runtime.start()
        index, count = runtime.hosts()
    except (ValueError, RuntimeError) as err:  # CPU_NUM_DEVICES, PJRT_DEVICE, WORLD_SIZE/RANK (torchax), ...
        device = os.environ.get("PJRT_DEVICE")
        where = f" (PJRT_DEVICE={device!r})" if device is not None and not isinstance(err, ValueError) else ""
        print(f"spmdzero launch: the runtime did not start{where}: {' '.join(str(err).split())}", file=sys.stderr)
        return 2
    if given is not None and (given[0] not in (None, index) or given[1] != count):
        rank = "" if given[0] is None else f" --node_rank {given[0]}"
        print(f"spmdzero launch: --num_nodes {given[1]}{rank}, but the runtime found process "
              f"{index} of {count}. torch_xla's runtime (SPMDZERO_BACKEND=torch_xla) finds the hosts itself (a TPU "
              "pod) and cannot join processes on CPU; to join hosts named by these flags, use the torchax backend "
              "(the default: unset SPMDZERO_BACKEND, and no \"backend\": \"torch_xla\" in the config)",
              file=sys.stderr)
        return 2
    set_launcher_env(index, count, _master_addr(args.master_addr, count), port)
    try:
        alias.install()
    except RuntimeError as err:
        print(f"spmdzero launch: {err}", file=sys.stderr)
        return 1
    from spmdzero.compat import deepspeed

    deepspeed.SPMD_DEFAULTS.update(spmd)  # checked with the rest of the config by deepspeed.initialize

    # DeepSpeed's launcher passes --local_rank; accelerate's does not (its scripts' parsers
    # refuse it: transformers' *_no_trainer.py examples)
    local_rank = not args.no_local_rank and args.config_file is None
    script_args = (["--local_rank=0"] if local_rank else []) + args.user_args
    if args.module:
        sys.argv = [args.user_script] + script_args
        runpy.run_module(args.user_script, run_name="__main__", alter_sys=True)
        return 0
    script = os.path.abspath(args.user_script)
    if not os.path.isfile(script):
        print(f"spmdzero launch: no such script: {args.user_script}", file=sys.stderr)
        return 2
    sys.argv = [args.user_script] + script_args
    sys.path.insert(0, os.path.dirname(script))  # as `python SCRIPT` does
    runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
