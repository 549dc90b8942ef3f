"""Reading a checkpoint directory without trusting it: which tag (``latest``, checked), which
copy is complete, ``meta.json`` checked field by field, ``client_state.pt`` as data unless
trusted, and DCP's metadata through the allowlisting unpickler."""

from __future__ import annotations
import json
import os
import pickle
import warnings
from typing import Any, Optional
import numpy as np
import torch
from spmdzero.io.checkpoint_dir import is_complete, interrupted
from spmdzero.io.checkpoint_format import (CLIENT_FILE, CheckpointError, FORMAT_VERSION, LATEST_FILE, LEGACY_META,
                                           META_FILE, STATE_DIR, TRUST_HINT, torch_dtype_of, quiet_dcp, refusal, check_tag,
                                           from_json)
from spmdzero.io.safe_pickle import RefusedGlobal, dcp_reader


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
        found = new if is_complete(new) else old
        warnings.warn(f"spmdzero: a save of {tag!r} in {load_dir!r} was interrupted; loading its complete copy "
                      f"{os.path.basename(found)} (the next save_checkpoint into this directory repairs it)",
                      stacklevel=3)
        return found
    tags = sorted(d for d in names if not d.startswith(".") and os.path.isdir(os.path.join(load_dir, d)))
    raise CheckpointError(f"no checkpoint tag {tag!r} in {load_dir!r} (found: {', '.join(tags) or 'nothing'})")


def tagged_path(root: str, tag: Optional[str], what: str = "checkpoint") -> tuple[str, str]:
    """``(tag, root/<tag>)`` for a directory of tagged checkpoints, the tag read from ``latest``
    when None: a missing directory or a missing ``latest`` is a CheckpointError naming it."""
    if not os.path.isdir(root):
        raise CheckpointError(f"{what} directory {root!r} does not exist")
    tag = resolve_tag(root, tag)
    if tag is None:
        raise CheckpointError(f"{root!r} has no 'latest' file; pass a tag")
    return tag, locate(root, tag)


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
        torch_dtype_of(entry[1])
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
                                  f"{refusal(err)}. It may hold a client_state of other objects: {TRUST_HINT}") \
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
                                  f"({refusal(err)}); {TRUST_HINT}") from None
    except Exception as err:
        raise CheckpointError(f"cannot read {client_file!r}: {type(err).__name__}: {err}") from None
    try:
        return torch.load(client_file, map_location="cpu", weights_only=False)
    except Exception as err:
        raise CheckpointError(f"cannot read {client_file!r}: {type(err).__name__}: {err}") from None


def dcp_failure(err: BaseException) -> str:
    """DCP wraps each rank's exception; show the underlying one, not 'ranks:dict_keys([0])'."""
    failures = getattr(err, "failures", None)
    if failures:
        err = next(iter(failures.values()))[0]  # (exception, traceback) per rank
    return f"{type(err).__name__}: {str(err).strip()[:500]}"


def read_host_tensor(path: str, index: dict, key: str, reader=None) -> Optional[torch.Tensor]:
    """One saved tensor, whole, on the host (None when the checkpoint has no ``key``)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    if key not in index:
        return None
    shape, saved_dtype = index[key]
    target = torch.empty(tuple(shape), dtype=torch_dtype_of(saved_dtype))
    try:
        with quiet_dcp():
            dcp.load({key: target}, storage_reader=reader or open_state(path), no_dist=True)
    except (Exception, CheckpointException) as err:  # DCP's CheckpointException is a BaseException
        raise CheckpointError(f"cannot read {key!r} from {path!r}: {dcp_failure(err)}") from None
    return target


def open_state(path: str):
    """DCP's reader for ``path/state`` with its ``.metadata`` read safely, up front, so a
    refused or corrupt one is reported as such."""
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
