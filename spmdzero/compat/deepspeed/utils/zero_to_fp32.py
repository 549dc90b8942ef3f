"""``deepspeed.utils.zero_to_fp32``: one fp32 state dict from a checkpoint, for a plain
``nn.Module`` (spmdzero checkpoints, ``spmdzero.io.consolidate.consolidated_state_dict``)."""

from __future__ import annotations

import os
from typing import Optional

from spmdzero.io.checkpoint_format import CheckpointError
from spmdzero.io.consolidate import consolidate, consolidated_state_dict


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str, tag: Optional[str] = None,
                                             exclude_frozen_parameters: bool = False, lazy_mode: bool = False) -> dict:
    """DeepSpeed's: the fp32 state dict, on the CPU. Frozen parameters are left out when the
    checkpoint was saved without them (``exclude_frozen_parameters`` at save); ``lazy_mode``
    changes nothing here (tensors are read one at a time anyway)."""
    return consolidated_state_dict(checkpoint_dir, tag)


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: str, output_dir: str, max_shard_size: str = "5GB",
                                               safe_serialization: bool = False, tag: Optional[str] = None,
                                               exclude_frozen_parameters: bool = False) -> None:
    """DeepSpeed's: write ``pytorch_model.bin`` (``model.safetensors`` with
    ``safe_serialization``) into ``output_dir``, as one file (``max_shard_size`` is not applied)."""
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise CheckpointError(f"output_dir {output_dir!r} is not a directory")
    os.makedirs(output_dir, exist_ok=True)
    name = "model.safetensors" if safe_serialization else "pytorch_model.bin"
    consolidate(checkpoint_dir, os.path.join(output_dir, name), tag=tag, safetensors=safe_serialization)


def load_state_dict_from_zero_checkpoint(model, checkpoint_dir: str, tag: Optional[str] = None):
    """DeepSpeed's: the model, moved to the CPU, with the checkpoint's fp32 weights loaded."""
    model = model.cpu()
    model.load_state_dict(get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag), strict=False)
    return model
