"""Read a DeepSpeed ZeRO-1, 2 or 3 checkpoint directory into spmdzero's per-parameter state, so
a run started with DeepSpeed (on GPUs, say) continues under spmdzero, at any stage and on any
device count.

ZeRO-1/2 (one ``mp_rank_00_model_states.pt``, the module whole): DeepSpeed keeps, per param
group, one flat buffer of the trainable params in ``param_shapes`` order, padded to a multiple
of 2 x dp and split into dp contiguous slices; rank r's ``zero_pp_rank_r_mp_rank_00_optim_states.pt``
holds slice r of the fp32 master (saved without that rank's tail padding) and of the Adam
moments (with it). Concatenating the unpadded slices in rank order and cutting by
``param_shapes`` gives each tensor back.

ZeRO-3 (a ``zero_pp_rank_r_mp_rank_00_model_states.pt`` per rank, the module's parameters
empty in it): every parameter is split on its own into dp slices of ceil(numel / dp) values,
the last padded; rank r's flat fp32 group (``fp32_flat_groups``) and Adam moments are its
slice of each parameter in turn. Frozen parameters are split the same way, a fragment per rank
in the model files. In 16-bit runs the parameters are the masters, cast (as DeepSpeed's step
leaves them).

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

from spmdzero.io.checkpoint_format import (CLIENT_FILE, CheckpointError, FORMAT_VERSION, STATE_DIR, quiet_dcp,
                                           check_tag, tensor_index, to_json)
from spmdzero.io.safe_pickle import (CONTAINER_GLOBALS, NUMPY_SCALAR_GLOBALS, RefusedGlobal, TENSOR_GLOBALS,
                                     pickle_module)
from spmdzero.version import __version__
from spmdzero.io.checkpoint_dir import pickled_client_state, check_target, publish, saving, staging_dir
from spmdzero.io.read import dcp_failure, tagged_path

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


def _stand_in(module: str, name: str) -> Optional[Any]:
    if module == "deepspeed" or module.startswith("deepspeed."):
        return type(name, (_DeepSpeedStandIn,), {})
    if (module, name) == ("torch._tensor", "_rebuild_from_type_v2"):
        return _values_only
    if (module, name) == ("torch", "Tensor"):  # the type _rebuild_from_type_v2 is told to make
        return torch.Tensor
    return None


def _values_only(rebuild: Any, new_type: Any, args: tuple, state: Any) -> torch.Tensor:
    """ZeRO-3 pickles its partitions as tensors carrying an attribute (``ds_id``), through torch's
    ``_rebuild_from_type_v2``: kept here are the values, which ``rebuild`` (an allowed tensor
    rebuild, resolved by the same unpickler) makes; the type and attributes are dropped."""
    tensor = rebuild(*args)
    if not isinstance(tensor, torch.Tensor):
        raise RefusedGlobal("torch._tensor", "_rebuild_from_type_v2 of a non-tensor")
    return tensor


# What DeepSpeed checkpoint files hold: tensors, containers, the training script's
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


ZERO3_MODEL_FILE = "zero_pp_rank_0_mp_rank_00_model_states.pt"
OPTIMIZER_FILES = "*zero_pp_rank_*_mp_rank_00_optim_states.pt"  # bf16_ in front in bf16 runs


def is_deepspeed_checkpoint(path: str) -> bool:
    return any(os.path.isfile(os.path.join(path, f)) for f in (MODEL_FILE, ZERO3_MODEL_FILE))


def read_deepspeed_checkpoint(path: str) -> tuple[dict[str, torch.Tensor], dict]:
    """(tensors by spmdzero checkpoint key, host state in spmdzero's meta layout)."""
    zero3 = not os.path.isfile(os.path.join(path, MODEL_FILE))
    try:
        return _read_zero3(path) if zero3 else _read(path)
    except (KeyError, IndexError, TypeError, AttributeError, ValueError, RuntimeError) as err:
        raise CheckpointError(f"{path!r} is not a DeepSpeed ZeRO-{3 if zero3 else '1/2'} checkpoint spmdzero can "
                              f"read ({type(err).__name__}: {err})") from None


def _rank_files(path: str, pattern: str, world: int) -> list[str]:
    """The per-rank files matching ``pattern``, in rank order: one for each of ``world`` ranks
    (a checkpoint copied in part is refused here, naming what is missing)."""
    files = sorted(glob.glob(os.path.join(path, pattern)),
                   key=lambda f: int(re.search(r"zero_pp_rank_(\d+)_", f).group(1)))
    if len(files) != world:
        raise CheckpointError(f"{path!r}: {len(files)} {pattern} files for a dp world size of {world}")
    return files


def _read(path: str) -> tuple[dict[str, torch.Tensor], dict]:
    model = _load(os.path.join(path, MODEL_FILE))
    shards = [_load(f)["optimizer_state_dict"]
              for f in _rank_files(path, OPTIMIZER_FILES, model["dp_world_size"])]
    module = model["module"]
    tensors: dict[str, torch.Tensor] = {f"model.{name}": t for name, t in module.items()}
    low_precision = any(t.is_floating_point() and t.dtype != torch.float32 for t in module.values())
    for group, shapes in enumerate(model["param_shapes"]):
        master = torch.cat([s["single_partition_of_fp32_groups"][group] for s in shards])
        moments = {}
        for key in ("exp_avg", "exp_avg_sq"):
            moments[key] = torch.cat([
                s["base_optimizer_state"]["state"][group][key][: s["base_optimizer_state"]["state"][group][key].numel()
                                                               - s["group_paddings"][group]]
                for s in shards])
        step = shards[0]["base_optimizer_state"]["state"][group]["step"]
        offset = 0
        for name, shape in shapes.items():
            numel = math.prod(shape)
            whole = {key: flat[offset:offset + numel].view(shape).clone() for key, flat in moments.items()}
            _add_parameter(tensors, name, master[offset:offset + numel].view(shape).clone(), whole, step,
                           module[name].dtype if low_precision else None)
            offset += numel
        if offset != master.numel():
            raise CheckpointError(f"{path!r}: param_shapes of group {group} cover {offset} values, the fp32 "
                                  f"partitions {master.numel()}")
    return tensors, _host_state(model, shards[0]["base_optimizer_state"]["param_groups"], shards[0].get("loss_scaler"))


def _read_zero3(path: str) -> tuple[dict[str, torch.Tensor], dict]:
    model = _load(os.path.join(path, ZERO3_MODEL_FILE))
    world = model["dp_world_size"]
    models = [_load(f) for f in _rank_files(path, "zero_pp_rank_*_mp_rank_00_model_states.pt", world)]
    shards = [_load(f)["optimizer_state_dict"] for f in _rank_files(path, OPTIMIZER_FILES, world)]
    parameters = {name for shapes in model["param_shapes"] for name in shapes}
    frozen = model.get("frozen_param_shapes") or {}
    module = model["module"]
    # the module's entries besides its (empty) parameters are its buffers, saved whole
    tensors: dict[str, torch.Tensor] = {f"model.{name}": t for name, t in module.items()
                                        if name not in parameters and name not in frozen}
    for name, shape in frozen.items():
        tensors[f"model.{name}"] = _unsplit([m["frozen_param_fragments"][name].flatten() for m in models], shape)
    low_precision = any(module[name].is_floating_point() and module[name].dtype != torch.float32
                        for name in parameters if name in module)
    for group, shapes in enumerate(model["param_shapes"]):
        flats = [s["fp32_flat_groups"][group] for s in shards]
        states = [s["optimizer_state_dict"]["state"][group] for s in shards]
        offset = 0
        for name, shape in shapes.items():
            part = math.ceil(math.prod(shape) / world)
            master = _unsplit([f[offset:offset + part] for f in flats], shape)
            whole = {key: _unsplit([s[key][offset:offset + part] for s in states], shape)
                     for key in ("exp_avg", "exp_avg_sq")}
            _add_parameter(tensors, name, master, whole, states[0]["step"],
                           module[name].dtype if low_precision and name in module else None)
            offset += part
        if offset != flats[0].numel():
            raise CheckpointError(f"{path!r}: param_shapes of group {group} cover {offset} values a rank, its fp32 "
                                  f"partition {flats[0].numel()}")
    return tensors, _host_state(model, shards[0]["optimizer_state_dict"]["param_groups"], shards[0].get("loss_scaler"))


def _unsplit(slices: list[torch.Tensor], shape: Any) -> torch.Tensor:
    """One ZeRO-3 parameter from its ranks' slices, in rank order (the last one's padding dropped)."""
    return torch.cat(slices)[:math.prod(shape)].view(shape).clone()


def _add_parameter(tensors: dict, name: str, master: torch.Tensor, moments: dict, step: Any,
                   low_precision: Optional[torch.dtype]) -> None:
    """One trainable parameter's entries: in 16-bit runs the fp32 master beside the parameter
    (read whole from the module at ZeRO-1/2, else the master cast); in fp32 runs the master is the
    parameter."""
    if low_precision is None:
        tensors[f"model.{name}"] = master
    else:
        tensors[f"master.{name}"] = master
        tensors.setdefault(f"model.{name}", master.to(low_precision))
    for key, value in moments.items():
        tensors[f"optim.{name}.{key}"] = value
    tensors[f"optim.{name}.step"] = torch.tensor(float(step))


def _host_state(model: dict, base_groups: list, scaler: Any) -> dict:
    """Counters, scheduler, optimizer groups, client state and loss scale, in spmdzero's meta layout."""
    groups = [{k: (tuple(v) if k == "betas" else v) for k, v in g.items() if k not in ("params", "step")}
              for g in base_groups]
    gas = model["ds_config"].get("gradient_accumulation_steps", 1) or 1
    return {
        "global_steps": model["global_steps"], "global_samples": model["global_samples"],
        "skipped_steps": model["skipped_steps"], "micro_steps": model["global_steps"] * gas,
        "lr_scheduler": model["lr_scheduler"],
        "optimizer": {"type": (model["ds_config"].get("optimizer") or {}).get("type"), "param_groups": groups,
                      "host_state": {}},
        "client_state": {k: v for k, v in model.items() if k not in _DEEPSPEED_KEYS},
        "loss_scaler": _loss_scaler_fields(scaler),
        "ds_config": model["ds_config"],
    }


def _loss_scaler_fields(scaler: Any) -> dict:
    if scaler is None:
        return {}
    fields = vars(scaler)
    return {"scale": fields.get("cur_scale", 1.0), "hysteresis": fields.get("cur_hysteresis"),
            "last_overflow_iter": fields.get("last_overflow_iter"), "iteration": fields.get("cur_iter")}


def import_deepspeed(ds_dir: str, out_dir: str, tag: Optional[str] = None) -> str:
    """Convert a DeepSpeed ZeRO-1, 2 or 3 checkpoint into an spmdzero checkpoint (no devices
    needed); ``engine.load_checkpoint(out_dir)`` then loads it on any mesh. Returns the path."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    tag, path = tagged_path(ds_dir, tag, "DeepSpeed checkpoint")
    if not is_deepspeed_checkpoint(path):
        raise CheckpointError(f"{path!r} is not a DeepSpeed checkpoint (no {MODEL_FILE} or {ZERO3_MODEL_FILE})")
    tensors, host = read_deepspeed_checkpoint(path)
    scaler = host.pop("loss_scaler")
    if scaler.get("iteration") is not None:  # DeepSpeed's dynamic loss scaler
        tensors.update({f"loss_scale.{k}": torch.tensor(float(v)) for k, v in scaler.items()})
    client_bytes = pickled_client_state(host.pop("client_state"))
    meta = {**host, "format": FORMAT_VERSION, "spmdzero_version": __version__, "tag": check_tag(tag, out_dir),
            "imported_from": os.path.abspath(path), "client_state": CLIENT_FILE if client_bytes else None,
            "tensors": tensor_index(tensors)}
    meta_text = json.dumps(to_json(meta), indent=1)
    with saving(out_dir):  # as a save: after any other save into out_dir, never beside one
        check_target(out_dir, tag)
        staging = staging_dir(out_dir, tag)
        try:
            with quiet_dcp():
                dcp.save(tensors, checkpoint_id=os.path.join(staging, STATE_DIR), no_dist=True)
            publish(out_dir, tag, staging, meta_text, client_bytes, save_latest=True)
        except BaseException as err:  # an interrupt too: nothing half-written stays behind
            shutil.rmtree(staging, ignore_errors=True)
            if isinstance(err, CheckpointError) or not isinstance(err, (Exception, CheckpointException)):
                raise
            raise CheckpointError(f"cannot write checkpoint {tag!r} to {staging!r} (the previous checkpoints are "
                                  f"untouched): {dcp_failure(err)}") from None
    return os.path.join(out_dir, tag)
