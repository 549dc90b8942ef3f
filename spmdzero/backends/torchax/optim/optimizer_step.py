"""``engine.optimizer.step()`` on the torchax backend: DeepSpeed's ZeRO optimizer stepped by the
caller (a script that calls ``engine.backward(loss)`` then ``engine.optimizer.step()``, not
``engine.step()``), with the torch_xla backend's semantics.

As DeepSpeed 0.19.8's ZeRO optimizer ``step()`` (runtime/zero/stage_1_and_2.py): the update with
the gradients reduced at the accumulation boundary's backward, clipped to
``gradient_clipping``, skipped on overflow with the loss scale updated, and the gradients then
dropped. What its caller, the engine's ``_take_model_step``, adds is left out: ``global_steps``,
``global_samples``, the LR schedule and the skipped-step count stay; ``micro_steps`` is
``engine.step()``'s. At stage 0 in fp32 DeepSpeed's optimizer is the torch optimizer itself,
which does not clip (the engine clips before calling it). Why a module: the engine runs the
update program; what differs here is only which program and what is kept around it."""

from __future__ import annotations

import torch

from spmdzero.train.engine_base import no_gradients

CALL = "engine.optimizer.step()"


def optimizer_step(engine) -> None:
    """Apply ``engine``'s update as DeepSpeed's ZeRO optimizer's ``step()`` (see the module
    docstring). Refused without gradients since the last update (DeepSpeed's optimizer then has
    none and fails) and inside an accumulation window (none reduced yet)."""
    if engine.optimizer is None:
        raise RuntimeError(f"{CALL} needs an optimizer: pass optimizer= to initialize() or add an 'optimizer' "
                           "section to the config")
    if engine.state.accum is None:
        raise RuntimeError(no_gradients(CALL, "the last optimizer step (or since a checkpoint load, or a zero_grad() "
                                              "that dropped the gradients)"))
    if not engine.gradients.window_reduced:
        gas = engine.gradient_accumulation_steps()
        raise RuntimeError(
            f"{CALL} inside a gradient accumulation window (micro-step {engine.micro_steps % gas + 1} of {gas}): the "
            "last engine.backward() was not at the accumulation boundary, so the window's gradients are incomplete "
            "(DeepSpeed's ZeRO optimizer has none reduced then). Call engine.step() after every micro-step; call "
            "engine.optimizer.step() only after the backward of a micro-step where "
            "engine.is_gradient_accumulation_boundary() is True")
    import jax

    clipped = not (engine.plan.stage == 0 and engine.precision.param_dtype == torch.float32)
    # the skipped-step count is the engine's (its _take_model_step counts it): the update program
    # adds to it, so the count before is kept aside (a device copy, no host read)
    skipped = jax.numpy.copy(engine.state.skipped)
    engine.apply_update(None, clipped=clipped)
    engine.state = engine.state._replace(skipped=skipped)
