"""torch's elementwise dropout (``nn.Dropout``, ``F.dropout``) on the torchax backend: a hash
mask, drawn again in the backward instead of kept.

Why: torch's dropout, as torchax traces it (``bernoulli_`` on an empty tensor, then a division),
draws its bits from JAX's default generator (threefry: on TPU, many vector integer
operations per element), and JAX's differentiation keeps the mask from the forward to the
backward in HBM. GPT-2's residual and embedding dropouts (0.1 each, 25 of them) cost its step
about 1 ms of a 35 ms roofline on v5e:2x2 that way (docs/tpu.md).

Here the mask is ``flash_dropout.keep_elements``: the attention kernel's hash (Wellons'
lowbias32) of each element's flat index and one seed per call, taken from the trace's dropout
key as every draw is. A ``custom_vjp`` keeps only the seed for the backward, which draws the
same mask again from it, inside the fusion that uses it. Kept values are scaled by
``1 / (1 - p)``, as torch's dropout does; ``inplace=True`` writes them into the input.
"""

from __future__ import annotations

import functools

from spmdzero.backends.torchax.lowering import flash_dropout


@functools.lru_cache(maxsize=None)
def _dropped():
    """``dropped(x, seed, rate)``: x with the hash mask applied and scaled; its VJP keeps the seed."""
    import jax
    import jax.numpy as jnp

    def apply(x, seed, rate):
        keep = flash_dropout.keep_elements(seed, x.shape, rate)
        return jnp.where(keep, x * jnp.asarray(1.0 / (1.0 - rate), x.dtype), jnp.zeros((), x.dtype))

    @functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
    def dropped(x, seed, rate):
        return apply(x, seed, rate)

    def forward(x, seed, rate):
        return apply(x, seed, rate), seed

    def backward(rate, seed, grad):
        return apply(grad, seed, rate), None

    dropped.defvjp(forward, backward)
    return dropped


def _dropout(input, p, training, inplace, env):
    """torch's dropout on a torchax tensor (in torchax's mode): the hash mask, scaled."""
    p = float(p)
    if not training or p == 0.0:
        return input
    x = env.t2j_iso(input)
    if p >= 1.0:
        result = x * 0
    else:
        seed = flash_dropout.row_seeds(env.get_and_rotate_prng_key(), ())
        result = _dropped()(x, seed, p)
    result = env.j2t_iso(result)
    if inplace:
        input.copy_(result)
        return input
    return result


def functional_dropout(input, p=0.5, training=True, inplace=False, *, env=None):
    """``F.dropout`` (``nn.Dropout``): torchax meets it as a function before torch decomposes it
    into ``bernoulli_`` and a division."""
    return _dropout(input, p, training, inplace, env)


def torch_dropout(input, p, train, *, env=None):
    """``torch.dropout(input, p, train)``, the same without ``inplace``."""
    return _dropout(input, p, train, False, env)
