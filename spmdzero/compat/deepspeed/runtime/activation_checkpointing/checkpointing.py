"""``deepspeed.checkpointing``: DeepSpeed's activation checkpointing API (Megatron-style scripts
call ``deepspeed.checkpointing.configure(...)`` and ``deepspeed.checkpointing.checkpoint(fn,
*args)``), over ``torch.utils.checkpoint``, which both backends rematerialize in the compiled
step (the torchax backend as one ``jax.checkpoint`` region, ``backends/torchax/lowering/remat.py``).

What DeepSpeed's variant adds is about its hand-made model parallelism and memory handling, which
the compiled SPMD step does not have; ``configure`` accepts those settings and names each once as
a no-op (``partition_activations``: activations are sharded with the batch already;
``checkpoint_in_cpu``: no host offload; ``contiguous_checkpointing`` and ``num_checkpoints``: XLA
allocates the step's buffers; ``synchronize``: one program has no boundary to synchronize;
``profile``: the step log times steps). The RNG tracker Megatron uses is torch's own generator
here: one process drives all its devices, so there is no per-rank model-parallel seed to fork.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Callable, Optional

import torch
import torch.utils.checkpoint

NO_OPS = {
    "partition_activations": "activations are already sharded with the batch; there is no model-parallel group",
    "checkpoint_in_cpu": "checkpointed activations stay on the devices (no host offload)",
    "contiguous_checkpointing": "XLA allocates the step's buffers",
    "num_checkpoints": "XLA allocates the step's buffers",
    "synchronize": "the step is one compiled program: there is no boundary to synchronize",
    "profile": "the step log times whole steps",
}
# deepspeed_config's activation_checkpointing keys, by configure's argument names
_CONFIG_KEYS = {"partition_activations": "partition_activations", "cpu_checkpointing": "checkpoint_in_cpu",
                "contiguous_memory_optimization": "contiguous_checkpointing",
                "number_checkpoints": "num_checkpoints", "synchronize_checkpoint_boundary": "synchronize",
                "profile": "profile"}
_configured = [False]
_said: set = set()


def configure(mpu_: Any = None, deepspeed_config: Any = None, partition_activations: Optional[bool] = None,
              contiguous_checkpointing: Optional[bool] = None, num_checkpoints: Optional[int] = None,
              checkpoint_in_cpu: Optional[bool] = None, synchronize: Optional[bool] = None,
              profile: Optional[bool] = None) -> None:
    """DeepSpeed's ``configure``: the settings, from the arguments or the config's
    ``activation_checkpointing`` section, are each named once as a no-op when switched on."""
    given = {"partition_activations": partition_activations, "contiguous_checkpointing": contiguous_checkpointing,
             "num_checkpoints": num_checkpoints, "checkpoint_in_cpu": checkpoint_in_cpu,
             "synchronize": synchronize, "profile": profile}
    section = _section(deepspeed_config)
    for key, name in _CONFIG_KEYS.items():
        if given[name] is None and key in section:
            given[name] = section[key]
    on = [name for name, value in given.items() if value not in (None, False, 0) and name not in _said]
    if on:
        _said.update(on)
        warnings.warn("spmdzero: deepspeed.checkpointing.configure: " + "; ".join(
            f"{name}: {NO_OPS[name]}" for name in on) + " (no effect; said once)", stacklevel=2)
    _configured[0] = True


def _section(deepspeed_config: Any) -> dict:
    """The ``activation_checkpointing`` section of a config dict or JSON path (empty if none)."""
    if deepspeed_config is None:
        return {}
    if isinstance(deepspeed_config, dict):
        config = deepspeed_config
    else:
        from spmdzero.config.load import read_config_file

        config = read_config_file(str(deepspeed_config))
    section = config.get("activation_checkpointing")
    return section if isinstance(section, dict) else {}


def is_configured() -> bool:
    return _configured[0]


def reset() -> None:
    """DeepSpeed frees its contiguous buffers here; there are none."""


def checkpoint(function: Callable, *args):
    """``function(*args)``, its activations recomputed in the backward (``torch.utils.checkpoint``,
    which the compiled step rematerializes); DeepSpeed's checkpoint takes positional arguments
    only, as this does."""
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)


non_reentrant_checkpoint = checkpoint


class _RngTracker:
    """Megatron's CUDA RNG tracker, as DeepSpeed exposes it: ``fork()`` draws from torch's
    generator (see the module docstring)."""

    def __init__(self):
        self.states: dict = {}

    def add(self, name: str, seed: int) -> None:
        self.states[name] = seed

    def get_states(self) -> dict:
        return dict(self.states)

    def set_states(self, states: dict) -> None:
        self.states = dict(states)

    def reset(self) -> None:
        self.states = {}

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng"):
        yield


_TRACKER = _RngTracker()


def get_cuda_rng_tracker() -> _RngTracker:
    return _TRACKER


def model_parallel_cuda_manual_seed(seed: int) -> None:
    """Megatron seeds its model-parallel generator; with no model parallelism, torch's seed."""
    torch.manual_seed(seed)
