"""Unpickling that cannot run code: every global a pickle names is checked against an
allowlist, and anything else is refused with its name.

A pickle runs code only through the callables it names (``module.name`` globals), so a
``find_class`` that returns nothing but data constructors (tensor rebuilds, containers,
dataclasses of checkpoint metadata) makes loading a crafted file safe. Used for DeepSpeed's
``.pt`` files (which pickle DeepSpeed objects, read as stand-ins) and for the ``.metadata``
file of torch.distributed.checkpoint, which torch reads with plain ``pickle.load``.
"""

from __future__ import annotations

import pickle
import types
from typing import Any, Callable, Optional

import torch

# torch.load's own wrapper resolves the storage classes (``torch.FloatStorage``) before
# asking us; these are the rest of what a saved tensor needs.
TENSOR_GLOBALS = {
    ("torch._utils", "_rebuild_tensor"), ("torch._utils", "_rebuild_tensor_v2"), ("torch._utils", "_rebuild_tensor_v3"),
    ("torch._utils", "_rebuild_parameter"), ("torch._utils", "_rebuild_parameter_with_state"),
    ("torch", "Size"), ("torch", "device"), ("collections", "OrderedDict"),
}
CONTAINER_GLOBALS = {("builtins", n) for n in ("set", "frozenset", "complex", "bytearray", "slice", "range")}
# Protocol 2 pickles bytes as _codecs.encode(str, "latin1"); numpy scalars are (dtype, bytes).
NUMPY_SCALAR_GLOBALS = {("_codecs", "encode"), ("numpy", "dtype"), ("numpy.core.multiarray", "scalar"),
                        ("numpy._core.multiarray", "scalar")}


class RefusedGlobal(pickle.UnpicklingError):
    """A pickle named a global outside the allowlist."""

    def __init__(self, module: str, name: str):
        super().__init__(f"it names the global '{module}.{name}', which is not allowed in a checkpoint")
        self.module, self.name = module, name


def _torch_enum(module: str, name: str) -> Optional[Any]:
    """torch dtypes, layouts and memory formats (``torch.float32``, ``torch.strided``)."""
    if module != "torch":
        return None
    value = getattr(torch, name, None)
    return value if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)) else None


def pickle_module(allowed: set[tuple[str, str]],
                  resolve: Optional[Callable[[str, str], Optional[Any]]] = None) -> types.SimpleNamespace:
    """A ``pickle``-like module (for ``torch.load(pickle_module=...)``) whose unpickler
    returns only the ``allowed`` globals, torch's dtypes/layouts, and what ``resolve``
    maps (stand-ins); any other global raises ``RefusedGlobal``."""
    import importlib

    class Unpickler(pickle.Unpickler):
        def find_class(self, module, name):
            if resolve is not None:
                found = resolve(module, name)
                if found is not None:
                    return found
            found = _torch_enum(module, name)
            if found is not None:
                return found
            if (module, name) in allowed:
                return getattr(importlib.import_module(module), name)
            raise RefusedGlobal(module, name)

    def load(file, **kwargs):
        return Unpickler(file, **kwargs).load()

    return types.SimpleNamespace(Unpickler=Unpickler, load=load, __name__="pickle")


def _dcp_metadata_class(module: str, name: str) -> Optional[Any]:
    """The dataclasses and enums torch.distributed.checkpoint writes into ``.metadata``."""
    import torch.distributed.checkpoint.filesystem as fs
    import torch.distributed.checkpoint.metadata as md

    if module == md.__name__:
        value = getattr(md, name, None)
        return value if isinstance(value, type) else None
    if (module, name) == (fs.__name__, "_StorageInfo"):
        return fs._StorageInfo
    return None


# DCP also records the checkpoint's path (a PosixPath) and each tensor's layout by name.
DCP_GLOBALS = {("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("torch.serialization", "_get_layout")}
DCP_METADATA = pickle_module(TENSOR_GLOBALS | CONTAINER_GLOBALS | DCP_GLOBALS, resolve=_dcp_metadata_class)


def dcp_reader(path: str):
    """A ``FileSystemReader`` whose ``.metadata`` is read with the restricted unpickler
    (torch reads it with plain ``pickle.load``; the shards it already reads with
    ``weights_only=True``)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
            with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
                metadata = DCP_METADATA.load(f)
            if not isinstance(metadata, Metadata):
                raise pickle.UnpicklingError(f"its .metadata holds a {type(metadata).__name__}, not DCP Metadata")
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return SafeReader(path)
