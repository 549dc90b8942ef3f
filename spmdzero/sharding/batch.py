"""DeepSpeed's batch arithmetic (``train_batch_size = micro x accumulation x world size``),
with the world size given by the batch rule (``spmd.rank``): a DeepSpeed rank is a
data-parallel device, or a process (one per host). ``BatchSizes`` holds the resolved numbers
and the rows each process and device feeds per micro-step."""

from __future__ import annotations
from dataclasses import dataclass
from typing import Optional
from spmdzero.config.errors import ConfigError
from spmdzero.config.schema import DeepSpeedConfig


_RANK = {"device": "data-parallel device", "process": "process (one per host)"}


MAX_BATCH_NUMBER = 2**63 - 1  # torch's samplers (itertools.islice) and tensor shapes hold 64-bit integers


@dataclass(frozen=True)
class BatchSizes:
    """The batch numbers, resolved by the batch rule (``spmd.rank``).

    DeepSpeed's arithmetic is ``train_batch_size = micro * accumulation * world size``
    where a "rank" feeds ``micro`` rows per micro-step. Here a rank is either a
    data-parallel device (rule "device") or a process, one per host (rule "process"); the
    rows a rank feeds are split over the data-parallel devices it stands for.
    """

    global_batch: int  # train_batch_size: rows per optimizer step, all hosts
    rows_per_rank: int  # train_micro_batch_size_per_gpu: rows one rank feeds per micro-step
    accumulation_steps: int  # gradient_accumulation_steps
    ranks: int  # DeepSpeed's world size by the rule: data-parallel devices, or processes
    dp_devices: int  # devices the batch is split over (the mesh's data-parallel axes)
    processes: int = 1
    rule: str = "device"

    @property
    def rows_per_micro_step(self) -> int:
        """Rows of one micro-step across all hosts."""
        return self.rows_per_rank * self.ranks

    @property
    def rows_per_process(self) -> int:
        """Rows one process (host) feeds per micro-step."""
        return self.rows_per_micro_step // self.processes

    @property
    def rows_per_device(self) -> Optional[int]:
        """Rows each data-parallel device gets per micro-step; None when the micro-step does
        not divide over the devices (the batch is then replicated along its rows)."""
        if self.rows_per_micro_step % self.dp_devices:
            return None
        return self.rows_per_micro_step // self.dp_devices

    def describe(self) -> list[str]:
        """The resolved numbers, as ``initialize`` prints them."""
        rank = _RANK[self.rule]
        per_device = (f"{self.rows_per_device} per device" if self.rows_per_device is not None
                      else f"replicated on each of the {self.dp_devices} devices (does not divide)")
        return [
            f"batch rule (spmd.rank={self.rule!r}): a DeepSpeed rank is a {rank}; world size {self.ranks}",
            f"global batch {self.global_batch} = {self.rows_per_rank} per rank (train_micro_batch_size_per_gpu) "
            f"x {self.accumulation_steps} accumulation x {self.ranks} ranks",
            f"per micro-step: {self.rows_per_process} rows per process ({self.processes} "
            f"process{'es' if self.processes > 1 else ''}), {per_device} "
            f"({self.dp_devices} data-parallel devices)",
        ]

    def mismatch(self, global_rows: int) -> str:
        """What a training forward of ``global_rows`` rows (all hosts) contradicts, and why."""
        word = "more" if global_rows > self.rows_per_micro_step else "fewer"
        other = "process" if self.rule == "device" else "device"
        other_rows = self.rows_per_rank * (1 if other == "process" else self.dp_devices // self.processes)
        return (f"a training forward got {global_rows // self.processes} rows per process, {word} than the "
                f"{self.rows_per_process} per micro-step that train_micro_batch_size_per_gpu={self.rows_per_rank} "
                f"gives a process under spmd.rank={self.rule!r} (a rank is a {_RANK[self.rule]}); under "
                f"spmd.rank={other!r} it would be {other_rows}. See docs/migrating.md, \"The batch rule\".")

    def host_ranks(self, process_index: int) -> range:
        """The DeepSpeed ranks whose rows host ``process_index`` feeds, in row order."""
        if self.rule == "process":
            return range(process_index, process_index + 1)
        per_host = self.ranks // self.processes
        return range(process_index * per_host, (process_index + 1) * per_host)


def resolve_batch(cfg: DeepSpeedConfig, dp_devices: int, processes: int = 1) -> BatchSizes:
    """Infer the missing batch numbers exactly as DeepSpeed's config does, with DeepSpeed's
    world size given by ``spmd.rank``: ``dp_devices`` (rule "device") or ``processes``."""
    rule = cfg.spmd.rank
    if dp_devices % processes:
        raise ConfigError(f"{dp_devices} data-parallel devices do not divide over {processes} processes")
    tb, mb, gas = cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu, cfg.gradient_accumulation_steps
    for name, value in (("train_batch_size", tb), ("train_micro_batch_size_per_gpu", mb),
                        ("gradient_accumulation_steps", gas)):
        if value is not None and value > MAX_BATCH_NUMBER:
            raise ConfigError(f"{name}={value} is too large: batch numbers must fit in a 64-bit integer (at most "
                              f"2**63 - 1, what torch's samplers and tensor shapes hold)")
    ws = dp_devices if rule == "device" else processes
    if tb is not None and mb is not None and gas is not None:
        pass
    elif tb is not None and mb is not None:
        gas = tb // mb // ws
    elif tb is not None and gas is not None:
        mb = tb // ws // gas
    elif mb is not None and gas is not None:
        tb = mb * gas * ws
    elif tb is not None:
        gas, mb = 1, tb // ws
    elif mb is not None:
        gas, tb = 1, mb * ws
    else:
        raise ConfigError("Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided")
    unit = "data-parallel devices" if rule == "device" else "processes (spmd.rank: process)"
    for name, value in (("train_batch_size", tb), ("train_micro_batch_size_per_gpu", mb),
                        ("gradient_accumulation_steps", gas)):
        if value <= 0:
            raise ConfigError(f"{name} resolved to {value} with a world size of {ws} {unit}; it must be > 0")
    if tb > MAX_BATCH_NUMBER:  # inferred as a product: the given numbers are each in range
        raise ConfigError(f"train_batch_size resolved to {tb} = train_micro_batch_size_per_gpu {mb} x "
                          f"gradient_accumulation_steps {gas} x world size {ws} {unit}, more than a 64-bit integer "
                          "holds (2**63 - 1); make train_micro_batch_size_per_gpu or gradient_accumulation_steps "
                          "smaller")
    if tb != mb * gas * ws:
        raise ConfigError(
            "Check batch related parameters. train_batch_size is not equal to "
            f"micro_batch_per_gpu * gradient_acc_step * world_size {tb} != {mb} * {gas} * {ws} "
            f"(world size = {ws} {unit}, see spmd.rank)"
        )
    return BatchSizes(tb, mb, gas, ws, dp_devices, processes, rule)
