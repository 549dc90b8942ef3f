"""Which collective libtpu picks for a gradient that a reduction makes (a bias's, a norm's: the
transpose of a broadcast sums over the batch), by the gradient's rank and the dimension its
ZeRO shards split (docs/tpu.md, "ZeRO-3's traffic"): a JAX toy, compiled for a TPU topology on
the compile-only client.

    ALLOW_MULTIPLE_LIBTPU_LOAD=1 python benchmarks/vector_gradients.py [--topology v5e:2x2]

Each row: a parameter ``p`` used as ``tanh(x * p)`` on a batch split over ``fsdp``, its
gradient constrained to ``p``'s ZeRO layout (split over ``fsdp``). A matrix's gradient made by
a matmul is the other case; the engine's tests cover it. The "bucket" rows store six vectors
as one flat, tile-aligned parameter that the step slices, as DeepSpeed's flat buffers do: the
question is whether one buffer turns the vectors' reductions into one reduce-scatter. The
"view" rows gather a vector through a ``[length / 128, 128]`` view split by rows: the question
is whether a two-dimensional gather turns its reduction into a reduce-scatter.
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def collectives_of(step, args) -> dict:
    import jax

    from spmdzero.tpu.collectives import summarize_collectives

    collectives = summarize_collectives(jax.jit(step).lower(*args).compile().as_text())
    return {kind: c["bytes"] for kind, c in collectives.items() if kind != "all-gather"}


def rows(devices):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    n = len(devices)
    mesh = Mesh(np.array(devices), ("fsdp",))

    def spec(*axes):
        return NamedSharding(mesh, P(*axes))

    def one(shape, p_spec):
        x = jax.ShapeDtypeStruct((8 * n, 16, *shape) if len(shape) == 1 else (8 * n, *shape), jnp.float32,
                                 sharding=spec("fsdp"))
        p = jax.ShapeDtypeStruct(shape, jnp.float32, sharding=spec(*p_spec))

        def step(x, p):
            g = jax.grad(lambda x, p: jnp.mean(jnp.tanh(x * p) ** 2), argnums=1)(x, p)
            return jax.lax.with_sharding_constraint(g, spec(*p_spec))
        return collectives_of(step, (x, p))

    for length in (768, 4096, 65536, 262144):
        yield f"vector [{length}], split over fsdp", one((length,), ("fsdp",))

    def through_rows(length, columns=128):
        # the same vector, gathered through a [length / 128, 128] view split by rows: a layout the
        # engine could choose without the user's module seeing it
        x = jax.ShapeDtypeStruct((8 * n, 16, length), jnp.float32, sharding=spec("fsdp"))
        p = jax.ShapeDtypeStruct((length,), jnp.float32, sharding=spec("fsdp"))

        def step(x, p):
            def loss(x, p):
                rows = jax.lax.with_sharding_constraint(p.reshape(length // columns, columns), spec("fsdp"))
                whole = jax.lax.with_sharding_constraint(rows, spec()).reshape(length)
                return jnp.mean(jnp.tanh(x * whole) ** 2)
            return jax.lax.with_sharding_constraint(jax.grad(loss, argnums=1)(x, p), spec("fsdp"))
        return collectives_of(step, (x, p))

    for length in (4096, 65536):
        if length % (128 * n) == 0:
            yield f"vector [{length}], gathered through a [{length // 128}, 128] view split by rows", \
                through_rows(length)
    yield "matrix [256, 256], rows split", one((256, 256), ("fsdp",))
    yield "matrix [256, 2048], columns split", one((256, 2048), (None, "fsdp"))

    width, count = 256, 6
    flat = -(-width * count // (n * 1024)) * n * 1024  # whole 1,024-value tiles on every chip

    def bucket(x, w, stored):
        def loss(x, w, stored):
            whole = jax.lax.with_sharding_constraint(stored, spec())
            vectors = [whole[i * width:(i + 1) * width] for i in range(count)]
            h = x
            for i in range(0, count, 2):
                h = jnp.tanh((h * vectors[i] + vectors[i + 1]) @ w)
            return jnp.mean(h ** 2)
        g_w, g_stored = jax.grad(loss, argnums=(1, 2))(x, w, stored)
        return (jax.lax.with_sharding_constraint(g_w, spec("fsdp")),
                jax.lax.with_sharding_constraint(g_stored, spec("fsdp")))

    args = (jax.ShapeDtypeStruct((8 * n, 64, width), jnp.float32, sharding=spec("fsdp")),
            jax.ShapeDtypeStruct((width, width), jnp.float32, sharding=spec("fsdp")),
            jax.ShapeDtypeStruct((flat,), jnp.float32, sharding=spec("fsdp")))
    yield f"bucket: {count} vectors [{width}] in one flat [{flat}], and a [{width}, {width}] matrix", \
        collectives_of(bucket, args)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topology", default="v5e:2x2")
    args = parser.parse_args()
    from spmdzero.tpu.compile import _tpu_devices

    devices = _tpu_devices(args.topology)
    print(f"{args.topology}: the gradients' reductions, bytes of each kind (all-gathers of the parameters left out)\n")
    print("| parameter, its ZeRO layout | reductions |")
    print("|---|---|")
    for name, got in rows(devices):
        print(f"| {name} | {', '.join(f'{kind} {size:,} B' for kind, size in got.items())} |", flush=True)


if __name__ == "__main__":
    main()
