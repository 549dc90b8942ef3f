"""Reports from live tensors: each tensor's sharding, per-device shapes and bytes, the model
states' bytes per device against ZeRO's accounting (``model_state_bytes``), and the
per-parameter ``sharding_report`` that prints as a table and renders in Jupyter."""

from __future__ import annotations
import math
import re
from dataclasses import dataclass
import torch
from spmdzero.sharding.mesh import fsdp_size
from spmdzero.observe.reported_engine import ReportedEngine


_DEVICES = re.compile(r"devices=\[([\d,]+)\]")


def sharding_spec(t) -> str:
    """The HLO sharding string of a live tensor (``{devices=[8,1]0,1,...}``): torch_xla's for an
    XLA tensor ('' when it has none), JAX's for a JAX array or the torchax tensor over one (the
    torchax backend's outputs, ``master_weights()``, ``optimizer_states()``)."""
    array = getattr(t, "_elem", t)  # a torchax tensor's JAX array
    if not isinstance(array, torch.Tensor) and hasattr(array, "sharding"):
        return str(array.sharding._to_xla_hlo_sharding(array.ndim))
    import torch_xla

    return torch_xla._XLAC._get_xla_sharding_spec(t)


def tile_assignment(t):
    """(tiles per dim, device ids laid out on that tile grid) of a live tensor's (or JAX
    array's) sharding; a replicated tensor is one tile held by every device (ids None)."""
    import numpy as np

    array = getattr(t, "_elem", t)
    if not isinstance(array, torch.Tensor) and hasattr(array, "sharding"):
        return _jax_tile_assignment(array)
    spec, ndim = sharding_spec(t), len(t.shape)
    match = re.search(r"devices=\[([\d,]+)\]([\d,]+)", spec or "")
    if match is None:
        return (1,) * ndim, None
    dims = [int(x) for x in match.group(1).split(",")]
    ids = np.array([int(x) for x in match.group(2).split(",")]).reshape(dims)
    return tuple(dims[:ndim]), ids


def _jax_tile_assignment(array):
    """``tile_assignment`` of a JAX array, from the devices' index ranges (JAX prints its
    shardings in the compact iota form, which names no device ids)."""
    import numpy as np

    ndim = array.ndim
    index_map = array.sharding.devices_indices_map(tuple(array.shape))
    starts = [sorted({index[d].start or 0 for index in index_map.values()}) for d in range(ndim)]
    tiles = tuple(len(s) for s in starts)
    if all(count == 1 for count in tiles):
        return tiles, None
    holders: dict[tuple, list[int]] = {}
    for device, index in index_map.items():
        holders.setdefault(tuple(starts[d].index(index[d].start or 0) for d in range(ndim)), []).append(device.id)
    replicas = len(next(iter(holders.values())))
    ids = np.empty(tiles + ((replicas,) if replicas > 1 else ()), dtype=int)
    for tile, devices in holders.items():
        ids[tile] = sorted(devices) if replicas > 1 else devices[0]
    return tiles, ids


def per_device_shape(shape, spec: str) -> tuple[int, ...]:
    """Shape of one device's shard, from an HLO sharding string such as
    ``{devices=[8,1]0,...,7}`` or ``{devices=[4,1,2]... last_tile_dim_replicate}``.
    Tiles beyond the tensor's rank are replication; uneven tiles are padded (rounded up)."""
    match = _DEVICES.search(spec or "")
    if match is None:  # '', '{replicated}', '{maximal ...}': the whole tensor on a device
        return tuple(shape)
    tiles = [int(x) for x in match.group(1).split(",")][: len(shape)]
    return tuple(-(-size // tile) for size, tile in zip(shape, tiles))


def per_device_bytes(t: torch.Tensor) -> int:
    return math.prod(per_device_shape(tuple(t.shape), sharding_spec(t))) * t.element_size()


@dataclass(frozen=True)
class ModelStateBytes:
    """Per-device bytes of model states (ZeRO's accounting: params, grads, optimizer states)."""

    params: int
    grads: int
    optimizer_states: int
    master_weights: int = 0  # fp32 copies under mixed precision; ZeRO counts them as optimizer state

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer_states + self.master_weights


def model_state_bytes(engine: ReportedEngine) -> ModelStateBytes:
    """Read from the live tensors (the sharding report's totals): parameters, ZeRO gradient
    buffers, optimizer state and fp32 master weights."""
    totals = sharding_report(engine).totals()
    device = {k: v["device"] for k, v in totals.items()}
    return ModelStateBytes(device.get("params", 0), device.get("grads", 0), device.get("optimizer states", 0),
                           device.get("master weights", 0))


def _layout(spec: str) -> str:
    """'{devices=[8,1]0,...}' -> 'tiled 8x1'; replicated or unsharded -> 'replicated'."""
    match = _DEVICES.search(spec or "")
    if match is None:
        return "replicated"
    tiles = match.group(1).replace(",", "x")
    return f"tiled {tiles}" + (" (partly replicated)" if "last_tile_dim_replicate" in spec else "")


@dataclass(frozen=True)
class TensorEntry:
    parameter: str
    role: str  # param, grad, master, or the optimizer state's key
    shape: tuple
    dtype: str
    layout: str
    device_bytes: int
    global_bytes: int


@dataclass(frozen=True)
class ShardingReport:
    """What each device holds, read from the live tensors' shardings."""

    stage: int
    devices: int
    fsdp: int
    entries: tuple

    CATEGORY = {"param": "params", "grad": "grads", "master": "master weights"}

    def totals(self) -> dict[str, dict[str, int]]:
        """Per category: bytes per device now, and what stage 0 (everything replicated) holds."""
        out: dict[str, dict[str, int]] = {}
        for e in self.entries:
            row = out.setdefault(self.CATEGORY.get(e.role, "optimizer states"), {"device": 0, "stage0": 0})
            row["device"] += e.device_bytes
            row["stage0"] += e.global_bytes
        out["total"] = {k: sum(r[k] for r in out.values()) for k in ("device", "stage0")}
        return out

    def zero_accounting(self) -> dict[str, float]:
        """ZeRO's analytic per-device bytes for this stage, from the same tensors' sizes."""
        totals, n = self.totals(), self.fsdp
        divisor = {"params": n if self.stage >= 3 else 1, "grads": n if self.stage >= 2 else 1,
                   "optimizer states": n if self.stage >= 1 else 1, "master weights": n if self.stage >= 1 else 1}
        analytic = {k: totals[k]["stage0"] / divisor[k] for k in divisor if k in totals}
        analytic["total"] = sum(analytic.values())
        return analytic

    def to_dict(self) -> dict:
        return {"stage": self.stage, "devices": self.devices, "fsdp": self.fsdp,
                "tensors": [e.__dict__ for e in self.entries], "totals": self.totals(),
                "zero_accounting": self.zero_accounting()}

    def _rows(self):
        yield ("parameter", "role", "shape", "dtype", "layout", "bytes/device")
        for e in self.entries:
            yield (e.parameter, e.role, "x".join(map(str, e.shape)) or "scalar", e.dtype, e.layout,
                   f"{e.device_bytes:,}")

    def _total_rows(self):
        analytic = self.zero_accounting()
        yield ("category", "bytes/device", "stage 0", "ZeRO accounting")
        for name, row in self.totals().items():
            yield (name, f"{row['device']:,}", f"{row['stage0']:,}", f"{analytic.get(name, 0):,.0f}")

    def __str__(self) -> str:
        def table(rows):
            rows = list(rows)
            widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
            return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)

        head = f"ZeRO stage {self.stage} on {self.devices} devices (fsdp={self.fsdp}), from live shardings"
        return f"{head}\n{table(self._rows())}\n\n{table(self._total_rows())}"

    def __rich__(self):
        """A rich renderable (``rich.print(report)``), when the rich package is installed."""
        from rich.console import Group
        from rich.table import Table

        tables = []
        for rows, title in ((self._rows(), f"ZeRO stage {self.stage} on {self.devices} devices (fsdp={self.fsdp})"),
                            (self._total_rows(), "per-device totals")):
            rows = list(rows)
            table = Table(*rows[0], title=title)
            for row in rows[1:]:
                table.add_row(*row)
            tables.append(table)
        return Group(*tables)

    def _repr_html_(self) -> str:
        import html

        def table(rows):
            rows = list(rows)
            head = "".join(f"<th>{html.escape(c)}</th>" for c in rows[0])
            body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows[1:])
            return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"

        return (f"<p><b>ZeRO stage {self.stage}</b> on {self.devices} devices (fsdp={self.fsdp})</p>"
                f"{table(self._rows())}<br>{table(self._total_rows())}")


def _planned_entry(parameter: str, role: str, shape: tuple, dtype: torch.dtype, spec: tuple,
                   mesh_shape: dict[str, int]) -> TensorEntry:
    """The entry a tensor of ``shape`` laid out by a plan's ``spec`` would have, described as
    ``_layout`` describes a live tensor's sharding."""
    tiles = [math.prod(mesh_shape[a] for a in (s if isinstance(s, tuple) else (s,))) if s else 1 for s in spec]
    repeat = math.prod(mesh_shape.values()) // math.prod(tiles)
    if all(t == 1 for t in tiles):
        layout = "replicated"
    else:
        layout = "tiled " + "x".join(map(str, tiles + ([repeat] if repeat > 1 else [])))
        layout += " (partly replicated)" if repeat > 1 else ""
    itemsize = torch.empty((), dtype=dtype).element_size()
    device = math.prod(-(-d // t) for d, t in zip(shape, tiles)) * itemsize
    return TensorEntry(parameter, role, shape, str(dtype).removeprefix("torch."), layout, device,
                       math.prod(shape) * itemsize)


def sharding_report(engine: ReportedEngine) -> ShardingReport:
    """Every parameter's tensors, what each device holds of them, read from the live layouts."""
    slots = getattr(engine, "trained_parameters", None)
    if slots is None:  # the torchax backend: the state lives in JAX arrays
        return _jax_sharding_report(engine)
    names = {s.name: s for s in slots()}
    entries = []

    def add(parameter: str, role: str, t: torch.Tensor) -> None:
        entries.append(TensorEntry(parameter, role, tuple(t.shape), str(t.dtype).removeprefix("torch."),
                                   _layout(sharding_spec(t)), per_device_bytes(t), t.numel() * t.element_size()))

    shape = dict(zip(engine.mesh.axis_names, engine.mesh.mesh_shape))
    for name, p in engine.module.named_parameters():
        add(name, "param", p)
        slot = names.get(name)
        if slot is None:
            continue
        if slot.grad is not None:
            add(name, "grad", slot.grad)
        else:  # between steps there is no gradient: report the one each step holds, as the plan lays it out
            entries.append(_planned_entry(name, "grad", tuple(p.shape), engine.precision.grad_accum_dtype,
                                          engine.plan[name].grad, shape))
        if slot.target is not slot.param:
            add(name, "master", slot.target)
        if engine.optimizer is not None:
            for key, value in engine.optimizer.state.get(slot.target, {}).items():
                if isinstance(value, torch.Tensor) and value.device.type == "xla":
                    add(name, key, value)
    return ShardingReport(engine.plan.stage, int(engine.mesh.size()), fsdp_size(shape), tuple(entries))


def _jax_sharding_report(engine: ReportedEngine) -> ShardingReport:
    """``sharding_report`` of an engine whose state is JAX arrays (``engine.state_tensors()``):
    layouts from each array's sharding, bytes per device from its first shard. Between steps
    there is no gradient: each step's is reported as the plan lays it out, as above."""
    shape = dict(zip(engine.mesh.axis_names, engine.mesh.devices.shape))
    state = engine.state_tensors()
    entries = []

    def add(parameter: str, role: str, array) -> None:
        spec = tuple(array.sharding.spec)
        spec += (None,) * (array.ndim - len(spec))
        planned = _planned_entry(parameter, role, tuple(array.shape), getattr(torch, str(array.dtype)), spec, shape)
        entries.append(TensorEntry(planned.parameter, role, planned.shape, planned.dtype, planned.layout,
                                   array.addressable_shards[0].data.nbytes, planned.global_bytes))

    trained, accumulated = set(engine.optimized_names().values()), engine.accumulated_gradients()
    for name, _ in engine.module.named_parameters():
        if f"model.{name}" not in state:
            continue
        add(name, "param", state[f"model.{name}"][0])
        if name not in trained:
            continue  # frozen: a constant
        if name in accumulated:
            add(name, "grad", accumulated[name])
        else:
            entries.append(_planned_entry(name, "grad", tuple(state[f"model.{name}"][0].shape),
                                          engine.precision.grad_accum_dtype, engine.plan[name].grad, shape))
        if f"master.{name}" in state:
            add(name, "master", state[f"master.{name}"][0])
        prefix = f"optim.{name}."
        for key, (value, _) in state.items():
            if key.startswith(prefix):
                add(name, key[len(prefix):], value)
    return ShardingReport(engine.plan.stage, int(engine.mesh.devices.size), fsdp_size(shape), tuple(entries))


def live_device_bytes(exclude=(), device=None) -> int:
    """Bytes that the live JAX arrays hold on one device (the first by default): every buffer
    JAX still holds there, whoever keeps it (the engine, an output the script kept, an array
    waiting to be released), not only the model states; ``exclude``: arrays not to count (those
    live before an engine was built). Each buffer once: a shard read as an array of its own
    (``addressable_shards``, which JAX keeps on the array) is the same memory. What the torchax
    backend's memory is checked with against ZeRO's accounting (tests/test_torchax_memory.py,
    benchmarks/memory.py)."""
    import jax

    device = device or jax.devices()[0]

    def buffers(arrays):
        for a in arrays:
            if not a.is_deleted() and device in a.sharding.device_set:
                for shard in a.addressable_shards:
                    if shard.device == device:
                        yield shard.data.unsafe_buffer_pointer(), shard.data.nbytes

    excluded = list(exclude)
    seen = {pointer for pointer, _ in buffers(excluded)}
    skip = {id(a) for a in excluded}
    total = 0
    for pointer, size in buffers([a for a in jax.live_arrays() if id(a) not in skip]):
        if pointer not in seen:
            seen.add(pointer)
            total += size
    return total
