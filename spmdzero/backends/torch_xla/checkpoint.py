"""The torch_xla backend's device side of checkpoints (``spmdzero.io.shards.StateShards``): the
XLA tensors' shards written and read in place through torch_xla's SPMD planners for DCP."""

from __future__ import annotations

from typing import Any

import torch

from spmdzero.backends.torch_xla.annotate import shard


class XlaStateShards:
    """``StateShards`` over one torch_xla engine."""

    def __init__(self, engine):
        self._engine = engine

    def writable(self, tensors: dict[str, torch.Tensor]) -> tuple[dict, Any]:
        import torch_xla.core.xla_model as xm
        from torch_xla.experimental.distributed_checkpoint import SPMDSavePlanner

        # Materialize the state without ending the trace (torch_xla.sync() would advance the
        # XLA RNG seed, so a run that saves would draw other dropout masks than one that does
        # not), and wait: DCP reads the shards' device handles, which an in-flight execution
        # has not filled yet.
        xm.unlazy(list(tensors.values()))
        xm.wait_device_ops()
        return dict(tensors), SPMDSavePlanner()

    def staging(self, shape: tuple[int, ...], dtype: torch.dtype, spec: tuple) -> torch.Tensor:
        staged = torch.zeros(shape, dtype=dtype, device=self._engine.device)
        shard(staged, self._engine.mesh, spec)
        return staged

    def from_host(self, tensor: torch.Tensor, spec: tuple) -> torch.Tensor:
        import torch_xla.core.xla_model as xm
        import torch_xla.distributed.spmd as xs

        sharding = xs.ShardingSpec(self._engine.mesh, tuple(spec))
        return xm.send_cpu_data_to_device([tensor], self._engine.device, sharding)[0]

    def readable(self, staging: dict[str, torch.Tensor]) -> tuple[dict, Any]:
        import torch_xla.core.xla_model as xm
        from torch_xla.experimental.distributed_checkpoint import SPMDLoadPlanner

        # SPMDLoadPlanner reads each staging tensor's device shard handles directly; those are
        # placeholders until the execution that creates them has finished, so execute them and
        # wait (torch_xla.sync() returns while it is still in flight).
        xm.unlazy(list(staging.values()))
        xm.wait_device_ops()
        return staging, SPMDLoadPlanner()

    def values(self, staging: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return staging  # read in place

    def commit(self, values: dict[str, torch.Tensor]) -> None:
        import torch_xla

        live = self._engine.state_tensors()
        with torch.no_grad():
            for key, value in values.items():
                live[key][0].copy_(value)
        self._engine.lay_out_state()
        torch_xla.sync()

    def rng_state(self) -> int:
        import torch_xla.core.xla_model as xm

        return xm.get_rng_state()

    def set_rng_state(self, seed: int) -> None:
        import torch_xla.core.xla_model as xm

        xm.set_rng_state(seed)

    def rng_position(self) -> None:
        return None  # torch_xla's seed advances with the stream: rng.xla says it all

    def set_rng_position(self, position: int) -> None:
        pass
