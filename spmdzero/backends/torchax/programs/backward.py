"""The backward program of a loss computed outside the module (``loss = criterion(engine(x), y)``):
the VJP the forward program gave, run on the cotangents torch autograd hands it.

``(VJP, cotangents, accum, avals, divisor) -> (accumulated gradients, input gradients)``: its
cotangents divided by ``divisor``; a cotangent that is None (an output the loss does not use) is
zeros of that output's shape; with several processes their cotangents make the gradient of
their mean loss (``outputs/process_rows.combine``). The gradients are reduced and accumulated as
the training program does (``gradients.accumulated``)."""

from __future__ import annotations

from spmdzero.backends.torchax.outputs import process_rows
from spmdzero.backends.torchax.programs import gradients
from spmdzero.backends.torchax.programs.setup import ProgramSetup


def build_backward(setup: ProgramSetup):
    """The backward program, jitted (or run eagerly, as ``setup.compile`` decides), the
    accumulated gradients donated: the sum replaces them."""
    import jax.numpy as jnp

    def backward(vjp, cotangents, accum, avals, divisor):
        setup.count_trace("backward")
        cts = [jnp.zeros(shape, dtype) if c is None else
               ((c if kind is None else process_rows.combine(c, kind, setup.processes)).astype(jnp.float32)
                / divisor).astype(dtype)
               for c, (shape, dtype, kind) in zip(cotangents, avals)]
        grads, input_grads = vjp(cts)
        return gradients.accumulated(setup, grads, accum), input_grads

    return setup.compile.backward(backward, static_argnums=(3,), donate_argnums=(2,))
