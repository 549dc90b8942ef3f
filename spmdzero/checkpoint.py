"""Checkpoints: sharded, atomic, exactly resumable, elastic, and safe to load.

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
is complete. A load first checks the checkpoint against the engine (keys, shapes, optimizer
type), reads into staging tensors laid out like the live ones, and only then copies: a bad
checkpoint raises without touching the model. Loading onto another device count or mesh
works because torch.distributed.checkpoint reads whatever chunks each target shard needs.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import pickle
import random
import re
import shutil
import warnings
from typing import Any, Optional

import numpy as np
import torch

from .annotate import shard
from . import restack
from .scan import stacked_layers, stacking_mismatch, unstack

FORMAT_VERSION = 2
STATE_DIR, META_FILE, CLIENT_FILE, LATEST_FILE = "state", "meta.json", "client_state.pt", "latest"
LEGACY_META = "meta.pt"  # format 1 (spmdzero <= 0.1): everything, client_state included, in one pickle
STAGING, ASIDE = ".saving.", ".replaced."  # + tag: a save in progress, a tag being replaced
LEGACY_STAGING, LEGACY_ASIDE = ".tmp.", ".old."  # + tag + .pid: the same, from format-1 saves
TRUST_HINT = ("pass trust_client_state=True to load_checkpoint, or set \"spmd\": {\"trust_client_state\": true} "
              "in the config, only if you trust where the checkpoint comes from")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or loaded; the message names the file or key."""


def _quiet_dcp():
    """DCP warns that it runs single-process (we ask it to) and torch_xla's sharded tensor
    warns about an indexing idiom of its own; neither concerns the user."""
    stack = contextlib.ExitStack()
    stack.enter_context(warnings.catch_warnings())
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    warnings.filterwarnings("ignore", message="Using a non-tuple sequence for multidimensional indexing")
    return stack


def _no_dist() -> bool:
    return not (torch.distributed.is_available() and torch.distributed.is_initialized())


def _is_writer() -> bool:
    """Host files (meta, rename, latest) are written by process 0; shards by every host.
    Device-free tools (consolidation, import) never start the runtime: they are the writer."""
    import sys

    if "torch_xla.runtime" not in sys.modules:
        return True
    import torch_xla.runtime as xr

    return xr.process_index() == 0


def tensor_index(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], str]]:
    """{key: (shape, dtype)}: what the meta records of each tensor, for checks and consolidation."""
    return {k: (tuple(t.shape), str(t.dtype)) for k, t in tensors.items()}


def check_tag(tag: Any, where: str) -> str:
    """A tag names one directory directly inside ``where``: refuse anything else (and the
    names the protocol itself uses) before a file is touched."""
    tag = str(tag)
    if (not tag or tag.strip() != tag or "/" in tag or os.sep in tag or "\0" in tag or tag.startswith(".")
            or tag == LATEST_FILE or tag.startswith(LATEST_FILE + ".") or len(tag.encode()) > 200):
        raise CheckpointError(f"invalid checkpoint tag {tag!r} for {where!r}: a tag is a plain directory name "
                              f"(no '/', no leading '.' or spaces, at most 200 bytes), and {LATEST_FILE!r} is reserved")
    return tag


# ---- metadata as data ---------------------------------------------------------------------------

def to_json(value: Any, where: str = "meta") -> Any:
    """Host state as JSON: tuples, non-string-keyed dicts, tensors, arrays and dtypes are
    tagged so ``from_json`` rebuilds them exactly (tensors as raw bytes, base64)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (np.integer, np.floating, np.bool_)):
        return value.item()
    if isinstance(value, list):
        return [to_json(v, where) for v in value]
    if isinstance(value, tuple):
        return {"__tuple__": [to_json(v, where) for v in value]}
    if isinstance(value, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in value):
            return {k: to_json(v, f"{where}.{k}") for k, v in value.items()}
        return {"__dict__": [[to_json(k, where), to_json(v, f"{where}.{k}")] for k, v in value.items()]}
    if isinstance(value, torch.dtype):
        return {"__dtype__": str(value).removeprefix("torch.")}
    if isinstance(value, torch.Tensor):
        host = value.detach().cpu().contiguous()
        raw = host.view(torch.uint8) if host.dim() else host.reshape(1).view(torch.uint8)
        return {"__tensor__": [str(host.dtype).removeprefix("torch."), list(host.shape),
                               base64.b64encode(raw.numpy().tobytes()).decode()]}
    if isinstance(value, np.ndarray) and value.dtype.kind in "biuf":
        return {"__ndarray__": [value.dtype.str, list(value.shape), base64.b64encode(value.tobytes()).decode()]}
    raise CheckpointError(f"cannot store {where} in the checkpoint metadata: a {type(value).__name__} is not "
                          "plain data (numbers, strings, lists, dicts, tensors)")


def from_json(value: Any) -> Any:
    if isinstance(value, list):
        return [from_json(v) for v in value]
    if not isinstance(value, dict):
        return value
    if "__tuple__" in value:
        return tuple(from_json(v) for v in value["__tuple__"])
    if "__dict__" in value:
        return {from_json(k): from_json(v) for k, v in value["__dict__"]}
    if "__dtype__" in value:
        return _dtype(value["__dtype__"])
    if "__tensor__" in value:
        dtype, shape, data = value["__tensor__"]
        flat = torch.frombuffer(bytearray(base64.b64decode(data)), dtype=torch.uint8)
        return flat.view(_dtype(dtype)).reshape(shape).clone()
    if "__ndarray__" in value:
        dtype, shape, data = value["__ndarray__"]
        if np.dtype(dtype).kind not in "biuf":
            raise ValueError(f"array dtype {dtype!r} is not numeric")
        return np.frombuffer(base64.b64decode(data), dtype=np.dtype(dtype)).reshape(shape).copy()
    return {k: from_json(v) for k, v in value.items()}


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown tensor dtype {name!r} in checkpoint metadata")
    return dtype


# ---- save -----------------------------------------------------------------------------------

def save_checkpoint(engine, save_dir: str, tag: Optional[str] = None, client_state: Optional[dict] = None,
                    save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.api import CheckpointException
    import torch_xla.core.xla_model as xm
    from torch_xla.experimental.distributed_checkpoint import SPMDSavePlanner

    tag = check_tag(tag if tag is not None else f"global_step{engine.global_steps}", save_dir)
    client_bytes = _pickle_client_state(client_state)
    prepare_dir(save_dir)
    final = os.path.join(save_dir, tag)
    if os.path.lexists(final) and not os.path.isdir(final):
        raise CheckpointError(f"cannot save checkpoint {tag!r}: {final!r} exists and is not a directory")
    _warn_if_mid_window(engine, tag)

    tensors = engine.state_tensors()
    if exclude_frozen_parameters:
        frozen = {f"model.{n}" for n, p in engine.module.named_parameters() if not p.requires_grad}
        tensors = {k: v for k, v in tensors.items() if k not in frozen}
    # Materialize the state without ending the trace (torch_xla.sync() would advance the
    # XLA RNG seed, so a run that saves would draw other dropout masks than one that does
    # not), and wait: DCP reads the shards' device handles, which an in-flight execution
    # has not filled yet.
    xm.unlazy([t for t, _ in tensors.values()])
    xm.wait_device_ops()
    engine.get_global_grad_norm()  # the data is on the host now anyway: tells once of a non-finite fp32 run
    meta = json.dumps(to_json(_host_state(engine, tensors, tag, bool(client_bytes))), indent=1)
    staging = staging_dir(save_dir, tag)
    try:
        with _quiet_dcp():
            # per_thread_copy_ahead=0: DCP's serial copy to host. Its overlapping loader is picked
            # whenever a privateuse1 device module is available, and importing torchax (which
            # spmd.scan_layers does) registers one without CUDA-style streams: save would fail.
            writer = FileSystemWriter(os.path.join(staging, STATE_DIR), per_thread_copy_ahead=0)
            dcp.save({k: t for k, (t, _) in tensors.items()}, storage_writer=writer,
                     planner=SPMDSavePlanner(), no_dist=_no_dist())
    except BaseException as err:  # an interrupt too: nothing half-written stays behind
        if _is_writer():
            shutil.rmtree(staging, ignore_errors=True)
        if isinstance(err, (Exception, CheckpointException)):  # DCP's CheckpointException is a BaseException
            raise CheckpointError(f"cannot write checkpoint {tag!r} to {staging!r} (the previous checkpoints are "
                                  f"untouched): {_dcp_failure(err)}") from None
        raise
    if _is_writer():
        publish(save_dir, tag, staging, meta, client_bytes, save_latest)
    return True


def _warn_if_mid_window(engine, tag: str) -> None:
    """The gradients accumulated so far in a window are not saved (nor by DeepSpeed): a run
    resumed from this checkpoint starts a new window without them."""
    gas = engine.gradient_accumulation_steps()
    if gas > 1 and engine.micro_steps % gas:
        warnings.warn(f"spmdzero: checkpoint {tag!r} is saved after micro-step {engine.micro_steps % gas} of a "
                      f"{gas}-step gradient accumulation window; the gradients accumulated in it are not saved, "
                      "and a run resumed from it starts a new window. Save after engine.step() at a boundary "
                      "(engine.is_gradient_accumulation_boundary() before the step) to resume exactly.", stacklevel=3)


def _pickle_client_state(client_state: Optional[dict]) -> Optional[bytes]:
    """Serialize first, so an object that cannot be pickled fails before anything is written."""
    if not client_state:
        return None
    buffer = io.BytesIO()
    try:
        torch.save(client_state, buffer)
    except Exception as err:
        raise CheckpointError(f"client_state cannot be saved (it must be picklable): {type(err).__name__}: {err}") \
            from None
    return buffer.getvalue()


def prepare_dir(save_dir: str) -> None:
    """Create ``save_dir`` and finish or undo whatever an interrupted save left there."""
    try:
        os.makedirs(save_dir, exist_ok=True)
    except OSError as err:
        raise CheckpointError(f"cannot create checkpoint directory {save_dir!r}: {err.strerror}") from None
    if not os.access(save_dir, os.W_OK):
        raise CheckpointError(f"checkpoint directory {save_dir!r} is not writable")
    if _is_writer():
        recover(save_dir)


def _complete(path: str) -> bool:
    return os.path.isfile(os.path.join(path, META_FILE)) or os.path.isfile(os.path.join(path, LEGACY_META))


def interrupted(save_dir: str) -> dict[str, tuple[str, str]]:
    """{tag: (copy moved aside, new copy)} for each re-save killed between its two renames
    (the old copy moved aside, the tag itself missing); also from format-1 saves, whose
    names end in ``.<pid>``."""
    found = {}
    names = set(os.listdir(save_dir)) if os.path.isdir(save_dir) else set()
    for name in sorted(names):
        if name.startswith(ASIDE):
            tag, new = name[len(ASIDE):], STAGING + name[len(ASIDE):]
        elif name.startswith(LEGACY_ASIDE) and re.fullmatch(r".+\.\d+", name[len(LEGACY_ASIDE):]):
            tag, new = name[len(LEGACY_ASIDE):].rsplit(".", 1)[0], LEGACY_STAGING + name[len(LEGACY_ASIDE):]
        else:
            continue
        if tag not in names:
            found[tag] = (os.path.join(save_dir, name), os.path.join(save_dir, new))
    return found


def recover(save_dir: str) -> list[str]:
    """Repair what a save killed part-way left behind; returns what it did. A re-save
    killed between its two renames gets its complete new copy put in place if there is
    one, else the old copy back. Then leftover staging and aside directories (the user's
    files in an aside copy moved into its tag first) and temporary ``latest`` files are
    removed. Only names spmdzero makes are touched."""
    done = []
    for tag, (old, new) in interrupted(save_dir).items():
        source = new if _complete(new) else old
        os.replace(source, os.path.join(save_dir, tag))
        done.append(f"restored {tag!r} from {os.path.basename(source)}")
    for name in sorted(os.listdir(save_dir)):
        path = os.path.join(save_dir, name)
        tag = _leftover_tag(name)
        if tag is not None and os.path.isdir(path):
            if name.startswith((ASIDE, LEGACY_ASIDE)) and os.path.isdir(os.path.join(save_dir, tag)):
                carry_over(path, os.path.join(save_dir, tag))
            shutil.rmtree(path, ignore_errors=True)
            done.append(f"removed {name}")
        elif re.fullmatch(re.escape(LATEST_FILE) + r"\.tmp\.\d+", name) and not os.path.isdir(path):
            os.remove(path)
            done.append(f"removed {name}")
    return done


def _leftover_tag(name: str) -> Optional[str]:
    """The tag of a staging or aside directory's name, None for any other name (format-1
    names end in ``.<pid>``: a user's ``.tmp.cache`` is not one)."""
    for prefix in (STAGING, ASIDE):
        if name.startswith(prefix) and len(name) > len(prefix):
            return name[len(prefix):]
    for prefix in (LEGACY_STAGING, LEGACY_ASIDE):
        found = re.fullmatch(re.escape(prefix) + r"(.+)\.\d+", name)
        if found:
            return found.group(1)
    return None


def staging_dir(save_dir: str, tag: str) -> str:
    """One name per tag, so every host of a multi-host run writes its shards into the same
    staging directory."""
    staging = os.path.join(save_dir, STAGING + tag)
    if _is_writer():
        shutil.rmtree(staging, ignore_errors=True)
    return staging


def publish(save_dir: str, tag: str, staging: str, meta: str, client_bytes: Optional[bytes],
            save_latest: bool) -> None:
    """Complete the staging directory (client state, then meta: its presence marks a
    complete checkpoint), rename it to ``tag``, then replace ``latest``. Each step is a
    rename, so a reader sees the old checkpoint or the new one. Files of the user's in an
    older copy of the tag (a tokenizer, a config) are moved into the new one."""
    final = os.path.join(save_dir, tag)
    try:
        if client_bytes:
            _write_file(os.path.join(staging, CLIENT_FILE), lambda f: f.write(client_bytes))
        _write_file(os.path.join(staging, META_FILE), lambda f: f.write(meta.encode()))
        if os.path.exists(final):  # replace an older save of the same tag: move it aside first
            aside = os.path.join(save_dir, ASIDE + tag)
            os.replace(final, aside)
            os.replace(staging, final)
            carry_over(aside, final)
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.replace(staging, final)
    except OSError as err:
        shutil.rmtree(staging, ignore_errors=True)
        raise CheckpointError(f"cannot write checkpoint {tag!r} in {save_dir!r} (the previous checkpoints are "
                              f"untouched): {err}") from None
    if save_latest:
        latest = os.path.join(save_dir, LATEST_FILE)
        try:
            _write_file(latest, lambda f: f.write(tag.encode()))
        except OSError as err:
            raise CheckpointError(f"checkpoint {tag!r} was saved to {final!r}, but {latest!r} could not be updated "
                                  f"to name it ({err}); load it with tag={tag!r}") from None


# What spmdzero writes into a tag's directory; anything else there is the user's.
OWN_FILES = (STATE_DIR, META_FILE, CLIENT_FILE, LEGACY_META)


def carry_over(old: str, new: str) -> None:
    """Move what the user added to an older copy of a tag into its new copy (DeepSpeed
    leaves such files alone when it saves a tag again)."""
    if not os.path.isdir(old):
        return
    for name in os.listdir(old):
        if name not in OWN_FILES and not os.path.lexists(os.path.join(new, name)):
            os.replace(os.path.join(old, name), os.path.join(new, name))


def _write_file(path: str, write) -> None:
    """Write ``path`` whole or not at all: a temporary file, fsync, then rename over it."""
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def module_keys(module: torch.nn.Module) -> dict[str, str]:
    """{state_dict name: checkpoint key}. Tied weights (an embedding shared with the output
    layer) are one tensor under two names; consolidation writes both."""
    keys = {id(p): f"model.{n}" for n, p in module.named_parameters()}
    keys.update({id(b): f"buffer.{n}" for n, b in module.named_buffers() if b is not None})
    return {name: keys[id(t)] for name, t in module.state_dict(keep_vars=True).items() if id(t) in keys}


def _host_state(engine, tensors: dict, tag: str, has_client_state: bool) -> dict:
    import torch_xla.core.xla_model as xm

    from . import __version__

    optimizer = engine.optimizer.optimizer if engine.optimizer is not None else None
    groups, host_state = [], {}
    if optimizer is not None:
        for group in optimizer.param_groups:
            groups.append({k: _to_host(v) for k, v in group.items() if k != "params"})
        for target, state in optimizer.state.items():
            name = engine._target_names[target]
            kept = {k: v for k, v in state.items() if not (isinstance(v, torch.Tensor) and v.device.type == "xla")}
            if kept:
                host_state[name] = kept
    return {
        "format": FORMAT_VERSION, "spmdzero_version": __version__, "tag": tag,
        "global_steps": engine.global_steps, "global_samples": engine.global_samples,
        "skipped_steps": engine.skipped_steps, "micro_steps": engine.micro_steps,
        "lr_scheduler": engine.lr_scheduler.state_dict() if engine.lr_scheduler is not None else None,
        "optimizer": {"type": type(optimizer).__name__ if optimizer is not None else None,
                      "param_groups": groups, "host_state": host_state},
        "rng": {"torch": torch.get_rng_state(), "xla": xm.get_rng_state(), "python": random.getstate(),
                "numpy": np.random.get_state()},
        "client_state": CLIENT_FILE if has_client_state else None,
        "ds_config": json.loads(json.dumps(engine._config.model_dump(mode="json"), default=repr)),
        "mesh": dict(zip(engine.mesh.axis_names, engine.mesh.mesh_shape)),
        "zero_stage": engine.plan.stage,
        "param_dtype": str(engine.precision.param_dtype),
        "tensors": tensor_index({k: t for k, (t, _) in tensors.items()}),
        "module_keys": module_keys(engine.module),
        "stacked_layers": stacked_layers(engine.module),  # for consolidate: per-layer names again
    }


def _to_host(value: Any) -> Any:
    """Group hyperparameters may be device scalars (an lr from an in-graph schedule)."""
    if isinstance(value, torch.Tensor):
        return value.item()
    if isinstance(value, (tuple, list)):
        return type(value)(_to_host(v) for v in value)
    return value


# ---- load -----------------------------------------------------------------------------------

def resolve_tag(load_dir: str, tag: Optional[str]) -> Optional[str]:
    if tag is not None:
        return check_tag(tag, load_dir)
    latest = os.path.join(load_dir, LATEST_FILE)
    if not os.path.isfile(latest):
        return None
    try:
        with open(latest, encoding="utf-8") as f:
            named = f.read().strip()
    except (OSError, UnicodeDecodeError) as err:
        raise CheckpointError(f"cannot read {latest!r}: {err}") from None
    try:
        return check_tag(named, load_dir)
    except CheckpointError:
        raise CheckpointError(f"{latest!r} names {named[:80]!r}, which is not a checkpoint tag") from None


def locate(load_dir: str, tag: str) -> str:
    """The directory of ``tag``; after a save killed between its two renames, the complete
    copy of it (read in place: the next save repairs the directory)."""
    path = os.path.join(load_dir, tag)
    if os.path.isdir(path):
        return path
    try:
        pending = interrupted(load_dir)
        names = os.listdir(load_dir) if os.path.isdir(load_dir) else []
    except OSError as err:
        raise CheckpointError(f"no checkpoint tag {tag!r} in {load_dir!r}, which cannot be listed: {err}") from None
    if tag in pending:
        old, new = pending[tag]
        found = new if _complete(new) else old
        warnings.warn(f"spmdzero: a save of {tag!r} in {load_dir!r} was interrupted; loading its complete copy "
                      f"{os.path.basename(found)} (the next save_checkpoint into this directory repairs it)",
                      stacklevel=3)
        return found
    tags = sorted(d for d in names if not d.startswith(".") and os.path.isdir(os.path.join(load_dir, d)))
    raise CheckpointError(f"no checkpoint tag {tag!r} in {load_dir!r} (found: {', '.join(tags) or 'nothing'})")


def _refusal(err: BaseException) -> str:
    """The line of torch's weights_only refusal that names the global."""
    found = re.search(r"GLOBAL ([\w.]+)", str(err))
    return f"it names the global '{found.group(1)}'" if found else f"{type(err).__name__}: {str(err)[:300]}"


def read_meta(path: str, trust_client_state: bool = False) -> dict:
    meta_file = os.path.join(path, META_FILE)
    if not os.path.isfile(meta_file):
        if os.path.isfile(os.path.join(path, LEGACY_META)):
            return _read_legacy_meta(os.path.join(path, LEGACY_META), trust_client_state)
        raise CheckpointError(f"checkpoint {path!r} has no {META_FILE} (not an spmdzero checkpoint, or incomplete)")
    try:
        with open(meta_file, encoding="utf-8") as f:
            meta = from_json(json.load(f))
    except (OSError, ValueError, TypeError, KeyError, RuntimeError) as err:
        raise CheckpointError(f"cannot read {meta_file!r}: {type(err).__name__}: {err}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{meta_file!r} is not an spmdzero checkpoint of format {FORMAT_VERSION}")
    return _check_meta(meta, meta_file)


# What a load reads from the meta, by type: checked before anything is loaded.
_META_FIELDS = {"global_steps": int, "global_samples": int, "skipped_steps": int, "micro_steps": int,
                "tensors": dict, "optimizer": dict, "lr_scheduler": (dict, type(None)), "rng": (dict, type(None))}


def _check_meta(meta: dict, meta_file: str) -> dict:
    for key, kind in _META_FIELDS.items():
        if not isinstance(meta.get(key), kind) or isinstance(meta.get(key), bool):
            raise CheckpointError(f"{meta_file!r}: {key!r} is missing or not a {getattr(kind, '__name__', kind)}")
    optimizer = meta["optimizer"]
    if not (isinstance(optimizer.get("param_groups"), list) and isinstance(optimizer.get("host_state"), dict)):
        raise CheckpointError(f"{meta_file!r}: 'optimizer' needs 'param_groups' (a list) and 'host_state' (a dict)")
    for key, entry in meta["tensors"].items():
        ok = isinstance(entry, (list, tuple)) and len(entry) == 2 and isinstance(entry[1], str) \
            and isinstance(entry[0], (list, tuple)) and all(isinstance(n, int) and n >= 0 for n in entry[0])
        if not ok:
            raise CheckpointError(f"{meta_file!r}: tensor {key!r} is recorded as {entry!r}, not [shape, dtype]")
        _dtype(entry[1])
    return meta


def _read_legacy_meta(meta_file: str, trust: bool) -> dict:
    """Format 1 kept everything in a pickle. It is read as data (``weights_only=True``;
    NumPy's RNG state array allowed); only a trusted one may unpickle more (its client_state)."""
    multiarray = np._core.multiarray if hasattr(np, "_core") else np.core.multiarray
    safe = [multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]
    try:
        with torch.serialization.safe_globals(safe):
            meta = torch.load(meta_file, map_location="cpu", weights_only=True)
    except Exception as err:
        if not (trust and isinstance(err, pickle.UnpicklingError)):
            raise CheckpointError(f"refused to load {meta_file!r} (an spmdzero format-1 checkpoint) as plain data: "
                                  f"{_refusal(err)}. It may hold a client_state of other objects: {TRUST_HINT}") \
                from None
        meta = torch.load(meta_file, map_location="cpu", weights_only=False)
    if not isinstance(meta, dict) or meta.get("format") != 1:
        raise CheckpointError(f"{meta_file!r} is not an spmdzero checkpoint")
    return _check_meta(meta, meta_file)


def read_client_state(path: str, meta: dict, trust: bool) -> Any:
    """The ``client_state`` saved with the checkpoint: plain data (dicts, lists, strings,
    numbers, tensors) loads as is; other objects need the caller's trust."""
    if isinstance(meta.get("client_state"), dict):  # format 1 kept it inline
        return meta["client_state"]
    if meta.get("client_state") is None:
        return {}
    client_file = os.path.join(path, CLIENT_FILE)
    try:
        return torch.load(client_file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        if not trust:
            raise CheckpointError(f"refused to load {client_file!r}: it holds objects other than plain data "
                                  f"({_refusal(err)}); {TRUST_HINT}") from None
    except Exception as err:
        raise CheckpointError(f"cannot read {client_file!r}: {type(err).__name__}: {err}") from None
    try:
        return torch.load(client_file, map_location="cpu", weights_only=False)
    except Exception as err:
        raise CheckpointError(f"cannot read {client_file!r}: {type(err).__name__}: {err}") from None


def load_checkpoint(engine, load_dir: str, tag: Optional[str] = None, load_module_strict: bool = True,
                    load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                    load_module_only: bool = False, trust_client_state: Optional[bool] = None):
    """DeepSpeed's ``load_checkpoint``: returns ``(load_path, client_state)``, or
    ``(None, None)`` with a warning when ``load_dir`` has no ``latest`` and no tag is given.
    ``trust_client_state`` (default: the config's ``spmd.trust_client_state``) allows a
    ``client_state`` of arbitrary objects to be unpickled."""
    if trust_client_state is None:
        trust_client_state = engine._config.spmd.trust_client_state
    tag = resolve_tag(load_dir, tag)
    if tag is None:
        warnings.warn(f"Unable to find latest file at {os.path.join(load_dir, LATEST_FILE)}, if trying to load "
                      "latest checkpoint please ensure this file exists or pass an explicit checkpoint tag when "
                      "loading a checkpoint.", stacklevel=2)
        return None, None
    path = locate(load_dir, tag)
    full_state = load_optimizer_states and not load_module_only
    from .deepspeed_import import is_deepspeed_checkpoint, read_deepspeed_checkpoint

    scheduler = load_lr_scheduler_states and not load_module_only
    if is_deepspeed_checkpoint(path):
        tensors, meta = read_deepspeed_checkpoint(path)
        _check_optimizer(engine, meta, path, full_state)
        restore = _host_state_restorer(engine, meta, path, full_state, scheduler, load_module_only)
        tensors.update(_loss_scale_tensors(engine, meta.pop("loss_scaler")))
        index = tensor_index(tensors)
        selected = _select(engine, index, load_module_strict, full_state, meta)
        _commit(engine, selected, _stage(engine, selected, index, tensors))
        client_state = meta["client_state"]
    else:
        meta = read_meta(path, trust_client_state)
        _check_optimizer(engine, meta, path, full_state)
        restore = _host_state_restorer(engine, meta, os.path.join(path, META_FILE), full_state, scheduler,
                                       load_module_only)
        selected = _select(engine, meta["tensors"], load_module_strict, full_state, meta)
        client_state = read_client_state(path, meta, trust_client_state)
        _load_tensors(engine, path, selected, meta["tensors"])
    restore()
    engine._keep_step_state_on_device()  # the restored counts, where the next step reads them
    import torch_xla

    torch_xla.sync()
    return path, client_state


# Names of one update rule (torch's, spmdzero's and DeepSpeed's classes and config types).
_OPTIMIZER_FAMILIES = {"adam": "adam", "adamw": "adam", "fusedadam": "adam", "deepspeedcpuadam": "adam",
                       "lamb": "lamb", "fusedlamb": "lamb", "lion": "lion", "fusedlion": "lion",
                       "adagrad": "adagrad", "deepspeedcpuadagrad": "adagrad"}


def _check_optimizer(engine, meta: dict, path: str, full_state: bool) -> None:
    """Moments of one optimizer are not another's: refuse to load them across types, or
    into another number of param groups or other parameters."""
    saved = (meta.get("optimizer") or {}).get("type")
    live = type(engine.optimizer.optimizer).__name__ if engine.optimizer is not None else None
    if live is None or not full_state:
        return
    groups, live_groups = meta["optimizer"]["param_groups"], engine.optimizer.optimizer.param_groups
    if len(groups) != len(live_groups):
        raise CheckpointError(f"checkpoint {path!r} has {len(groups)} optimizer param groups, this engine's "
                              f"optimizer {len(live_groups)}; pass load_optimizer_states=False to load the module only")
    live_stacked, saved_stacked = _layer_names(engine, meta)
    known = set(engine._target_names.values()) | {layer for layers in live_stacked.values() for layer in layers}
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


def _loss_scale_tensors(engine, fields: dict) -> dict:
    """An imported DeepSpeed loss scaler as spmdzero's ``loss_scale.*`` state, when both
    sides scale the loss."""
    if engine._loss_scale is None or fields.get("iteration") is None:
        return {}
    return {f"loss_scale.{k}": torch.tensor(float(v)) for k, v in fields.items()}


def _layer_names(engine, meta: dict) -> tuple[dict, dict]:
    """The engine's stacked names and the checkpoint's, each with its per-layer names
    (``restack.layer_names``); the layer counts come from the parameters' shapes."""
    live_shapes = {name: tuple(p.shape) for name, p in engine.module.named_parameters()}
    live = stacked_layers(engine.module)
    saved = meta.get("stacked_layers") or {}
    tensors = meta.get("tensors") or {}
    saved = {name: stack for name, stack in saved.items() if f"model.{name}" in tensors}
    return (restack.layer_names(live, {name: live_shapes[name][0] for name in live}),
            restack.layer_names(saved, {name: tuple(tensors[f"model.{name}"][0])[0] for name in saved}))


def _select(engine, saved: dict, strict: bool, full_state: bool, meta: dict) -> dict:
    """{live key: (restack.Source, live tensor, spec)} to load, after checking them against
    the checkpoint. A master weight missing on one side is taken from the other: a bf16 run's
    fp32 masters become an fp32 run's params, an fp32 run's params a bf16 run's masters. A
    checkpoint saved with ``spmd.scan_layers='stacked'`` and another setting loaded: each
    tensor from its layers or its stack (``spmdzero.restack``)."""
    live = engine.state_tensors()
    saved_shapes = {k: tuple(v[0]) for k, v in saved.items()}
    live_shapes = {k: tuple(t.shape) for k, (t, _) in live.items()}
    # a param's master and a master's param: where the two precisions meet
    wanted = {**live_shapes, **{f"master.{k[6:]}": v for k, v in live_shapes.items() if k.startswith("model.")},
              **{f"model.{k[7:]}": v for k, v in live_shapes.items() if k.startswith("master.")}}
    aliases = restack.sources(wanted, saved_shapes, *_layer_names(engine, {**meta, "tensors": saved}))

    def found(key: str) -> Optional[restack.Source]:
        return restack.Source((key,)) if key in saved else aliases.get(key)

    module_keys = {k for k in live if k.startswith(("model.", "buffer."))}
    saved_module = {k for k in saved if k.startswith(("model.", "buffer."))}
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
    return {key: (src, *live[key]) for key, src in source.items()}


def _stage(engine, selected: dict, saved: dict, host_tensors: Optional[dict] = None) -> dict:
    """Device tensors in the checkpoint's dtype, laid out like the live targets: zeros to
    read a DCP checkpoint into, or the given host tensors sent shard by shard."""
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.spmd as xs

    staging = {}
    for source, tensor, spec in selected.values():
        layout = source.layer_spec(spec)
        for key in source.keys:
            if key in staging:  # one checkpoint tensor can feed two targets (a param and its master)
                continue
            if host_tensors is None:
                staged = torch.zeros(tuple(saved[key][0]), dtype=_dtype(saved[key][1]), device=tensor.device)
                shard(staged, engine.mesh, layout)
            else:
                sharding = xs.ShardingSpec(engine.mesh, tuple(layout))
                staged = xm.send_cpu_data_to_device([host_tensors[key]], engine.device, sharding)[0]
            staging[key] = staged
    # DCP's SPMDLoadPlanner reads each staging tensor's device shard handles directly;
    # those are placeholders until the execution that creates them has finished, so
    # execute them and wait (torch_xla.sync() returns while it is still in flight).
    xm.unlazy(list(staging.values()))
    xm.wait_device_ops()
    return staging


def _commit(engine, selected: dict, staging: dict) -> None:
    """Copy staged values into the live tensors (only once everything was read)."""
    import torch_xla

    with torch.no_grad():
        for source, tensor, _ in selected.values():
            tensor.copy_(source.assemble(staging))
    engine._reannotate()
    torch_xla.sync()


def _dcp_failure(err: BaseException) -> str:
    """DCP wraps each rank's exception; show the underlying one, not 'ranks:dict_keys([0])'."""
    failures = getattr(err, "failures", None)
    if failures:
        err = next(iter(failures.values()))[0]  # (exception, traceback) per rank
    return f"{type(err).__name__}: {str(err).strip()[:500]}"


def open_state(path: str):
    """DCP's reader for ``path/state`` with its ``.metadata`` read safely, up front, so a
    refused or corrupt one is reported as such."""
    from .safe_pickle import RefusedGlobal, dcp_reader

    state = os.path.join(path, STATE_DIR)
    reader = dcp_reader(state)
    try:
        metadata = reader.read_metadata()
    except RefusedGlobal as err:
        raise CheckpointError(f"refused to load {os.path.join(state, '.metadata')!r}: {err}") from None
    except Exception as err:
        raise CheckpointError(f"cannot read {os.path.join(state, '.metadata')!r}: {type(err).__name__}: {err}") \
            from None
    # spmdzero writes only tensors. A key stored as bytes would be read back by DCP's default
    # planner with torch.load(weights_only=False): refuse it up front.
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    pickled = sorted(k for k, md in metadata.state_dict_metadata.items() if not isinstance(md, TensorStorageMetadata))
    if pickled:
        raise CheckpointError(f"refused to load {os.path.join(state, '.metadata')!r}: it stores {pickled[:3]} as "
                              "pickled bytes, which an spmdzero checkpoint never contains")
    reader.read_metadata = lambda *args, **kwargs: metadata
    return reader


def _load_tensors(engine, path: str, selected: dict, saved: dict) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch_xla.experimental.distributed_checkpoint import SPMDLoadPlanner

    reader = open_state(path)
    staging = _stage(engine, selected, saved)
    try:
        with _quiet_dcp():
            dcp.load(staging, storage_reader=reader, planner=SPMDLoadPlanner(), no_dist=_no_dist())
    except (Exception, CheckpointException) as err:  # DCP's CheckpointException is a BaseException
        raise CheckpointError(f"cannot read the tensors of checkpoint {path!r}: {_dcp_failure(err)}") from None
    _commit(engine, selected, staging)


def _host_state_restorer(engine, meta: dict, where: str, full_state: bool, scheduler: bool, module_only: bool):
    """Check everything a load sets on the host (counters, param groups, host-side optimizer
    state, the LR schedule, RNG states) against this engine, and return what sets it, to be
    called once the tensors are in: a damaged value fails here, naming ``where`` and the key,
    before anything is changed.

    As DeepSpeed: ``load_module_only`` restores neither counters nor schedule (nor, here, the
    RNG). ``micro_steps`` is put at the start of an accumulation window (``global_steps`` x
    this engine's ``gradient_accumulation_steps``): DeepSpeed does not restore it, and the
    accumulated gradients of a window are not saved."""
    import torch_xla.core.xla_model as xm

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
    optimizer = engine.optimizer.optimizer if engine.optimizer is not None else None
    groups, host_state = [], {}
    if full_state and optimizer is not None:
        groups = meta["optimizer"]["param_groups"]
        for i, group in enumerate(groups):
            if not isinstance(group, dict) or "params" in group:
                raise bad(f"optimizer.param_groups[{i}]", "is not a dict of hyperparameters")
        by_name = {name: target for target, name in engine._target_names.items()}
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

    def restore() -> None:
        for key, value in counters.items():
            setattr(engine, key, value)
        if counters:
            engine._window_loss = None  # a new accumulation window: its mean loss starts again
        for group, saved in zip(optimizer.param_groups if groups else (), groups):
            group.update(saved)
        for target, state in host_state.items():
            optimizer.state[target].update(state)
        if schedule is not None:
            engine.lr_scheduler.load_state_dict(schedule)
        if rng is not None:
            torch.set_rng_state(rng["torch"])
            xm.set_rng_state(rng["xla"])
            random.setstate(rng["python"])
            np.random.set_state(rng["numpy"])

    return restore


def _check_rng(rng: dict, bad) -> None:
    """Each saved RNG state set on a throwaway generator of its kind first."""
    def xla_seed(value) -> None:
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise TypeError("not a non-negative int")

    checks = {"torch": lambda v: torch.Generator().set_state(v), "python": lambda v: random.Random().setstate(v),
              "numpy": lambda v: np.random.RandomState().set_state(v), "xla": xla_seed}
    for key, check in checks.items():
        if key not in rng:
            raise bad(f"rng.{key}", "is missing")
        try:
            check(rng[key])
        except Exception as err:
            raise bad(f"rng.{key}", f"is not a {key} RNG state ({type(err).__name__}: {str(err)[:100]})") from None


# ---- consolidation (no devices needed) ----------------------------------------------------------

def consolidate(ckpt_dir: str, out_path: str, tag: Optional[str] = None, dtype: str = "fp32",
                safetensors: bool = False) -> dict[str, tuple[int, ...]]:
    """Write one state dict that the plain ``nn.Module`` loads with ``load_state_dict``
    (``consolidated_state_dict``): the analog of DeepSpeed's zero_to_fp32.py. Returns
    {name: shape}."""
    if os.path.isdir(out_path):
        raise CheckpointError(f"output {out_path!r} is a directory; give a file name")
    out_parent = os.path.dirname(os.path.abspath(out_path))
    if not os.path.isdir(out_parent):
        raise CheckpointError(f"output directory {out_parent!r} does not exist")
    result = consolidated_state_dict(ckpt_dir, tag, dtype)
    if safetensors:
        try:
            from safetensors.torch import save_file
        except ImportError:
            raise CheckpointError("--safetensors needs the 'safetensors' package (pip install safetensors)") from None
        seen: set[int] = set()  # safetensors refuses shared storage: tied names get their own copy
        out = {}
        for k, v in result.items():
            out[k] = v.contiguous() if id(v) not in seen else v.clone()
            seen.add(id(v))
        save_file(out, out_path)
    else:
        torch.save(result, out_path)
    return {k: tuple(v.shape) for k, v in result.items()}


def consolidated_state_dict(ckpt_dir: str, tag: Optional[str] = None, dtype: str = "fp32") -> dict:
    """The state dict a plain ``nn.Module`` loads with ``load_state_dict``, on the CPU: the
    fp32 master weights where the run kept them, else the parameters, plus module buffers,
    under every name the module's state dict has (tied weights under each). Reads one tensor
    at a time, so it needs about the output's size in memory, and no accelerator."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    out_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(dtype)
    if out_dtype is None:
        raise CheckpointError(f"dtype must be 'fp32' or 'bf16', got {dtype!r}")
    if not os.path.isdir(ckpt_dir):
        raise CheckpointError(f"checkpoint directory {ckpt_dir!r} does not exist")
    tag = resolve_tag(ckpt_dir, tag)
    if tag is None:
        raise CheckpointError(f"{ckpt_dir!r} has no 'latest' file; pass a tag")
    path = locate(ckpt_dir, tag)
    meta = read_meta(path)
    index = meta["tensors"]
    names = meta.get("module_keys") or {key.partition(".")[2]: key for key in index
                                        if key.startswith(("model.", "buffer."))}
    reader = open_state(path)
    loaded: dict[str, torch.Tensor] = {}
    result: dict[str, torch.Tensor] = {}
    for name, key in names.items():
        if key not in index:  # a frozen parameter left out of the save
            continue
        if key not in loaded:
            kind, _, rest = key.partition(".")
            source = f"master.{rest}" if f"master.{rest}" in index else key
            shape, saved_dtype = index[source]
            target = torch.empty(tuple(shape), dtype=_dtype(saved_dtype))
            try:
                with _quiet_dcp():
                    dcp.load({source: target}, storage_reader=reader, no_dist=True)
            except (Exception, CheckpointException) as err:  # DCP's CheckpointException is a BaseException
                raise CheckpointError(f"cannot read {source!r} from {path!r}: {_dcp_failure(err)}") from None
            loaded[key] = target.to(out_dtype) if target.is_floating_point() and kind == "model" else target
        result[name] = loaded[key]
    stacks = meta.get("stacked_layers") or {}
    if not isinstance(stacks, dict) or not all(isinstance(stack, str) and isinstance(name, str)
                                               and name.startswith(f"{stack}.") for name, stack in stacks.items()):
        raise CheckpointError(f"{path!r}: 'stacked_layers' in its meta is not {{stacked name: its stack's name}}")
    return unstack(result, stacks)
