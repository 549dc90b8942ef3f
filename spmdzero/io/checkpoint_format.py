"""The checkpoint format: file names, the format version, JSON encoding of host state, tag
rules, dtypes, and ``CheckpointError``, the one exception a bad checkpoint raises."""

from __future__ import annotations
import base64
import contextlib
import os
import re
import warnings
from typing import Any
import numpy as np
import torch
from spmdzero.io.checkpointed_engine import CheckpointedEngine


# the names in a checkpoint directory
STATE_DIR, META_FILE, CLIENT_FILE, LATEST_FILE = "state", "meta.json", "client_state.pt", "latest"
STAGING, ASIDE = ".saving.", ".replaced."  # + tag: a save in progress, a tag being replaced
LEGACY_STAGING, LEGACY_ASIDE = ".tmp.", ".old."  # + tag + .pid: the same, from format-1 saves

FORMAT_VERSION = 2


LEGACY_META = "meta.pt"  # format 1 (spmdzero <= 0.1): everything, client_state included, in one pickle


TRUST_HINT = ("pass trust_client_state=True to load_checkpoint, or set \"spmd\": {\"trust_client_state\": true} "
              "in the config, only if you trust where the checkpoint comes from")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or loaded; the message names the file or key."""


def quiet_dcp():
    """DCP warns that it runs single-process (we ask it to), about its own use of
    ``tensor.storage()`` and about torch_xla's planner's signature, and torch_xla's sharded
    tensor about an indexing idiom of its own; none of it concerns the user."""
    stack = contextlib.ExitStack()
    stack.enter_context(warnings.catch_warnings())
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    warnings.filterwarnings("ignore", message="Using a non-tuple sequence for multidimensional indexing")
    warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
    warnings.filterwarnings("ignore", message="The function definition for SavePlanner.set_up_planner")
    return stack


def no_dist() -> bool:
    return not (torch.distributed.is_available() and torch.distributed.is_initialized())


def is_writer() -> bool:
    """Host files (meta, rename, latest) are written by process 0; shards by every host.
    Device-free tools (consolidation, import) never start the runtime: they are the writer."""
    import sys

    from spmdzero.runtime import jax_private, jax_runtime

    if jax_runtime.selected():  # JAX's process index, once JAX has started
        if "jax" not in sys.modules or not jax_private.backends_started():
            return True
        return sys.modules["jax"].process_index() == 0
    if "torch_xla.runtime" not in sys.modules:
        return True
    import torch_xla.runtime as xr

    return xr.process_index() == 0


def non_persistent_buffers(module: torch.nn.Module) -> set[str]:
    """The names of the module's ``persistent=False`` buffers (rotary embeddings' ``inv_freq``,
    causal masks): values the model computes from its settings, which torch's ``state_dict``
    and DeepSpeed's checkpoints leave out. A checkpoint neither holds nor restores them, so a
    load keeps what the model computed (a changed ``rope_theta`` takes effect) and a model
    that gained one still loads an older checkpoint."""
    return {f"{prefix}.{name}" if prefix else name
            for prefix, sub in module.named_modules() for name in sub._non_persistent_buffers_set}


def checkpointed(engine: CheckpointedEngine) -> dict[str, tuple[Any, tuple]]:
    """What a checkpoint holds of the engine's state: ``engine.state_tensors()`` less the
    module's non-persistent buffers."""
    skip = {f"buffer.{name}" for name in non_persistent_buffers(engine.module)}
    return {k: v for k, v in engine.state_tensors().items() if k not in skip}


def tensor_index(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], str]]:
    """{key: (shape, dtype)}: what the meta records of each tensor, for checks and consolidation;
    the dtype as torch names it, for torch tensors and JAX arrays alike."""
    return {k: (tuple(t.shape), "torch." + str(t.dtype).removeprefix("torch.")) for k, t in tensors.items()}


def check_tag(tag: Any, where: str) -> str:
    """A tag names one directory directly inside ``where``: refuse anything else (and the
    names the protocol itself uses) before a file is touched."""
    tag = str(tag)
    if (not tag or tag.strip() != tag or "/" in tag or os.sep in tag or "\0" in tag or tag.startswith(".")
            or tag == LATEST_FILE or tag.startswith(LATEST_FILE + ".") or len(tag.encode()) > 200):
        raise CheckpointError(f"invalid checkpoint tag {tag!r} for {where!r}: a tag is a plain directory name "
                              f"(no '/', no leading '.' or spaces, at most 200 bytes), and {LATEST_FILE!r} is reserved")
    return tag


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
        return torch_dtype_of(value["__dtype__"])
    if "__tensor__" in value:
        dtype, shape, data = value["__tensor__"]
        flat = torch.frombuffer(bytearray(base64.b64decode(data)), dtype=torch.uint8)
        return flat.view(torch_dtype_of(dtype)).reshape(shape).clone()
    if "__ndarray__" in value:
        dtype, shape, data = value["__ndarray__"]
        if np.dtype(dtype).kind not in "biuf":
            raise ValueError(f"array dtype {dtype!r} is not numeric")
        return np.frombuffer(base64.b64decode(data), dtype=np.dtype(dtype)).reshape(shape).copy()
    return {k: from_json(v) for k, v in value.items()}


def torch_dtype_of(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown tensor dtype {name!r} in checkpoint metadata")
    return dtype


def refusal(err: BaseException) -> str:
    """The line of torch's weights_only refusal that names the global."""
    found = re.search(r"GLOBAL ([\w.]+)", str(err))
    return f"it names the global '{found.group(1)}'" if found else f"{type(err).__name__}: {str(err)[:300]}"
