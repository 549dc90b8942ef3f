"""``spmdzero checkpoint consolidate``: one plain state dict (``torch.save`` or safetensors) of
a sharded checkpoint, on any machine, in fp32 or the model dtype, with stacked layers written
under their per-layer names again; the output file is replaced atomically."""

from __future__ import annotations
import os
import shutil
from typing import Optional
import torch
from spmdzero.io.checkpoint_dir import reading, replace_file
from spmdzero.io.restack import unstack
from spmdzero.io.checkpoint_format import CheckpointError
from spmdzero.io.read import open_state, read_host_tensor, read_meta, tagged_path


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
        write = lambda tmp: save_file(out, tmp)  # noqa: E731
    else:
        write = lambda tmp: torch.save(result, tmp)  # noqa: E731
    _write_output(out_path, write)
    return {k: tuple(v.shape) for k, v in result.items()}


def _write_output(out_path: str, write) -> None:
    """Write the output whole or not at all (``replace_file``): written in place, a full disk
    left a previous good output unloadable. torch.save and safetensors report a full disk in
    their own exception types (torch's names no file): any failure becomes one
    CheckpointError naming the output, the cause and the space left."""
    target = os.path.realpath(out_path)  # an output that is a link: its target is replaced, the link kept
    existed = os.path.isfile(target)
    try:
        replace_file(target, write)
    except Exception as err:
        cause = err.strerror if isinstance(err, OSError) and err.strerror else f"{type(err).__name__}: {err}"
        try:
            free = f"; {shutil.disk_usage(os.path.dirname(target)).free / 2**20:.1f} MiB free there"
        except OSError:
            free = ""
        kept = f"the previous {out_path!r} is unchanged" if existed else "nothing was written"
        raise CheckpointError(f"cannot write {out_path!r} ({cause}{free}); {kept}") from None


def consolidated_state_dict(ckpt_dir: str, tag: Optional[str] = None, dtype: str = "fp32") -> dict:
    """The state dict a plain ``nn.Module`` loads with ``load_state_dict``, on the CPU: the
    fp32 master weights where the run kept them, else the parameters, plus module buffers,
    under every name the module's state dict has (tied weights under each). Reads one tensor
    at a time, so it needs about the output's size in memory, and no accelerator."""
    out_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}.get(dtype)
    if out_dtype is None:
        raise CheckpointError(f"dtype must be 'fp32' or 'bf16', got {dtype!r}")
    with reading(ckpt_dir):  # a save into ckpt_dir waits: it cannot move the copy being read
        tag, path = tagged_path(ckpt_dir, tag)
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
                target = read_host_tensor(path, index, source, reader)
                loaded[key] = target.to(out_dtype) if target.is_floating_point() and kind == "model" else target
            result[name] = loaded[key]
    stacks = meta.get("stacked_layers") or {}
    if not isinstance(stacks, dict) or not all(isinstance(stack, str) and isinstance(name, str)
                                               and name.startswith(f"{stack}.") for name, stack in stacks.items()):
        raise CheckpointError(f"{path!r}: 'stacked_layers' in its meta is not {{stacked name: its stack's name}}")
    return unstack(result, stacks)
