"""The torchax engine's training state as one value: every device array a step reads or writes,
and the counter of the random stream, in one named tuple (as optax and torchtitan keep theirs).

Why one value: the programs are functions of it. The update takes its ``Stepped`` part and gives
a new one back (``update.build_update``), a checkpoint reads and writes its fields, and the engine
holds the current ``TrainState`` in ``engine.state``, replaced (never edited in place) when a
program or a load gives new arrays. What a step reads and writes is then written here, not spread
over the engine's attributes.

Each field is laid out by the plan (``sharding.plan``): parameters by its param spec, masters and
optimizer states by its master and optimizer-state specs, gradients by its gradient spec; the
rest is replicated."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

from spmdzero.optim.update import LossScale


class Stepped(NamedTuple):
    """What the update program at an accumulation boundary takes (donated) and gives back."""

    params: dict  # trained parameters by plan name, in the parameter dtype (bf16 under bf16)
    masters: dict  # fp32 (or bf16) master weights under mixed precision; empty in fp32 training
    opt_state: dict  # each parameter's optimizer states by key, without the shared ones
    shared_state: dict  # states every parameter shares (the step counter): one array each
    skipped: Any  # steps skipped for non-finite gradients, a device scalar
    loss_scale: Optional[LossScale]  # fp16's loss scaler (device scalars); None otherwise


class StepReport(NamedTuple):
    """What the update program reports besides the new state."""

    grad_norm: Any  # the pre-clip global gradient norm
    skip: Any  # whether this step was skipped for non-finite gradients (a device bool)


class TrainState(NamedTuple):
    """The engine's training state (see the module docstring)."""

    params: dict
    masters: dict
    opt_state: dict
    shared_state: dict
    skipped: Any
    loss_scale: Optional[LossScale]
    constants: dict  # frozen parameters and buffers by name, replicated: the programs' inputs that are not trained
    accum: Optional[dict]  # gradients committed since the last boundary; None between steps
    rng: Any  # the base random key; each forward folds in (draw_step, its draw) (``forward._forward_key``)
    draw_step: int  # micro-steps the random stream has passed: a checkpoint's ``rng.position``

    def scale(self):
        """fp16's loss scale in use, a device scalar (None without one): a training program's input."""
        return None if self.loss_scale is None else self.loss_scale.scale

    def stepped(self) -> Stepped:
        """The part the update program steps."""
        return Stepped(*(getattr(self, field) for field in Stepped._fields))

    def with_stepped(self, stepped: Stepped) -> "TrainState":
        """This state with the update's new values."""
        return self._replace(**stepped._asdict())

    def device_arrays(self) -> tuple:
        """Every device array of the state (``jax.block_until_ready`` takes it)."""
        return (self.stepped(), self.constants, self.accum, self.rng)
