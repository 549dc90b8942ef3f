"""What a compiled step tells: per-chip memory by kind, the collectives with the bytes each
chip sends against the data-parallel minimum, the roofline (``AotReport``,
``CollectivesReport``), and the side-by-side table of ZeRO stages."""

from __future__ import annotations
from dataclasses import dataclass, field
from typing import Optional
import torch
from spmdzero.tpu.chips import GIB, ChipSpec, chip_spec, topology_chips  # noqa: F401  (topology_chips: public here)


HLO_DTYPES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}


@dataclass
class AotReport:
    """One compiled step on one topology: per-chip memory (or the compiler's out-of-memory
    numbers), collectives against the data-parallel minimum, and a roofline estimate."""

    topology: str
    chips: int
    device_kind: str
    compile_seconds: float
    memory: Optional[dict]
    collectives: dict
    cost: dict
    gradient_bytes: int  # trainable parameters x communication dtype: the all-reduce minimum's P x bytes
    model_flops: Optional[float] = None  # per chip, 6 x params x tokens, when the tokens are known
    out_of_memory: Optional[dict] = None
    stage: Optional[int] = None
    micro_batch: Optional[int] = None
    loops: list = field(default_factory=list)  # trip counts of the program's while loops (scanned layers, rings)
    all_reduces: list = field(default_factory=list)  # the largest all-reduced arrays (tpu.collectives.largest_all_reduces)
    gradient_names: dict = field(default_factory=dict)  # HLO shape of a gradient -> the parameters of that shape
    libtpu_args: Optional[str] = None  # the LIBTPU_INIT_ARGS compiled with (spmdzero.runtime.libtpu_flags); None on CPU
    cost_per_step: Optional[dict] = None  # ``cost`` with loop bodies counted per trip (tpu.compile.per_step_cost)
    cost_per_step_error: Optional[str] = None  # why there is none for a looped program
    backend: Optional[str] = None  # whose step was compiled: "torch_xla" or "torchax" (spmd.backend)
    attention: Optional[str] = None  # which kernel SDPA ran, and why not the flash one (torchax: AttentionChoice)
    experts: Optional[str] = None  # which kernel the experts' grouped matmuls ran (torchax: moe_rows.Split)
    hbm_bytes: Optional[int] = None  # HBM bytes a run moves, from the program's memory spaces (tpu.hbm_traffic)

    @property
    def chip(self) -> ChipSpec:
        return chip_spec(self.topology)

    @property
    def total_bytes(self) -> int:
        """Per chip: arguments and outputs (donated state counted once), temporaries, code;
        from an out-of-memory compile, what the compiler said the program needs."""
        if self.memory is None:
            return int(self.out_of_memory.get("used", 0))
        m = self.memory
        return m["argument"] + m["output"] - m["alias"] + m["temp"] + m["generated_code"]

    @property
    def fits(self) -> bool:
        return self.memory is not None and self.total_bytes <= self.chip.hbm_bytes

    @property
    def over_by(self) -> int:
        """Bytes per chip beyond HBM (0 when it fits)."""
        if self.memory is None:
            return int(self.out_of_memory.get("over_by", 0))
        return max(0, self.total_bytes - self.chip.hbm_bytes)

    @property
    def traffic(self) -> "CollectivesReport":
        return CollectivesReport(self.chips, self.collectives, self.gradient_bytes, self.stage or 0)

    def roofline(self) -> dict:
        """A lower bound on the step time with compute, HBM traffic and ICI traffic fully
        overlapped: max of FLOPs / peak, bytes accessed / HBM bandwidth and bytes sent per
        chip / ICI bandwidth (the compiler's cost analysis and the chip's published figures).
        A program with loops (scanned layers, a windowed einsum's ring) is costed per trip."""
        if not self.cost:
            return {}
        spec = self.chip
        looped = any(trips > 1 for trips in self.loops)
        cost = self.cost_per_step if looped and self.cost_per_step else self.cost
        flops = cost.get("flops", 0.0)
        unscaled = looped and not self.cost_per_step
        if unscaled and self.model_flops is not None:
            # the cost analysis counts a loop body once: 6 x params x tokens is the better floor
            flops = max(flops, self.model_flops)
        parts = {"compute_s": flops / spec.peak_bf16_flops,
                 "hbm_s": cost.get("bytes accessed", 0.0) / spec.hbm_bandwidth,
                 "ici_s": self.traffic.total_traffic / spec.ici_bandwidth}
        step = max(parts.values())
        useful = self.model_flops if self.model_flops is not None else flops
        parts.update(step_s=step, bound=max(parts, key=parts.get).removesuffix("_s"),
                     mfu=useful / (step * spec.peak_bf16_flops) if step and not unscaled else None,
                     mfu_flops="6 x params x tokens" if self.model_flops is not None else "compiled FLOPs")
        if looped and not unscaled:
            parts["note"] = (f"loop bodies counted per trip ({'; '.join(map(str, self.loops))} trips): "
                             "XLA's cost analysis of each body, times its trip count")
        elif unscaled:  # an MFU from a compute floor of 6PT would be 100% by construction
            parts["note"] = ("the program has a while loop (scanned layers, or a windowed einsum's ring of "
                             "collective-permutes) and the compiler's cost analysis counts a loop body once: "
                             "compute is floored at 6 x params x tokens, HBM bytes are under-stated, no MFU"
                             + (f" (per-trip costing failed: {self.cost_per_step_error})"
                                if self.cost_per_step_error else ""))
        return parts

    def verdict(self) -> str:
        if self.fits:
            return "fits"
        return f"DOES NOT FIT by {self.over_by / GIB:.2f} GiB"

    def to_dict(self) -> dict:
        traffic = self.traffic
        out = {"topology": self.topology, "chips": self.chips, "device_kind": self.device_kind,
               "backend": self.backend, "stage": self.stage, "micro_batch": self.micro_batch,
               "compile_seconds": self.compile_seconds,
               "hbm_per_chip": self.chip.hbm_bytes, "memory": self.memory, "total_bytes": self.total_bytes,
               "fits": self.fits, "over_by": self.over_by, "out_of_memory": self.out_of_memory,
               "collectives": self.collectives, "cost": self.cost, "cost_per_step": self.cost_per_step,
               "gradient_bytes": self.gradient_bytes,
               "model_flops": self.model_flops, "loops": self.loops, "roofline": self.roofline(),
               "all_reduced_gradients": self.all_reduced_gradients(), "libtpu_args": self.libtpu_args,
               "attention": self.attention, "experts": self.experts, "hbm_bytes": self.hbm_bytes}
        if self.memory is not None:
            out["traffic"] = {"sent_per_chip": traffic.total_traffic, "minimum": traffic.minimum_traffic,
                              "ratio": traffic.ratio}
        return out

    def all_reduced_gradients(self) -> list[dict]:
        """At ZeRO-2, the large all-reduces shaped like a gradient: gradients the compiler
        all-reduced in full instead of reduce-scattering (ZeRO-0/1 all-reduce by design)."""
        if self.stage is None or self.stage < 2:
            return []
        return [{**r, "parameters": self.gradient_names[r["shape"]]} for r in self.all_reduces
                if r["shape"] in self.gradient_names]

    def summary(self) -> str:
        head = f"{self.topology} ({self.chips} x {self.device_kind}), " + (
            f"the {self.backend} backend's step, " if self.backend else "") + f"ZeRO stage {self.stage}"
        if self.micro_batch is not None:
            head += f", micro-batch {self.micro_batch}/chip"
        lines = [f"{head}: compiled in {self.compile_seconds:.1f} s"]
        if self.libtpu_args is not None:
            lines.append(f"  libtpu flags: {self.libtpu_args or '(none)'}")
        if self.attention is not None:
            lines.append(f"  attention: {self.attention}")
        if self.experts is not None:
            lines.append(f"  experts: {self.experts}")
        if self.memory is None:
            lines.append(f"  the compiler ran out of HBM: needs {gib_text(self.total_bytes)} per chip of "
                         f"{gib_text(self.out_of_memory.get('capacity', self.chip.hbm_bytes))} usable: {self.verdict()}")
            lines.append(f"  ({self.out_of_memory['message'][:300]})")
            largest = self.out_of_memory.get("largest_allocations") or []
            if largest:
                lines.append("  its largest allocations at the peak (libtpu's list):")
            for a in largest:
                where = ", ".join(x for x in (a["op"][-80:] or a["label"], a["source"], a["kind"]) if x)
                lines.append(f"    {gib_text(a['bytes']):>10}  {a['shape']:<28} {where}")
            return "\n".join(lines)
        m = self.memory
        lines += [f"  per-chip HBM: arguments {_mb(m['argument'])}, outputs {_mb(m['output'])}, "
                  f"aliased {_mb(m['alias'])}, temporaries {_mb(m['temp'])}, code {_mb(m['generated_code'])}",
                  f"  total {gib_text(self.total_bytes)} of {gib_text(self.chip.hbm_bytes)}: {self.verdict()}"]
        traffic = self.traffic
        for kind, row in sorted(self.collectives.items()):
            lines.append(f"  {kind:<19}{row['count']:>5} ops {row['tensors']:>5} tensors {_mb(row['bytes']):>14}"
                         f"  sends {_mb(traffic.traffic(kind))}/chip")
        if traffic.gradient_bytes:
            lines.append(f"  sent per chip {_mb(traffic.total_traffic)} = {traffic.ratio:.2f} x the "
                         f"{'FSDP' if traffic.stage >= 3 else 'data-parallel'} minimum {traffic.passes}(N-1)/N x P x "
                         f"bytes ({_mb(traffic.minimum_traffic)})")
        full = self.all_reduced_gradients()
        if full:
            listed = "; ".join(f"{row['shape']} x{row['count']} ({', '.join(row['parameters'][:2])}"
                               f"{', ...' if len(row['parameters']) > 2 else ''})" for row in full[:3])
            lines.append(f"  all-reduced in full, not reduce-scattered: {listed}. libtpu 0.0.21 keeps a "
                         "reduce-scatter only under conditions docs/tpu.md lists (among them, shards of whole "
                         "TPU tiles)")
        r = self.roofline()
        if r:
            lines.append(f"  roofline estimate (perfect overlap, published peaks): step >= {r['step_s'] * 1e3:.1f} ms "
                         f"({r['bound']}-bound: compute {r['compute_s'] * 1e3:.1f} ms, HBM {r['hbm_s'] * 1e3:.1f} ms, "
                         f"ICI {r['ici_s'] * 1e3:.1f} ms)" + (f", MFU <= {r['mfu']:.0%} ({r['mfu_flops']})"
                                                             if r["mfu"] is not None else ""))
            if "note" in r:
                lines.append(f"  ({r['note']})")
        return "\n".join(lines)


def _mb(n: float) -> str:
    return f"{n / 2**20:,.2f} MiB"


def gib_text(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


@dataclass(frozen=True)
class CollectivesReport:
    """Collectives of a compiled training step, with the bytes each device sends under a ring
    algorithm, against the data-parallel minimum 2(N-1)/N x (gradient bytes): a reduce-scatter
    and an all-gather of the update's result, or an all-reduce. At ZeRO-3 the minimum is FSDP's
    3(N-1)/N x (gradient bytes): the parameters gathered for the forward and again for the
    backward, the gradients reduce-scattered (the update's sharded result is not gathered)."""

    devices: int
    collectives: dict
    gradient_bytes: int
    stage: int = 0

    def traffic(self, kind: str) -> float:
        """Bytes sent per device: all-reduce 2(N-1)/N x size; reduce-scatter and all-gather
        (N-1)/N x the full tensor; anything else its size. N is each op's replica group
        (``sent``, from the compiled program) where known, else the mesh."""
        n, row = self.devices, self.collectives[kind]
        if row.get("sent") is not None:
            return row["sent"]
        if kind.startswith("reduce-scatter"):
            full = row["bytes"] if "CPU" in kind else row["bytes"] * n  # CPU all-reduce output is full-size
            return (n - 1) / n * full
        if kind == "all-gather":
            return (n - 1) / n * row["bytes"]
        if kind == "all-reduce":
            return 2 * (n - 1) / n * row["bytes"]
        return row["bytes"]

    @property
    def total_traffic(self) -> float:
        return sum(self.traffic(k) for k in self.collectives)

    @property
    def passes(self) -> int:
        """The minimum's passes over the gradient bytes: 3 at ZeRO-3, else 2."""
        return 3 if self.stage >= 3 else 2

    @property
    def minimum_traffic(self) -> float:
        return self.passes * (self.devices - 1) / self.devices * self.gradient_bytes

    @property
    def ratio(self) -> float:
        return self.total_traffic / self.minimum_traffic if self.minimum_traffic else 0.0

    def __str__(self) -> str:
        lines = [f"collectives of one training step on {self.devices} devices"]
        for kind, row in sorted(self.collectives.items()):
            lines.append(f"  {kind:<40}{row['count']:>4} ops {row['tensors']:>5} tensors "
                         f"{_mb(row['bytes']):>12}  sends {_mb(self.traffic(kind))}/device")
        lines.append(f"  total sent per device {_mb(self.total_traffic)}; minimum {self.passes}(N-1)/N x gradients "
                     f"{_mb(self.minimum_traffic)} (ratio {self.ratio:.2f})")
        return "\n".join(lines)


def stages_table(reports: list[AotReport]) -> str:
    head = f"{'':<28}" + "".join(f"{'stage ' + str(r.stage):>18}" for r in reports)
    rows = [("arguments (model states)", lambda r: _mb(r.memory["argument"]) if r.memory else "-"),
            ("outputs", lambda r: _mb(r.memory["output"]) if r.memory else "-"),
            ("aliased (donated state)", lambda r: _mb(r.memory["alias"]) if r.memory else "-"),
            ("temporaries", lambda r: _mb(r.memory["temp"]) if r.memory else "-"),
            ("code", lambda r: _mb(r.memory["generated_code"]) if r.memory else "-"),
            ("total per chip", lambda r: _mb(r.total_bytes)),
            ("fits in HBM", lambda r: "yes" if r.fits else f"NO (+{r.over_by / GIB:.2f} GiB)"),
            ("traffic / minimum", lambda r: f"{r.traffic.ratio:.2f}" if r.memory else "-"),
            ("roofline step (ms)", lambda r: f"{r.roofline()['step_s'] * 1e3:.1f}" if r.roofline() else "-"),
            ("roofline MFU", lambda r: f"{r.roofline()['mfu']:.0%}" if r.roofline().get('mfu') is not None else "-")]
    kinds = sorted({k for r in reports for k in r.collectives})
    rows += [(f"{k} bytes", lambda r, k=k: _mb(r.collectives.get(k, {}).get("bytes", 0))) for k in kinds]
    lines = [head] + [f"{name:<28}" + "".join(f"{fn(r):>18}" for r in reports) for name, fn in rows]
    return "\n".join(lines)
