"""``engine.load_checkpoint``: a checkpoint checked against the engine, read into staging
tensors laid out like the live ones, and only then copied in. Checkpoints as a whole: sharded,
atomic, exactly resumable, elastic, and safe to load.

Layout of ``save_dir``::

    latest                 the newest tag, written last
    <tag>/state/           torch.distributed.checkpoint: every device tensor of the training
                           state (``engine.state_tensors()``), each host writing its own shards
    <tag>/client_state.pt  the user's ``client_state`` (pickled: the one file that may hold
                           arbitrary objects, loaded as plain data unless trusted)
    <tag>/meta.json        host state as data: counters, schedule, optimizer hyperparameters,
                           RNG, the config, each tensor's shape and dtype. Written last: a
                           directory with it is complete.

Loading never unpickles anything but data: ``meta.json`` is JSON, DCP's shards are read
with ``weights_only=True`` and its ``.metadata`` with an allowlist (``safe_pickle``), and
``client_state.pt`` with ``weights_only=True`` unless the caller trusts it.

A save writes into ``save_dir/.saving.<tag>`` and renames it to ``<tag>`` once complete,
then replaces ``latest``. Re-saving an existing tag moves the old one to ``.replaced.<tag>``
first; a crash between those two renames is repaired by the next save (roll forward to the
complete new copy, else back to the old one), and a load in between reads whichever copy
is complete. Saves into one directory take turns, and a save waits for loads from it
(``checkpoint_dir.saving``, ``checkpoint_dir.reading``). A load first checks the checkpoint against the engine (keys, shapes, optimizer
type), reads into staging tensors laid out like the live ones, and only then copies: a bad
checkpoint raises without touching the model. Loading onto another device count or mesh
works because torch.distributed.checkpoint reads whatever chunks each target shard needs."""

from __future__ import annotations
import os
import random
import warnings
from typing import Optional
import numpy as np
import torch
from spmdzero.io import restack
from spmdzero.io.restack import stacking_mismatch
from spmdzero.io.checkpoint_format import (CheckpointError, LATEST_FILE, META_FILE, torch_dtype_of, no_dist, quiet_dcp,
                                           checkpointed, non_persistent_buffers, tensor_index)
from spmdzero.io.checkpoint_dir import reading
from spmdzero.io.read import (dcp_failure, locate, open_state, read_client_state, read_host_tensor, read_meta,
                              resolve_tag)
from spmdzero.io.deepspeed_import import is_deepspeed_checkpoint, read_deepspeed_checkpoint
from spmdzero.io.checkpointed_engine import CheckpointedEngine



def load_checkpoint(engine: CheckpointedEngine, load_dir: str, tag: Optional[str] = None, load_module_strict: bool = True,
                    load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                    load_module_only: bool = False, trust_client_state: Optional[bool] = None):
    """DeepSpeed's ``load_checkpoint``: returns ``(load_path, client_state)``, or
    ``(None, None)`` with a warning when ``load_dir`` has no ``latest`` and no tag is given.
    ``trust_client_state`` (default: the config's ``spmd.trust_client_state``) allows a
    ``client_state`` of arbitrary objects to be unpickled. The load shares the directory's
    lock with other loads: a save into it waits, so no re-save moves the copy being read."""
    if trust_client_state is None:
        trust_client_state = engine.validated_config.spmd.trust_client_state
    with reading(load_dir):  # a save into load_dir waits: it cannot move the copy being read
        tag = resolve_tag(load_dir, tag)
        if tag is None:
            warnings.warn(f"Unable to find latest file at {os.path.join(load_dir, LATEST_FILE)}, if trying to load "
                          "latest checkpoint please ensure this file exists or pass an explicit checkpoint tag when "
                          "loading a checkpoint.", stacklevel=2)
            return None, None
        path = locate(load_dir, tag)
        full_state = load_optimizer_states and not load_module_only

        scheduler = load_lr_scheduler_states and not load_module_only
        # A torch optimizer creates its state at its first step; one that has not stepped gets
        # placeholder state to load into (_check_placeholders: every value is loaded), taken back
        # if the load fails or the checkpoint has none for a tensor (saved before its first step).
        created = engine.placeholder_optimizer_state() if full_state else []
        try:
            if is_deepspeed_checkpoint(path):
                tensors, meta = read_deepspeed_checkpoint(path)
                if full_state:
                    _host_values_from_tensors(engine, meta, tensors.get)
                _check_optimizer(engine, meta, path, full_state)
                restore = _host_state_restorer(engine, meta, path, full_state, scheduler, load_module_only)
                tensors.update(_loss_scale_tensors(engine, meta.pop("loss_scaler")))
                index = tensor_index(tensors)
                selected, unsaved = _select(engine, index, load_module_strict, full_state, meta)
                _check_placeholders(engine, created, unsaved, meta, path)
                _commit(engine, selected, _stage(engine, selected, index, tensors))
                client_state = meta["client_state"]
            else:
                meta = read_meta(path, trust_client_state)
                from_host = {}
                if full_state:
                    _host_values_from_tensors(engine, meta, _saved_tensors(path, meta["tensors"]))
                    from_host = _tensors_from_host_values(engine, meta)
                _check_optimizer(engine, meta, path, full_state)
                restore = _host_state_restorer(engine, meta, os.path.join(path, META_FILE), full_state, scheduler,
                                               load_module_only)
                index = {**meta["tensors"], **tensor_index(from_host)}
                selected, unsaved = _select(engine, index, load_module_strict, full_state, meta)
                _check_placeholders(engine, created, unsaved, meta, os.path.join(path, META_FILE))
                client_state = read_client_state(path, meta, trust_client_state)
                _load_tensors(engine, path, selected, index, from_host)
        except BaseException:
            engine.drop_optimizer_state(created)
            raise
        device_seed = restore()
        engine.drop_optimizer_state(unsaved)  # as torch's load_state_dict: no saved state, none live
        engine.loaded(new_window=not load_module_only)  # module_only restores no counters; drops pending gradients
        if device_seed is not None:  # after loaded(): its sync would advance the device's seed one step
            seed, position = device_seed
            engine.state_shards().set_rng_state(seed)
            if isinstance(position, int):
                engine.state_shards().set_rng_position(position)
        return path, client_state


# Names of one update rule (torch's, spmdzero's and DeepSpeed's classes and config types).
_OPTIMIZER_FAMILIES = {"adam": "adam", "adamw": "adam", "fusedadam": "adam", "deepspeedcpuadam": "adam",
                       "lamb": "lamb", "fusedlamb": "lamb", "lion": "lion", "fusedlion": "lion",
                       "adagrad": "adagrad", "deepspeedcpuadagrad": "adagrad"}


def _check_optimizer(engine: CheckpointedEngine, meta: dict, path: str, full_state: bool) -> None:
    """Moments of one optimizer are not another's: refuse to load them across types, or
    into another number of param groups or other parameters."""
    saved = (meta.get("optimizer") or {}).get("type")
    live = type(engine.basic_optimizer).__name__ if engine.optimizer is not None else None
    if live is None or not full_state:
        return
    groups, live_groups = meta["optimizer"]["param_groups"], engine.basic_optimizer.param_groups
    if len(groups) != len(live_groups):
        raise CheckpointError(f"checkpoint {path!r} has {len(groups)} optimizer param groups, this engine's "
                              f"optimizer {len(live_groups)}; pass load_optimizer_states=False to load the module only")
    live_stacked, saved_stacked = _layer_names(engine, meta)
    known = set(engine.optimized_names().values()) | {layer for layers in live_stacked.values() for layer in layers}
    known |= {name for name, layers in saved_stacked.items() if set(layers) <= known}
    unknown = sorted(set(meta["optimizer"]["host_state"]) - known)
    if unknown:
        raise CheckpointError(f"checkpoint {path!r} has optimizer state for {unknown}, which this engine does not "
                              "optimize; pass load_optimizer_states=False to load the module only")
    if saved is None:
        return
    if _OPTIMIZER_FAMILIES.get(saved.lower(), saved.lower()) != _OPTIMIZER_FAMILIES.get(live.lower(), live.lower()):
        raise CheckpointError(f"checkpoint {path!r} holds the state of optimizer {saved}, this engine's optimizer is "
                              f"{live}; pass load_optimizer_states=False to load the module only")


def _loss_scale_tensors(engine: CheckpointedEngine, fields: dict) -> dict:
    """An imported DeepSpeed loss scaler as spmdzero's ``loss_scale.*`` state, when both
    sides scale the loss."""
    if not engine.scales_loss or fields.get("iteration") is None:
        return {}
    return {f"loss_scale.{k}": torch.tensor(float(v)) for k, v in fields.items()}


def _layer_names(engine: CheckpointedEngine, meta: dict) -> tuple[dict, dict]:
    """The engine's stacked names and the checkpoint's, each with its per-layer names
    (``restack.layer_names``); the layer counts come from the parameters' shapes."""
    # a ZeRO-3 placeholder's shape is its ds_shape (train/zero_params.py)
    live_shapes = {name: tuple(getattr(p, "ds_shape", p.shape)) for name, p in engine.module.named_parameters()}
    live = engine.stacked_layers()
    saved = meta.get("stacked_layers") or {}
    tensors = meta.get("tensors") or {}
    saved = {name: stack for name, stack in saved.items() if f"model.{name}" in tensors}
    return (restack.layer_names(live, {name: live_shapes[name][0] for name in live}),
            restack.layer_names(saved, {name: tuple(tensors[f"model.{name}"][0])[0] for name in saved}))


def _select(engine: CheckpointedEngine, saved: dict, strict: bool, full_state: bool, meta: dict) -> tuple[dict, list]:
    """{live key: (restack.Source, live tensor, spec)} to load, after checking them against
    the checkpoint, and the optimized tensors whose optimizer state the checkpoint does not
    have and is to be dropped (a torch optimizer's state saved before its first step). A
    master weight missing on one side is taken from the other: a bf16 run's fp32 masters
    become an fp32 run's params, an fp32 run's params a bf16 run's masters. A checkpoint
    saved with ``spmd.scan_layers='stacked'`` and another setting loaded: each tensor from
    its layers or its stack (``spmdzero.io.restack``)."""
    live = checkpointed(engine)
    saved_shapes = {k: tuple(v[0]) for k, v in saved.items()}
    live_shapes = {k: tuple(t.shape) for k, (t, _) in live.items()}
    # a param's master and a master's param: where the two precisions meet
    wanted = {**live_shapes, **{f"master.{k[6:]}": v for k, v in live_shapes.items() if k.startswith("model.")},
              **{f"model.{k[7:]}": v for k, v in live_shapes.items() if k.startswith("master.")}}
    aliases = restack.sources(wanted, saved_shapes, *_layer_names(engine, {**meta, "tensors": saved}))

    def found(key: str) -> Optional[restack.Source]:
        return restack.Source((key,)) if key in saved else aliases.get(key)

    module_keys = {k for k in live if k.startswith(("model.", "buffer."))}
    # an older checkpoint may hold a buffer that the model now computes (non-persistent): not loaded
    computed = {f"buffer.{name}" for name in non_persistent_buffers(engine.module)}
    saved_module = {k for k in saved if k.startswith(("model.", "buffer.")) and k not in computed}
    consumed = {k for key in module_keys if (src := found(key)) for k in src.keys}
    missing = sorted(k for k in module_keys if found(k) is None)
    unexpected = sorted(k for k in saved_module - module_keys if k not in consumed)
    if strict and (missing or unexpected):
        raise CheckpointError("checkpoint does not match the model (load_module_strict=True): "
                              f"missing keys {missing}, unexpected keys {unexpected}"
                              + stacking_mismatch(missing, unexpected))
    source = {}
    for key in module_keys:
        src = (found(f"master.{key[6:]}") if key.startswith("model.") else None) or found(key)
        if src is not None:
            source[key] = src
    unsaved = []
    if full_state:
        state_keys = {k for k in live if k not in module_keys}
        absent = []
        for key in state_keys:
            fallback = f"model.{key[7:]}" if key.startswith("master.") else key
            src = found(key) or found(fallback)
            if src is None:
                absent.append(key)
            else:
                source[key] = src
        if absent and engine.lazy_optimizer_state:
            # torch's state is created by the first step: a tensor the checkpoint holds none of
            # was saved before its first step, and has none after the load either
            for target, name in engine.optimized_names().items():
                prefix = f"optim.{name}."
                keys = {k for k in live if k.startswith(prefix) and "." not in k[len(prefix):]}
                if keys and keys <= set(absent):
                    unsaved.append(target)
                    absent = [k for k in absent if k not in keys]
        if absent:
            raise CheckpointError(f"checkpoint has no optimizer/precision state for {sorted(absent)} (saved with "
                                  "another optimizer or precision?); pass load_optimizer_states=False to load the "
                                  "module only")
    else:  # the fp32 masters follow the loaded module (DeepSpeed refreshes them from it), else the
        # next step would update the old masters and write them over the loaded parameters
        for key in live:
            if key.startswith("master.") and f"model.{key[7:]}" in source:
                source[key] = source[f"model.{key[7:]}"]
    mismatched = [f"{k}: checkpoint {src.shape(saved_shapes)} vs model {live_shapes[k]}"
                  for k, src in sorted(source.items()) if src.shape(saved_shapes) != live_shapes[k]]
    if mismatched:
        raise CheckpointError("checkpoint shapes do not match the model: " + "; ".join(mismatched))
    return {key: (src, *live[key]) for key, src in source.items()}, unsaved


def _kept_on_host(value) -> bool:
    """An optimizer state value torch keeps on the host (Adam's step count), not on the devices."""
    return not (isinstance(value, torch.Tensor) and value.device.type == "xla")


def _saved_tensors(path: str, index: dict):
    """``key -> the saved tensor on the host, or None``, DCP's reader opened at the first read."""
    reader = []

    def read(key: str) -> Optional[torch.Tensor]:
        if key not in index:
            return None
        if not reader:
            reader.append(open_state(path))
        return read_host_tensor(path, index, key, reader[0])

    return read


def _host_values_from_tensors(engine: CheckpointedEngine, meta: dict, saved_tensor) -> None:
    """A state torch keeps on the host (AdamW's step count, for a torch optimizer given to
    ``initialize``: accelerate's scripts) that the checkpoint holds as a tensor instead
    (DeepSpeed's files; a checkpoint of spmdzero's own AdamW, which counts on the devices)
    becomes host state, in the live value's type. ``saved_tensor(key)``: the saved tensor or None."""
    if engine.optimizer is None:
        return
    host = meta["optimizer"]["host_state"]
    for target, name in engine.optimized_names().items():
        for key, live in engine.optimizer.state.get(target, {}).items():
            if not _kept_on_host(live) or key in host.get(name, {}):
                continue
            saved = saved_tensor(f"optim.{name}.{key}")
            if saved is None:
                continue
            value = saved.to(live.dtype).clone() if isinstance(live, torch.Tensor) else type(live)(saved.item())
            host.setdefault(name, {})[key] = value


def _tensors_from_host_values(engine: CheckpointedEngine, meta: dict) -> dict:
    """The other way round from ``_host_values_from_tensors``: a value the checkpoint's torch
    optimizer kept on the host (AdamW's step count: the HF Trainer's own optimizer) that this
    engine keeps on the devices (the config's AdamW), as ``{key: host tensor}`` in the live
    tensor's shape and dtype, taken out of the host state (DeepSpeed loads such a checkpoint into
    its config optimizer too)."""
    if engine.optimizer is None:
        return {}
    host, saved = meta["optimizer"]["host_state"], meta.get("tensors") or {}
    live = checkpointed(engine)
    found = {}
    for key, (shape, dtype) in tensor_index({k: t for k, (t, _) in live.items()}).items():
        name, _, field = key.removeprefix("optim.").rpartition(".")
        if not key.startswith("optim.") or key in saved or not isinstance(host.get(name), dict) \
                or field not in host[name]:
            continue
        value = torch.as_tensor(host[name][field])
        if value.numel() != 1:
            continue
        found[key] = value.to(torch_dtype_of(dtype)).reshape(shape)
        del host[name][field]
    return found


def _check_placeholders(engine: CheckpointedEngine, created: list, unsaved: list, meta: dict, where: str) -> None:
    """Placeholder optimizer state (``engine.placeholder_optimizer_state``) means nothing
    until loaded. Its device tensors are (``_select`` refuses a checkpoint without them); a
    value torch keeps on the host (Adam's step count) must be in the checkpoint's host state.
    Checked before anything is written."""
    dropped = {id(t) for t in unsaved}
    names = engine.optimized_names()
    saved = (meta.get("optimizer") or {}).get("host_state") or {}
    saved_as = restack.host_state_names({name: None for name in names.values()}, saved, *_layer_names(engine, meta))
    missing = []
    for target in created:
        if id(target) in dropped:
            continue
        name = names[target]
        have = saved.get(saved_as[name], {}) if name in saved_as else {}
        missing += [f"optim.{name}.{key}" for key, value in engine.optimizer.state[target].items()
                    if _kept_on_host(value) and key not in have]
    if missing:
        raise CheckpointError(f"{where!r} has no value for the optimizer state {sorted(missing)}, which "
                              f"{type(engine.basic_optimizer).__name__} keeps on the host; pass "
                              "load_optimizer_states=False to load the module only")


def _stage(engine: CheckpointedEngine, selected: dict, saved: dict, host_tensors: Optional[dict] = None) -> dict:
    """Targets in the checkpoint's dtype, laid out like the live ones (``engine.state_shards()``):
    empty, to read a DCP checkpoint into, or the given host tensors placed shard by shard."""
    shards = engine.state_shards()
    staging = {}
    for source, _, spec in selected.values():
        layout = source.layer_spec(spec)
        for key in source.keys:
            if key in staging:  # one checkpoint tensor can feed two targets (a param and its master)
                continue
            if host_tensors is None or key not in host_tensors:
                staging[key] = shards.staging(tuple(saved[key][0]), torch_dtype_of(saved[key][1]), layout)
            else:
                staging[key] = shards.from_host(host_tensors[key], layout)
    return staging


def _commit(engine: CheckpointedEngine, selected: dict, staging: dict) -> None:
    """Write the staged values into the live state (only once everything was read)."""
    shards = engine.state_shards()
    values = shards.values(staging)
    shards.commit({key: source.assemble(values) for key, (source, _, _) in selected.items()})


def _load_tensors(engine: CheckpointedEngine, path: str, selected: dict, saved: dict, from_host: Optional[dict] = None) -> None:
    """Read the selected tensors from the checkpoint's files, except those ``from_host`` gives."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    reader = open_state(path)
    from_host = from_host or {}
    staging = _stage(engine, selected, saved, from_host)
    state, planner = engine.state_shards().readable({k: v for k, v in staging.items() if k not in from_host})
    try:
        with quiet_dcp():
            dcp.load(state, storage_reader=reader, planner=planner, no_dist=no_dist())
    except (Exception, CheckpointException) as err:  # DCP's CheckpointException is a BaseException
        raise CheckpointError(f"cannot read the tensors of checkpoint {path!r}: {dcp_failure(err)}") from None
    _commit(engine, selected, staging)


def _host_state_restorer(engine: CheckpointedEngine, meta: dict, where: str, full_state: bool, scheduler: bool, module_only: bool):
    """Check everything a load sets on the host (counters, param groups, host-side optimizer
    state, the LR schedule, RNG states) against this engine, and return what sets it, to be
    called once the tensors are in: a damaged value fails here, naming ``where`` and the key,
    before anything is changed. It returns the device's seed for the caller to set last, after
    the engine's final sync (a sync advances it).

    As DeepSpeed: ``load_module_only`` restores neither counters nor schedule (nor, here, the
    RNG). ``micro_steps`` is put at the start of an accumulation window (``global_steps`` x
    this engine's ``gradient_accumulation_steps``): DeepSpeed does not restore it, and the
    accumulated gradients of a window are not saved."""
    def bad(key: str, why: str) -> CheckpointError:
        return CheckpointError(f"{where!r}: {key!r} {why}; the checkpoint is damaged or not this engine's")

    counters = {}
    if not module_only:
        for key in ("global_steps", "global_samples", "skipped_steps"):
            value = meta.get(key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise bad(key, f"is {value!r}, not a count")
            counters[key] = value
        counters["micro_steps"] = counters["global_steps"] * engine.gradient_accumulation_steps()
    optimizer = engine.basic_optimizer if engine.optimizer is not None else None
    groups, host_state = [], {}
    if full_state and optimizer is not None:
        groups = meta["optimizer"]["param_groups"]
        for i, group in enumerate(groups):
            if not isinstance(group, dict) or "params" in group:
                raise bad(f"optimizer.param_groups[{i}]", "is not a dict of hyperparameters")
        by_name = {name: target for target, name in engine.optimized_names().items()}
        saved = meta["optimizer"]["host_state"]
        for name, saved_name in restack.host_state_names(by_name, saved, *_layer_names(engine, meta)).items():
            if not isinstance(saved[saved_name], dict):
                raise bad(f"optimizer.host_state.{saved_name}", "is not a dict")
            host_state[by_name[name]] = saved[saved_name]
    schedule = meta.get("lr_scheduler") if scheduler and engine.lr_scheduler is not None else None
    if schedule is not None:
        live = engine.lr_scheduler.state_dict()
        if not isinstance(schedule, dict) or set(schedule) != set(live) or any(
                isinstance(v, int) and not isinstance(v, bool) and not isinstance(schedule[k], int)
                for k, v in live.items()):
            raise CheckpointError(
                f"{where!r}: the saved LR schedule state {repr(schedule)[:200]} does not fit this engine's "
                f"{type(engine.lr_scheduler).__name__} (its state has {sorted(live)}; another scheduler?); pass "
                "load_lr_scheduler_states=False to keep this engine's schedule")
    rng = meta.get("rng") if not module_only else None  # absent from imported DeepSpeed checkpoints
    if rng is not None:
        _check_rng(rng, bad)

    def restore():
        for key, value in counters.items():
            setattr(engine, key, value)
        for group, saved in zip(optimizer.param_groups if groups else (), groups):
            group.update(saved)
        for target, state in host_state.items():
            optimizer.state[target].update(state)
        if schedule is not None:
            engine.lr_scheduler.load_state_dict(schedule)
        if rng is None:
            return None
        if engine.validated_config.spmd.restore_host_rng:
            torch.set_rng_state(rng["torch"])
            random.setstate(rng["python"])
            np.random.set_state(rng["numpy"])
        # the device's seed and where its stream stands (saved before rng.position existed: the
        # micro-step count the stream folded), set by the caller once the engine's last sync is done
        position = rng.get("position")
        return rng["xla"], meta.get("micro_steps") if position is None else position

    return restore


def _check_rng(rng: dict, bad) -> None:
    """Each saved RNG state set on a throwaway generator of its kind first."""
    def xla_seed(value) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise TypeError("not a non-negative int")

    checks = {"torch": lambda v: torch.Generator().set_state(v), "python": lambda v: random.Random().setstate(v),
              "numpy": lambda v: np.random.RandomState().set_state(v), "xla": xla_seed}
    position = rng.get("position")
    if position is not None and (not isinstance(position, int) or isinstance(position, bool) or position < 0):
        raise bad("rng.position", f"is {position!r}, not a count")
    for key, check in checks.items():
        if key not in rng:
            raise bad(f"rng.{key}", "is missing")
        try:
            check(rng[key])
        except Exception as err:
            raise bad(f"rng.{key}", f"is not a {key} RNG state ({type(err).__name__}: {str(err)[:100]})") from None
