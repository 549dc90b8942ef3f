"""What checkpoints need from a backend to move the training state between its devices and
torch.distributed.checkpoint (DCP): ``StateShards``, which an engine gives as
``engine.state_shards()``. The rest of a save or a load (tags, staging, locks, the meta, the
checks against the engine, restacking) is the backends' common code in this package; only the
device side differs, and both backends write the same DCP tensors (one chunk per shard), so a
checkpoint saved by either loads in the other, on any device count.

Each process writes and reads only the shards its devices hold (a replicated tensor's once,
by one process): nothing is gathered whole onto one host.
"""

from __future__ import annotations

from typing import Any, Optional, Protocol

import torch


class StateShards(Protocol):
    """A backend's device side of ``save_checkpoint`` and ``load_checkpoint``. Values are the
    backend's device tensors (``engine.state_tensors()``'s); specs are partition specs on the
    engine's mesh; keys are checkpoint keys (``model.*``, ``master.*``, ``optim.*``, ...)."""

    def writable(self, tensors: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        """``(state_dict, planner)`` for ``dcp.save`` that write this process's shards of
        ``tensors`` (computed first, without ending a step), each shard once."""

    def staging(self, shape: tuple[int, ...], dtype: torch.dtype, spec: tuple) -> Any:
        """An empty target of ``shape`` and ``dtype`` laid out by ``spec``, to read into."""

    def from_host(self, tensor: torch.Tensor, spec: tuple) -> Any:
        """A host tensor (an imported DeepSpeed checkpoint's) placed on the devices by ``spec``."""

    def readable(self, staging: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        """``(state_dict, planner)`` for ``dcp.load`` that read this process's shards of each
        ``staging`` target from whatever chunks the checkpoint holds."""

    def values(self, staging: dict[str, Any]) -> dict[str, Any]:
        """The staged values as device tensors, once read (or placed)."""

    def commit(self, values: dict[str, Any]) -> None:
        """Write ``values`` (by live key, in any dtype) into the engine's live state, each laid
        out by the plan, and execute the copies now."""

    def rng_state(self) -> int:
        """The seed of the device's random numbers (dropout), saved as ``rng.xla``."""

    def set_rng_state(self, seed: int) -> None:
        """Seed the device's random numbers from a saved ``rng.xla``."""

    def rng_position(self) -> Optional[int]:
        """Where the device's random stream stands, when the seed alone does not say it (the
        torchax backend folds a count of micro-steps into its key), saved as ``rng.position``;
        None where the seed says it all (torch_xla's advances with the seed)."""

    def set_rng_position(self, position: int) -> None:
        """Put the device's random stream where a saved ``rng.position`` says."""
