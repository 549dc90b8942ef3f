"""``spmdzero aot --generate BATCH:PROMPT:NEW``: one decode step of a transformers causal LM,
laid out for generation (``sharding/decode_plan.py``: tensor-parallel weights, the KV cache split
by heads, the batch over the data groups), compiled for a TPU topology as the training step is,
shape-only: no weight is materialized.

What it answers, per chip: the HBM the decode step needs (weights and cache included), its
collectives, and its roofline time against the **HBM floor**: the bytes of weights and KV cache
each chip must read per token, over the chip's HBM bandwidth. A decode step is bound by that
read; the ratio says how far the compiled step is from it. Its HBM term is the traffic the
compiled program moves in and out of HBM (``tpu/hbm_traffic.py``, from the memory spaces of its
HLO): XLA's cost analysis also counts the copies libtpu makes into on-chip memory and the reads
there, three times the bytes of each prefetched layer, and is reported beside it. The cache is sized for the whole
generation (prompt + new tokens); the step is the last one's (every slot attended), the
slowest."""

from __future__ import annotations

import dataclasses
from typing import Optional

import numpy as np

from spmdzero.aot.models import ModelSource, build_on_meta
from spmdzero.runtime import jax_private
from spmdzero.runtime.jax_runtime import shardy_partitioner
from spmdzero.sharding.decode_plan import DATA_AXIS, TENSOR_AXIS, DecodePlan, decode_plan
from spmdzero.sharding.mesh import FSDP_AXIS
from spmdzero.sharding.plan import make_plan
from spmdzero.tpu.capture import LIBTPU_MOSAIC_IR_VERSION, compile_mlir
from spmdzero.tpu.chips import topology_chips
from spmdzero.tpu.report import AotReport, gib_text


@dataclasses.dataclass(frozen=True)
class Generation:
    """``BATCH:PROMPT:NEW``: sequences decoded together, prompt tokens, new tokens."""

    batch: int
    prompt: int
    new: int

    @classmethod
    def parse(cls, text: str) -> "Generation":
        parts = text.split(":")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"--generate {text!r}: give BATCH:PROMPT:NEW as three positive integers, e.g. 64:512:512")
        return cls(*(int(p) for p in parts))

    @property
    def max_length(self) -> int:
        return self.prompt + self.new


@dataclasses.dataclass
class DecodeReport:
    """One compiled decode step: the compile's report, the plan, and the HBM floor."""

    step: AotReport
    plan: DecodePlan
    generation: Generation
    weight_bytes: int  # per chip, in the generation layout
    cache_bytes: int  # per chip
    reshard: Optional[AotReport] = None  # the weights from training's ZeRO-3 layout into this one, compiled

    def roofline(self) -> dict:
        """The compiled step's roofline (``AotReport.roofline``) with its HBM term from the HBM
        traffic; ``cost_analysis_s``: the step by the cost analysis's bytes."""
        by_cost = self.step.roofline()
        if not by_cost or self.step.hbm_bytes is None:
            return by_cost
        parts = {"compute_s": by_cost["compute_s"], "hbm_s": self.step.hbm_bytes / self.step.chip.hbm_bandwidth,
                 "ici_s": by_cost["ici_s"]}
        step = max(parts.values())
        return {**parts, "step_s": step, "bound": max(parts, key=parts.get).removesuffix("_s"),
                "hbm_bytes": self.step.hbm_bytes, "cost_analysis_s": by_cost["step_s"]}

    @property
    def floor_s(self) -> float:
        """The HBM floor: every weight and cache byte of a chip read once per token."""
        return (self.weight_bytes + self.cache_bytes) / self.step.chip.hbm_bandwidth

    def summary(self) -> str:
        roofline = self.roofline()
        lines = [f"decode step on {self.step.topology}, {self.generation.batch} sequences, "
                 f"{self.generation.prompt} + {self.generation.new} tokens ({self.plan.describe()})"]
        if self.step.memory is None:
            lines.append(f"  does not fit: the compiler needs {gib_text(self.step.total_bytes)} a chip")
        else:
            lines.append(f"  HBM per chip: {gib_text(self.step.total_bytes)} of {gib_text(self.step.chip.hbm_bytes)} "
                         f"(weights {gib_text(self.weight_bytes)}, KV cache {gib_text(self.cache_bytes)}, "
                         f"temporaries {gib_text(self.step.memory['temp'])})")
        traffic = self.step.collectives
        sent = sum(v.get("sent", 0) for v in traffic.values())
        kinds = ", ".join(f"{k} x{v['count']}" for k, v in sorted(traffic.items()))
        lines.append(f"  collectives: {kinds or 'none'}; {sent / 2**20:.1f} MiB sent per chip")
        if roofline:
            step = roofline["step_s"]
            moved = f", HBM traffic {gib_text(roofline['hbm_bytes'])}" if "hbm_bytes" in roofline else ""
            lines.append(f"  roofline {step * 1e3:.2f} ms a token ({roofline['bound']}-bound{moved}) against the HBM "
                         f"floor {self.floor_s * 1e3:.2f} ms: {step / self.floor_s:.2f}x")
            if "cost_analysis_s" in roofline:
                by_cost = roofline["cost_analysis_s"]
                lines.append(f"  (by XLA's cost analysis, which also counts the on-chip copies: {by_cost * 1e3:.2f} ms, "
                             f"{by_cost / self.floor_s:.2f}x)")
        if self.reshard is not None:
            moved = self.reshard_sent_bytes()
            timed = self.reshard.roofline()
            time = f", roofline {timed['step_s'] * 1e3:.2f} ms" if timed else ""
            lines.append(f"  reshard from ZeRO-3's layout (once a generation, and back): {moved / 2**20:.1f} MiB "
                         f"sent per chip{time}")
        return "\n".join(lines)

    def reshard_sent_bytes(self) -> int:
        """Bytes a chip sends to lay the weights out for generation (the compiled reshard's collectives)."""
        return sum(v.get("sent", 0) for v in self.reshard.collectives.values()) if self.reshard else 0

    def to_dict(self) -> dict:
        roofline = self.roofline()
        return {"topology": self.step.topology, "generation": dataclasses.asdict(self.generation),
                "mesh": dict(self.plan.mesh_shape), "memory": self.step.memory, "total_bytes": self.step.total_bytes,
                "weight_bytes": self.weight_bytes, "cache_bytes": self.cache_bytes,
                "collectives": self.step.collectives, "roofline": roofline, "floor_s": self.floor_s,
                "floor_ratio": roofline["step_s"] / self.floor_s if roofline else None,
                "cost_analysis_ratio": roofline["cost_analysis_s"] / self.floor_s if "cost_analysis_s" in roofline
                else None,
                "reshard": None if self.reshard is None else {
                    "collectives": self.reshard.collectives, "sent_bytes": self.reshard_sent_bytes(),
                    "roofline": self.reshard.roofline()}}


def _per_chip(shape: tuple, itemsize: int, spec: tuple, mesh_shape: dict) -> int:
    parts = int(np.prod([mesh_shape[axis] for axis in spec if axis is not None], dtype=np.int64))
    return int(np.prod(shape, dtype=np.int64)) * itemsize // parts


def compile_decode(source: ModelSource, topology: str, generation: Generation,
                   tensor_parallel: Optional[int] = None, timeout: int = 3600) -> DecodeReport:
    """Build the model on ``meta``, trace its decode step shape-only in the generation layout
    for ``topology`` (``tensor_parallel`` chips per group; default: every chip), compile it."""
    import jax
    import jax.numpy as jnp
    import torch
    import torchax
    from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

    from spmdzero.backends.torchax.programs.decode import DecodeSetup, build_decode
    from spmdzero.backends.torchax.programs.static_cache import cache_shape

    chips = topology_chips(topology)
    tensor = tensor_parallel or chips
    if chips % tensor:
        raise ValueError(f"--tensor-parallel {tensor} does not divide {topology}'s {chips} chips")
    if generation.batch % (chips // tensor):
        raise ValueError(f"--generate batch {generation.batch} does not divide over {chips // tensor} data groups "
                         f"({chips} chips / {tensor} tensor-parallel)")
    model = build_on_meta(source).to(torch.bfloat16).eval()
    if not hasattr(model, "config") or not hasattr(model.config, "num_attention_heads"):
        raise ValueError(f"--generate compiles a transformers causal LM's decode step; {source.name} is not one")
    shape = cache_shape(model, generation.batch, generation.max_length)
    plan = decode_plan(((n, tuple(p.shape)) for n, p in model.named_parameters()), chips // tensor, tensor,
                       kv_heads=shape[1])
    mesh = AbstractMesh((chips // tensor, tensor), (DATA_AXIS, TENSOR_AXIS))

    def sharding(spec):
        return NamedSharding(mesh, PartitionSpec(*spec))

    weights = {n: jax.ShapeDtypeStruct(tuple(p.shape), jnp.bfloat16, sharding=sharding(plan.weights[n]))
               for n, p in model.named_parameters()}
    cache_sharding = sharding(plan.cache)
    layers = model.config.num_hidden_layers
    keys = [jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=cache_sharding) for _ in range(layers)]
    length = jax.ShapeDtypeStruct((), jnp.int32, sharding=sharding(()))
    tokens = jax.ShapeDtypeStruct((generation.batch, 1), jnp.int32, sharding=sharding((DATA_AXIS, None)))
    program = build_decode(DecodeSetup(torchax.default_env(), model, generation.batch, generation.max_length,
                                       cache_sharding))
    with shardy_partitioner(True), jax_private.mosaic_ir_version_at_most(LIBTPU_MOSAIC_IR_VERSION):
        mlir = program.trace(weights, keys, list(keys), length, tokens).lower(lowering_platforms=("tpu",)).as_text()
    result = compile_mlir(mlir, topology, (), timeout, fixed_outputs=True)
    reshard = _compile_reshard(model, plan, sharding, topology, timeout)
    mesh_shape = dict(plan.mesh_shape)
    weight_bytes = sum(_per_chip(tuple(p.shape), 2, plan.weights[n], mesh_shape) for n, p in model.named_parameters())
    cache_bytes = 2 * layers * _per_chip(shape, 2, plan.cache, mesh_shape)
    return DecodeReport(AotReport(gradient_bytes=0, backend="torchax", **result), plan, generation, weight_bytes,
                        cache_bytes, reshard)


def _compile_reshard(model, plan: DecodePlan, sharding, topology: str, timeout: int) -> AotReport:
    """The reshard of the bf16 weights from training's ZeRO-3 layout (each split over every chip,
    ``sharding.plan``) into the generation layout, as one compiled identity: the collectives the
    compiler inserts between the two layouts, which the engine's generation program runs once a
    call (``engine/generation.py``) and training's next step undoes."""
    import jax
    import jax.numpy as jnp

    shapes = [(n, tuple(p.shape)) for n, p in model.named_parameters()]
    chips = int(np.prod(list(plan.mesh_shape.values())))
    zero3 = make_plan(shapes, {FSDP_AXIS: chips}, stage=3)
    every_chip = (DATA_AXIS, TENSOR_AXIS)
    inputs = {n: jax.ShapeDtypeStruct(shape, jnp.bfloat16, sharding=sharding(
        tuple(every_chip if axis is not None else None for axis in zero3[n].param))) for n, shape in shapes}
    outputs = {n: sharding(plan.weights[n]) for n, _ in shapes}
    identity = jax.jit(lambda weights: weights, out_shardings=outputs)
    with shardy_partitioner(True):
        mlir = identity.trace(inputs).lower(lowering_platforms=("tpu",)).as_text()
    return AotReport(gradient_bytes=0, backend="torchax", **compile_mlir(mlir, topology, (), timeout,
                                                                          fixed_outputs=True))
