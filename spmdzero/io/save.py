"""``engine.save_checkpoint``: every host writes its shards of the training state through
torch.distributed.checkpoint, process 0 the host state as JSON, into a staging directory
that ``checkpoint_dir.publish`` renames into place once complete; one save at a time per
directory (``checkpoint_dir.saving``)."""

from __future__ import annotations
import json
import os
import random
import shutil
import warnings
from typing import Any, Optional
import numpy as np
import torch
from spmdzero.io import checkpoint_dir
from spmdzero.io.checkpoint_dir import pickled_client_state, check_target, staging_dir
from spmdzero.io.checkpoint_format import (CLIENT_FILE, CheckpointError, FORMAT_VERSION, STATE_DIR, is_writer,
                                           no_dist, quiet_dcp, check_tag, checkpointed, tensor_index,
                                           to_json)
from spmdzero.io.read import dcp_failure
from spmdzero.version import __version__
from spmdzero.io.checkpointed_engine import CheckpointedEngine


def save_checkpoint(engine: CheckpointedEngine, save_dir: str, tag: Optional[str] = None, client_state: Optional[dict] = None,
                    save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
    """The tag and the client state are checked before anything is touched; then the whole
    save, device reads included, holds the directory (``checkpoint_dir.saving``): a second
    save into it, from another thread or process, waits, so it cannot take this one's
    staging directory for a leftover, and two threads never read the device state at once."""
    tag = check_tag(tag if tag is not None else f"global_step{engine.global_steps}", save_dir)
    client_bytes = pickled_client_state(client_state)
    with checkpoint_dir.saving(save_dir):  # saves into one directory take turns, from threads or processes
        check_target(save_dir, tag)
        _warn_if_mid_window(engine, tag)
        _save(engine, save_dir, tag, client_bytes, save_latest, exclude_frozen_parameters)
    return True


def _save(engine: CheckpointedEngine, save_dir: str, tag: str, client_bytes: Optional[bytes], save_latest: bool,
          exclude_frozen_parameters: bool) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.api import CheckpointException

    tensors = checkpointed(engine)
    if exclude_frozen_parameters:
        frozen = {f"model.{n}" for n, p in engine.module.named_parameters() if not p.requires_grad}
        tensors = {k: v for k, v in tensors.items() if k not in frozen}
    shards = engine.state_shards()
    state, planner = shards.writable({k: t for k, (t, _) in tensors.items()})
    engine.get_global_grad_norm()  # the data is on the host now anyway: tells once of a non-finite fp32 run
    meta = json.dumps(to_json(_host_state(engine, shards, tensors, tag, bool(client_bytes))), indent=1)
    staging = staging_dir(save_dir, tag)
    _wait_for_the_writers_cleanup()
    try:
        with quiet_dcp():
            # per_thread_copy_ahead=0: DCP's serial copy to host. Its overlapping loader is picked
            # whenever a privateuse1 device module is available, and importing torchax (which
            # spmd.scan_layers does) registers one without CUDA-style streams: save would fail.
            writer = FileSystemWriter(os.path.join(staging, STATE_DIR), per_thread_copy_ahead=0)
            dcp.save(state, storage_writer=writer, planner=planner, no_dist=no_dist())
    except BaseException as err:  # an interrupt too: nothing half-written stays behind
        if is_writer():
            shutil.rmtree(staging, ignore_errors=True)
        if isinstance(err, (Exception, CheckpointException)):  # DCP's CheckpointException is a BaseException
            raise CheckpointError(f"cannot write checkpoint {tag!r} to {staging!r} (the previous checkpoints are "
                                  f"untouched): {dcp_failure(err)}") from None
        raise
    if is_writer():
        checkpoint_dir.publish(save_dir, tag, staging, meta, client_bytes, save_latest)


def _wait_for_the_writers_cleanup() -> None:
    """Process 0 removes leftover staging directories (``saving``, ``staging_dir``) before
    any host writes: DCP's first act on every host is ``mkdir(staging/state, parents=True)``,
    and a host that made the staging directory just before process 0's removal of it then
    fails to make ``state`` inside (FileNotFoundError; seen under load in CI)."""
    if not no_dist() and torch.distributed.get_world_size() > 1:
        torch.distributed.barrier()


def _warn_if_mid_window(engine: CheckpointedEngine, tag: str) -> None:
    """The gradients accumulated so far in a window are not saved (nor by DeepSpeed): a run
    resumed from this checkpoint starts a new window without them."""
    gas = engine.gradient_accumulation_steps()
    if gas > 1 and engine.micro_steps % gas:
        warnings.warn(f"spmdzero: checkpoint {tag!r} is saved after micro-step {engine.micro_steps % gas} of a "
                      f"{gas}-step gradient accumulation window; the gradients accumulated in it are not saved, "
                      "and a run resumed from it starts a new window. Save after engine.step() at a boundary "
                      "(engine.is_gradient_accumulation_boundary() before the step) to resume exactly.", stacklevel=3)


def module_keys(module: torch.nn.Module) -> dict[str, str]:
    """{state_dict name: checkpoint key}. Tied weights (an embedding shared with the output
    layer) are one tensor under two names; consolidation writes both."""
    keys = {id(p): f"model.{n}" for n, p in module.named_parameters()}
    keys.update({id(b): f"buffer.{n}" for n, b in module.named_buffers() if b is not None})
    return {name: keys[id(t)] for name, t in module.state_dict(keep_vars=True).items() if id(t) in keys}


def _rng_states(shards) -> dict:
    """The RNG states a load restores: the host's (torch, Python, NumPy), the device's seed
    (``rng.xla``), and, on a backend whose seed does not say it, where its stream stands
    (``rng.position``)."""
    states = {"torch": torch.get_rng_state(), "xla": shards.rng_state(), "python": random.getstate(),
              "numpy": np.random.get_state()}
    position = shards.rng_position()
    return states if position is None else {**states, "position": position}


def _host_state(engine: CheckpointedEngine, shards, tensors: dict, tag: str, has_client_state: bool) -> dict:
    optimizer = engine.basic_optimizer if engine.optimizer is not None else None
    groups, host_state = [], {}
    if optimizer is not None:
        for group in optimizer.param_groups:
            groups.append({k: _to_host(v) for k, v in group.items() if k != "params"})
        names = engine.optimized_names()
        for target, state in optimizer.state.items():
            name = names[target]
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
        "rng": _rng_states(shards),
        "client_state": CLIENT_FILE if has_client_state else None,
        "ds_config": json.loads(json.dumps(engine.validated_config.model_dump(mode="json"), default=repr)),
        "mesh": dict(engine.plan.mesh_shape),
        "zero_stage": engine.plan.stage,
        "param_dtype": str(engine.precision.param_dtype),
        "tensors": tensor_index({k: t for k, (t, _) in tensors.items()}),
        "module_keys": module_keys(engine.module),
        "stacked_layers": engine.stacked_layers(),  # for consolidate: per-layer names again
    }


def _to_host(value: Any) -> Any:
    """Group hyperparameters may be device scalars (an lr from an in-graph schedule: a torch
    tensor on torch_xla, a JAX array on torchax)."""
    if isinstance(value, torch.Tensor) or type(value).__module__.startswith("jax"):
        return value.item()
    if isinstance(value, (tuple, list)):
        return type(value)(_to_host(v) for v in value)
    return value
