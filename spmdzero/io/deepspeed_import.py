"""Read a DeepSpeed ZeRO-1/2 checkpoint directory into spmdzero's per-parameter state, so a
run started with DeepSpeed (on GPUs, say) continues under spmdzero.

DeepSpeed keeps, per param group, one flat buffer of the trainable params in
``param_shapes`` order, padded to a multiple of 2 x dp and split into dp contiguous slices;
rank r's ``zero_pp_rank_r_mp_rank_00_optim_states.pt`` holds slice r of the fp32 master
(saved without that rank's tail padding) and of the Adam moments (with it). Concatenating
the unpadded slices in rank order and cutting by ``param_shapes`` gives each tensor back.

The optimizer files pickle DeepSpeed objects (the loss scaler, enums); they are read with
stand-ins, so DeepSpeed need not be installed, by an unpickler that allows nothing else
but tensors and containers: a crafted file is refused, never run.
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
import shutil
from typing import Any, Optional

import torch

from spmdzero.io.checkpoint_format import (CLIENT_FILE, CheckpointError, FORMAT_VERSION, STATE_DIR, _quiet_dcp,
                                           check_tag, tensor_index, to_json)
from spmdzero.io.safe_pickle import (CONTAINER_GLOBALS, NUMPY_SCALAR_GLOBALS, RefusedGlobal, TENSOR_GLOBALS,
                                     pickle_module)
from spmdzero.version import __version__
from spmdzero.io.checkpoint_dir import _pickle_client_state, check_target, publish, saving, staging_dir
from spmdzero.io.read import _dcp_failure, tagged_path

MODEL_FILE = "mp_rank_00_model_states.pt"
# Keys DeepSpeed itself writes into the model-states file; anything else is client_state.
_DEEPSPEED_KEYS = {"module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
                   "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
                   "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size",
                   "checkpoint_parallel_dimensions", "ds_config", "ds_version"}


class _DeepSpeedStandIn:
    """Holds the pickled fields of a DeepSpeed object without importing DeepSpeed."""

    def __init__(self, *args, **kwargs):
        self.args = args

    def __setstate__(self, state):
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self.state = state

    @classmethod
    def __class_getitem__(cls, item):
        return cls


def _stand_in(module: str, name: str) -> Optional[type]:
    if module == "deepspeed" or module.startswith("deepspeed."):
        return type(name, (_DeepSpeedStandIn,), {})
    return None


# What DeepSpeed ZeRO-1/2 files hold: tensors, containers, the training script's
# argparse.Namespace, DeepSpeed's own objects (as stand-ins), NumPy scalars in client state.
_PICKLE = pickle_module(TENSOR_GLOBALS | CONTAINER_GLOBALS | NUMPY_SCALAR_GLOBALS | {("argparse", "Namespace")},
                        resolve=_stand_in)


def _load(path: str) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=False, pickle_module=_PICKLE)
    except RefusedGlobal as err:
        raise CheckpointError(f"refused to load DeepSpeed checkpoint file {path!r}: {err}") from None
    except Exception as err:
        raise CheckpointError(f"cannot read DeepSpeed checkpoint file {path!r}: {type(err).__name__}: {err}") \
            from None


def is_deepspeed_checkpoint(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MODEL_FILE))


ZERO3_MODEL_FILE = "zero_pp_rank_0_mp_rank_00_model_states.pt"


def refuse_deepspeed_zero3(path: str) -> None:
    """A DeepSpeed ZeRO-3 checkpoint (per-rank model files, each parameter split on its own) is
    not read yet: said as such, with the way to its weights, rather than "not a checkpoint"."""
    if os.path.isfile(os.path.join(path, ZERO3_MODEL_FILE)) and not os.path.isfile(os.path.join(path, MODEL_FILE)):
        raise CheckpointError(
            f"{path!r} is a DeepSpeed ZeRO-3 checkpoint ({ZERO3_MODEL_FILE}, ...): spmdzero reads DeepSpeed's "
            "ZeRO-1/2 checkpoints only. Convert its weights with DeepSpeed's zero_to_fp32.py (written beside it) and "
            "load them into the model before initialize (the optimizer state starts anew)")


def read_deepspeed_checkpoint(path: str) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors by spmdzero checkpoint key, host state in spmdzero's meta layout)."""
    try:
        return _read(path)
    except (KeyError, IndexError, TypeError, AttributeError, ValueError, RuntimeError) as err:
        raise CheckpointError(f"{path!r} is not a DeepSpeed ZeRO-1/2 checkpoint spmdzero can read "
                              f"({type(err).__name__}: {err})") from None


def _read(path: str) -> tuple[dict[str, torch.Tensor], dict]:
    model = _load(os.path.join(path, MODEL_FILE))
    ranks = sorted(glob.glob(os.path.join(path, "*zero_pp_rank_*_mp_rank_00_optim_states.pt")),
                   key=lambda f: int(re.search(r"zero_pp_rank_(\d+)_", f).group(1)))
    if not ranks:
        raise CheckpointError(f"{path!r} has {MODEL_FILE} but no zero_pp_rank_*_optim_states.pt files "
                              "(only ZeRO-1/2 checkpoints can be imported)")
    shards = [_load(f)["optimizer_state_dict"] for f in ranks]
    if len(shards) != model["dp_world_size"]:
        raise CheckpointError(f"{path!r}: {len(shards)} optimizer files for a dp world size of "
                              f"{model['dp_world_size']}")
    module = model["module"]
    tensors: dict[str, torch.Tensor] = {f"model.{name}": t for name, t in module.items()}
    low_precision = any(t.is_floating_point() and t.dtype != torch.float32 for t in module.values())
    step_counts = []
    for group, shapes in enumerate(model["param_shapes"]):
        master = torch.cat([s["single_partition_of_fp32_groups"][group] for s in shards])
        moments = {}
        for key in ("exp_avg", "exp_avg_sq"):
            moments[key] = torch.cat([
                s["base_optimizer_state"]["state"][group][key][: s["base_optimizer_state"]["state"][group][key].numel()
                                                               - s["group_paddings"][group]]
                for s in shards])
        step_counts.append(shards[0]["base_optimizer_state"]["state"][group]["step"])
        offset = 0
        for name, shape in shapes.items():
            numel = math.prod(shape)
            if low_precision:
                tensors[f"master.{name}"] = master[offset:offset + numel].view(shape).clone()
            for key, flat in moments.items():
                tensors[f"optim.{name}.{key}"] = flat[offset:offset + numel].view(shape).clone()
            tensors[f"optim.{name}.step"] = torch.tensor(float(step_counts[-1]))
            if not low_precision:  # fp32 runs: the fp32 partition is the parameter itself
                tensors[f"model.{name}"] = master[offset:offset + numel].view(shape).clone()
            offset += numel
        if offset != master.numel():
            raise CheckpointError(f"{path!r}: param_shapes of group {group} cover {offset} values, the fp32 "
                                  f"partitions {master.numel()}")
    base_groups = shards[0]["base_optimizer_state"]["param_groups"]
    groups = [{k: (tuple(v) if k == "betas" else v) for k, v in g.items() if k not in ("params", "step")}
              for g in base_groups]
    gas = model["ds_config"].get("gradient_accumulation_steps", 1) or 1
    host = {
        "global_steps": model["global_steps"], "global_samples": model["global_samples"],
        "skipped_steps": model["skipped_steps"], "micro_steps": model["global_steps"] * gas,
        "lr_scheduler": model["lr_scheduler"],
        "optimizer": {"type": (model["ds_config"].get("optimizer") or {}).get("type"), "param_groups": groups,
                      "host_state": {}},
        "client_state": {k: v for k, v in model.items() if k not in _DEEPSPEED_KEYS},
        "loss_scaler": _loss_scaler_fields(shards[0].get("loss_scaler")),
        "ds_config": model["ds_config"],
    }
    return tensors, host


def _loss_scaler_fields(scaler: Any) -> dict:
    if scaler is None:
        return {}
    fields = vars(scaler)
    return {"scale": fields.get("cur_scale", 1.0), "hysteresis": fields.get("cur_hysteresis"),
            "last_overflow_iter": fields.get("last_overflow_iter"), "iteration": fields.get("cur_iter")}


def import_deepspeed(ds_dir: str, out_dir: str, tag: Optional[str] = None) -> str:
    """Convert a DeepSpeed ZeRO-1/2 checkpoint into an spmdzero checkpoint (no devices
    needed); ``engine.load_checkpoint(out_dir)`` then loads it on any mesh. Returns the path."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    tag, path = tagged_path(ds_dir, tag, "DeepSpeed checkpoint")
    refuse_deepspeed_zero3(path)
    if not is_deepspeed_checkpoint(path):
        raise CheckpointError(f"{path!r} is not a DeepSpeed checkpoint (no {MODEL_FILE})")
    tensors, host = read_deepspeed_checkpoint(path)
    scaler = host.pop("loss_scaler")
    if scaler.get("iteration") is not None:  # DeepSpeed's dynamic loss scaler
        tensors.update({f"loss_scale.{k}": torch.tensor(float(v)) for k, v in scaler.items()})
    client_bytes = _pickle_client_state(host.pop("client_state"))
    meta = {**host, "format": FORMAT_VERSION, "spmdzero_version": __version__, "tag": check_tag(tag, out_dir),
            "imported_from": os.path.abspath(path), "client_state": CLIENT_FILE if client_bytes else None,
            "tensors": tensor_index(tensors)}
    meta_text = json.dumps(to_json(meta), indent=1)
    with saving(out_dir):  # as a save: after any other save into out_dir, never beside one
        check_target(out_dir, tag)
        staging = staging_dir(out_dir, tag)
        try:
            with _quiet_dcp():
                dcp.save(tensors, checkpoint_id=os.path.join(staging, STATE_DIR), no_dist=True)
            publish(out_dir, tag, staging, meta_text, client_bytes, save_latest=True)
        except BaseException as err:  # an interrupt too: nothing half-written stays behind
            shutil.rmtree(staging, ignore_errors=True)
            if isinstance(err, CheckpointError) or not isinstance(err, (Exception, CheckpointException)):
                raise
            raise CheckpointError(f"cannot write checkpoint {tag!r} to {staging!r} (the previous checkpoints are "
                                  f"untouched): {_dcp_failure(err)}") from None
    return os.path.join(out_dir, tag)
