"""``spmdzero aot`` (``python -m spmdzero.aot``): compile the real step of a model and a
config for a TPU topology, stage by stage, side by side; or find the largest micro-batch that
fits (``--find-max-batch``). Bad input is refused with one line naming it."""

from __future__ import annotations
import argparse
import json
import os
import sys
import time
from spmdzero.tpu.chips import GIB, ChipSpec, chip_spec, topology_chips  # noqa: F401  (topology_chips: public here)
from spmdzero.config.load import without_integration_autos


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _stages(text: str) -> tuple[int, ...]:
    try:
        stages = tuple(int(s) for s in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ZeRO stages such as 0,1,2,3, got {text!r}") from None
    if any(s not in (0, 1, 2, 3) for s in stages):
        raise argparse.ArgumentTypeError(f"ZeRO stages are 0, 1, 2 and 3, got {text!r}")
    return stages


def default_model() -> str:
    """The repository's example model, wherever the command runs from."""
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # above spmdzero/aot/
    path = os.path.join(repo, "examples", "model.py")
    if not os.path.isfile(path):
        raise ValueError("no --model given and the example model (examples/model.py) is not next to this spmdzero "
                         "installation: pass --model PATH.py:NAME or a transformers config.json")
    return f"{path}:TinyGPT"


def _scan_layers_value(value: str) -> str:
    if value != "stacked":
        raise argparse.ArgumentTypeError(f"{value!r}: give no value (spmd.scan_layers=true) or 'stacked'")
    return value


def scan_layers_args(value: bool | str) -> list[str]:
    """``--scan-layers`` as a command line gives it (``spmd.scan_layers``: False, True or
    "stacked")."""
    return ["--scan-layers"] + ([value] if isinstance(value, str) else []) if value else []


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's options (shared with ``spmdzero aot``)."""
    parser.add_argument("--topology", required=True, help="e.g. v5e:2x2, v5e:4x4, v5e:16x16, v5p:2x4x4, v6e:2x2")
    parser.add_argument("--deepspeed_config", required=True)

    parser.add_argument("--model", default=None,
                        help="PATH.py:NAME, a transformers config.json, or a directory with one (default: the "
                             "repository's examples/model.py:TinyGPT)")
    parser.add_argument("--stages", default=(0, 1, 2), type=_stages, help="ZeRO stages, comma-separated (default 0,1,2; 3 shards the parameters too)")
    parser.add_argument("--seq-len", type=positive_int, default=None, help="tokens per sequence (transformers configs)")
    parser.add_argument("--micro-batch", type=positive_int, default=None,
                        help="sequences per chip per micro-step (default: the config's)")
    parser.add_argument("--materialize", action="store_true",
                        help="trace with real parameters instead of shape-only (needs N x the model in host RAM)")
    parser.add_argument("--scan-layers", nargs="?", const=True, default=False, type=_scan_layers_value,
                        metavar="stacked",
                        help="compile the step as the engine runs it with spmd.scan_layers: one loop over the layer "
                             "stack instead of every layer unrolled (needed for 7B-scale compiles on a small host); "
                             "'--scan-layers stacked' as with spmd.scan_layers='stacked' (one parameter per block "
                             "parameter name: the update around the loop does not grow with depth)")
    parser.add_argument("--gradient-checkpointing", action="store_true",
                        help="call the model's gradient_checkpointing_enable() before tracing (transformers "
                             "models): each block is recomputed in the backward instead of keeping its activations")
    parser.add_argument("--find-max-batch", action="store_true",
                        help="also find the largest micro-batch per chip that fits (a few compiles per stage)")
    parser.add_argument("--generate", default=None, metavar="BATCH:PROMPT:NEW",
                        help="also compile the decode step that generation alternates with (transformers causal "
                             "LMs): BATCH sequences, PROMPT + NEW tokens, the weights laid out tensor-parallel and "
                             "the KV cache split by heads (DeepSpeed's Hybrid Engine as annotations); reports its "
                             "HBM and its roofline time against the HBM floor")
    parser.add_argument("--tensor-parallel", type=positive_int, default=None, metavar="N",
                        help="with --generate: chips per tensor-parallel group (default: every chip); the groups "
                             "split the batch")
    parser.add_argument("--json", action="store_true", help="print one JSON document instead of the tables")


def for_compile(config: dict, path: str, micro_batch: int | None) -> dict:
    """A config as a Hugging Face integration writes it, made compilable: what only the HF
    Trainer fills in (``"auto"`` optimizer and scheduler parameters; the optimizer it passes
    when the config has none) does not change the compiled step's memory or collectives (the
    learning rate and its schedule are device numbers fed to the step), so ``"auto"``
    optimizer parameters take their defaults, a scheduler with ``"auto"`` parameters is left
    out, and a config with no optimizer gets AdamW, each said once on stderr. A config
    without a batch size needs ``--micro-batch``."""
    if not isinstance(config, dict):
        return config  # parse_config names it
    notes = []
    if config.get("optimizer") is None:
        config = {**config, "optimizer": {"type": "AdamW"}}
        notes.append("it has no 'optimizer' section: compiled with AdamW (the optimizer the Hugging Face Trainer "
                     "gives DeepSpeed by default)")
    config, auto, scheduler_dropped = without_integration_autos(config)
    if auto:
        notes.append(f"optimizer.params {', '.join(auto)} are \"auto\": compiled with the optimizer's defaults "
                     "(the values do not change the compiled step)")
    if scheduler_dropped:
        notes.append("scheduler.params hold \"auto\": compiled without the schedule (it sets the learning rate "
                     "between steps; the compiled step is the same)")
    batch = [config.get(k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu")]
    if micro_batch is None and all(v is None or v == "auto" for v in batch):
        raise ValueError(f"{path}: train_batch_size and train_micro_batch_size_per_gpu are \"auto\" or absent "
                         "(an integration fills them in): pass --micro-batch")
    for note in notes:
        print(f"spmdzero aot: {path}: {note}", file=sys.stderr)
    return config


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="spmdzero aot", description="compile the training step for a TPU topology")
    add_arguments(parser)
    args = parser.parse_args(argv)
    # here, not at the top: the command line's own process imports this module for its options,
    # and the tracing (torch, the backends) happens only in the child
    from spmdzero.aot.decode import Generation, compile_decode
    from spmdzero.aot.models import load_model_source, with_gradient_checkpointing
    from spmdzero.aot.steps import compile_step, describe_search, find_max_batch, search_summary
    from spmdzero.config.load import parse_config, read_config_file
    from spmdzero.initialize import backend_of
    from spmdzero.tpu.capture import check_traceable
    from spmdzero.tpu.report import stages_table

    stages = args.stages
    shape_only = not args.materialize
    try:
        config = for_compile(read_config_file(args.deepspeed_config), args.deepspeed_config, args.micro_batch)
        parse_config(config, args.deepspeed_config)  # as given: a wrong config is refused before any compile
        backend = backend_of(config)
        if backend == "torch_xla":  # traced on one CPU device per chip (or a quarter of them)
            check_traceable(args.topology)
        else:  # traced on an abstract mesh of any size: only the name is checked
            topology_chips(args.topology)
        if args.scan_layers:
            config["spmd"] = {**(config.get("spmd") if isinstance(config.get("spmd"), dict) else {}),
                              "scan_layers": args.scan_layers}
        source = load_model_source(args.model or default_model(), args.seq_len)
        if args.gradient_checkpointing:
            source = with_gradient_checkpointing(source)
        generation = None if args.generate is None else Generation.parse(args.generate)
        reports = [compile_step(source, config, args.topology, stage, args.micro_batch, shape_only)
                   for stage in stages]
        decode = None if generation is None else compile_decode(source, args.topology, generation,
                                                                args.tensor_parallel)
        searches = {}
        if args.find_max_batch:
            for stage in stages:
                start = time.perf_counter()
                known = {r.micro_batch: r for r in reports if r.stage == stage}
                best, tried = find_max_batch(source, config, args.topology, stage, shape_only, known=known)
                searches[stage] = search_summary(best, tried, time.perf_counter() - start)
    except (ValueError, RuntimeError) as err:
        print(f"spmdzero aot: {err}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"model": source.name, "topology": args.topology, "backend": backend, "shape_only": shape_only,
                          "reports": [r.to_dict() for r in reports], "max_micro_batch": searches,
                          "decode": None if decode is None else decode.to_dict()}, indent=1))
        return 0
    for report in reports:
        print(report.summary(), end="\n\n")
    print(stages_table(reports))
    for stage, found in searches.items():
        print("\n" + describe_search(stage, found, chip_spec(args.topology).hbm_bytes))
    if decode is not None:
        print("\n" + decode.summary())
    return 0
