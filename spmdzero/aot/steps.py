"""The steps behind ``spmdzero.aot``: build an engine (shape-only by default) for a model source
and a config, capture its training step, compile it per ZeRO stage, and search the largest
micro-batch that fits. The whole story, from the package's docstring:

    with spmdzero.aot.capture(engine) as step:   # in a process with as many devices as chips
        loss = engine(batch)
        engine.backward(loss)
        engine.step()                             # traced, not executed
    report = step.compile("v5e:2x2")              # per-chip HBM, collectives, roofline

The step is exported as StableHLO with its sharding annotations, its state donated (each
state tensor's input aliased to its updated output, as a training loop runs it), and
compiled by libtpu's compile-only client through JAX (``spmdzero.tpu.compile``, in a
subprocess). After the block the engine is as it was: the traced update is dropped.

``python -m spmdzero.aot --topology v5e:2x2 --deepspeed_config cfg.json --model M`` (or
``spmdzero aot``) does this for stages 0, 1 and 2 and prints them side by side. By default
the engine is built shape-only (``spmdzero.aot.shapes``): no parameter is materialized, so
the host needs memory for the graph, not for N copies of the model.

The step compiled is the engine's of the backend the config selects (``spmd.backend``, else
the one ``SPMDZERO_BACKEND`` serves, else the default: ``initialize.with_backend``, as
``spmdzero.initialize`` picks it). A torchax engine's step is not intercepted but traced by
JAX, its training and update programs composed into one function
(``TorchaxEngine.trace_step``) over ``jax.ShapeDtypeStruct``s on an abstract mesh of the
topology's size: no device of this machine is involved, whatever the chip count."""

from __future__ import annotations
import copy
from typing import Optional
from spmdzero.tpu.chips import GIB, ChipSpec, chip_spec, topology_chips  # noqa: F401  (topology_chips: public here)
from spmdzero.tpu.capture import JaxStepCapture, StepCapture, capture, trace_step
from spmdzero.tpu.report import AotReport, gib_text
from spmdzero.initialize import backend_of, initialize
from spmdzero.aot.models import ModelSource, build_on_meta, checked_module
from spmdzero.aot.shapes import shape_only_engine, shape_only_torchax_engine
from spmdzero import runtime


def _stage_config(config: dict, stage: int, micro_batch: Optional[int]) -> dict:
    cfg = copy.deepcopy(config)
    if not isinstance(cfg.get("zero_optimization"), dict):  # absent, "auto", or DeepSpeed's old `true`/`false`
        cfg["zero_optimization"] = {}
    cfg["zero_optimization"]["stage"] = stage
    if micro_batch is not None:  # per chip; the global batch follows
        cfg["train_micro_batch_size_per_gpu"] = micro_batch
        cfg.pop("train_batch_size", None)
    return cfg


def capture_step(source, config: dict, stage: int, micro_batch: Optional[int] = None,
                 shape_only: bool = True, topology: Optional[str] = None) -> StepCapture | JaxStepCapture:
    """Build the engine for ``stage`` (shape-only unless told) and trace one step of it, on
    the backend the config selects (``spmdzero.initialize.backend_of``)."""
    if backend_of(config) == "torchax":
        return _trace_torchax_step(source, config, stage, micro_batch, shape_only, topology)
    ratio = topology_chips(topology) // runtime.device_count() if topology else 1
    if ratio > 1:  # traced on fewer devices than chips: the same global batch (spmdzero.tpu.retarget)
        micro_batch = micro_batch or config.get("train_micro_batch_size_per_gpu")
        if micro_batch is None:
            raise ValueError(f"{topology} is traced on {runtime.device_count()} devices with {ratio} x the "
                             "micro-batch per chip: give it (--micro-batch or train_micro_batch_size_per_gpu)")
        micro_batch *= ratio
    cfg = _stage_config(config, stage, micro_batch)
    if shape_only:
        model = build_on_meta(source)
        engine, inputs = shape_only_engine(model, cfg)
    else:
        model, inputs = checked_module(source, source.build()), None
        engine, *_ = initialize(model=model, config=cfg)
        # a torch optimizer's first step creates its state: trace a later step, over placeholder
        # state, as the shape-only engine does (the state then an input, donated, as every step after)
        engine.placeholder_optimizer_state()
    args, kwargs = source.inputs(model, engine.train_micro_batch_size_per_gpu() * engine.dp_world_size)
    with capture(engine, inputs) as step:
        loss = source.loss(engine(*args, **kwargs))
        engine.backward(loss)
        step.loss = loss
        engine.step()
    return step


def _trace_torchax_step(source, config: dict, stage: int, micro_batch: Optional[int], shape_only: bool,
                        topology: Optional[str]) -> JaxStepCapture:
    """The torchax engine's step for ``topology`` (else this process's device count), always
    on a shape-only engine: ``shape_only=False`` only builds the model with real parameters
    (for a model that does not build on ``meta``); the engine never places them."""
    cfg = _stage_config(config, stage, micro_batch)
    model = build_on_meta(source) if shape_only else checked_module(source, source.build())
    if not source.returns_loss:
        _loss_inside(model, source.loss)
    engine = shape_only_torchax_engine(model, cfg, topology_chips(topology) if topology else runtime.device_count())
    args, kwargs = source.inputs(model, engine.train_micro_batch_size_per_gpu() * engine.dp_world_size)
    return trace_step(engine, *args, **kwargs)


def _loss_inside(model, loss) -> None:
    """``model``'s forward returning ``loss`` of its output: the step compiled is then the
    torchax engine's fused training program with that loss. (The engine would run a loss the
    script computes from the outputs through its VJP and backward programs instead, which one
    step cannot compose; the gradients and the update are the same.) The instance's own
    ``forward``: the parameters keep their names."""
    forward = model.forward

    def with_loss(*args, **kwargs):
        return loss(forward(*args, **kwargs))

    model.forward = with_loss


def compile_step(source, config: dict, topology: str, stage: int, micro_batch: Optional[int] = None,
                 shape_only: bool = True) -> AotReport:
    step = capture_step(source, config, stage, micro_batch, shape_only, topology)
    report = step.compile(topology)
    # a mixture of experts runs each token through k of its experts: 6 x params x tokens would
    # count them all, so its MFU is the compiled FLOPs' (the kernels count the routed rows)
    if source.seq_len is not None and report.experts is None:
        params = step.gradient_bytes() // step.engine.precision.communication_dtype.itemsize
        report.model_flops = 6 * params * report.micro_batch * source.seq_len
    return report


def compare_stages(make_model, config: dict, topology: str, stages=(0, 1, 2), micro_batch: Optional[int] = None,
                   shape_only: bool = False) -> list[AotReport]:
    """Capture and compile one step per ZeRO stage. ``make_model`` is a ``ModelSource``
    (``aot_models.load_model_source``) or a callable returning a model with an
    ``example_inputs(batch_size)`` method whose forward returns the loss."""
    source = make_model if isinstance(make_model, ModelSource) else ModelSource(
        getattr(make_model, "__name__", "model"), make_model, lambda m, b: (tuple(m.example_inputs(b)), {}),
        lambda output: output, returns_loss=True)
    return [compile_step(source, config, topology, stage, micro_batch, shape_only) for stage in stages]


SEARCH_LIMIT = 4096  # micro-batch per chip: find_max_batch doubles up to it


def find_max_batch(source, config: dict, topology: str, stage: int, shape_only: bool = True,
                   limit: int = SEARCH_LIMIT, known: Optional[dict] = None) -> tuple[int, list[AotReport]]:
    """The largest micro-batch per chip whose step fits: doubling from 1, then bisection.
    Returns it (0 if even 1 does not fit; ``limit`` if that fits: larger sizes are not tried)
    and every report on the way. ``known``: reports already compiled, by micro-batch."""
    reports: list[AotReport] = []

    def fits(batch: int) -> bool:
        report = (known or {}).get(batch)
        reports.append(report if report is not None else compile_step(source, config, topology, stage, batch,
                                                                      shape_only))
        return reports[-1].fits

    if not fits(1):
        return 0, reports
    low, high = 1, None
    while high is None:
        candidate = low * 2
        if candidate > limit:
            return low, reports
        if fits(candidate):
            low = candidate
        else:
            high = candidate
    while high - low > 1:
        mid = (low + high) // 2
        if fits(mid):
            low = mid
        else:
            high = mid
    return low, reports


def search_summary(best: int, tried: list[AotReport], seconds: float) -> dict:
    """What ``find_max_batch`` found, for the report: the answer, every size tried, the
    per-chip total at the answer, and for the next size, by how much it misses and libtpu's
    largest allocation there (what grows with the batch)."""
    by_batch = {r.micro_batch: r for r in tried}
    out = {"max_micro_batch": best, "compiles": len(tried), "seconds": seconds,
           "tried": {r.micro_batch: r.fits for r in tried}, "at_search_limit": best >= SEARCH_LIMIT}
    if best in by_batch:
        out["total_bytes"] = by_batch[best].total_bytes
    miss = by_batch.get(best + 1)
    if miss is not None and not miss.fits:
        largest = (miss.out_of_memory or {}).get("largest_allocations") or []
        out["next"] = {"micro_batch": best + 1, "over_by": miss.over_by,
                       "largest_allocation": largest[0] if largest else None}
    return out


def describe_search(stage: int, found: dict, hbm_bytes: int) -> str:
    best = found["max_micro_batch"]
    line = f"stage {stage}: largest micro-batch per chip that fits: " + (
        f">= {best} (the search limit; larger sizes were not tried)" if found.get("at_search_limit") else str(best))
    if "total_bytes" in found:
        line += f" ({gib_text(found['total_bytes'])} of {gib_text(hbm_bytes)})"
    following = found.get("next")
    if following:
        line += f"; {following['micro_batch']} misses by {gib_text(following['over_by'])}"
        largest = following.get("largest_allocation")
        if largest:
            line += f", its largest allocation {gib_text(largest['bytes'])} {largest['shape']}"
    return line + f" ({found['compiles']} compiles, {found['seconds']:.0f} s)"

