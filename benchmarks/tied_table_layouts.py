"""How libtpu reduces a tied embedding table's gradient under each candidate layout
(docs/tpu.md, v5e:4x4): a JAX toy, compiled for a TPU topology on the compile-only client.

    ALLOW_MULTIPLE_LIBTPU_LOAD=1 python benchmarks/tied_table_layouts.py [--topology v5e:4x4]
        [--vocab 2048] [--width 256] [--tokens-per-chip 128]

The toy: tokens looked up in a ``[vocab, width]`` table, one ``[width, width]`` matrix with
tanh, logits against the same table, cross-entropy. Each row is one layout for the table's
gradient (the block matrix always goes through spmdzero's two stages, rows over ``fsdp`` then
columns over ``fsdp_inner``) and prints the bytes the gradients' collectives send per chip
over the data-parallel minimum (15/16 of both gradients on 16 chips). There is no parameter
all-gather here, so the ratios are not the engine's step ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

LAYOUTS = {  # name: (one-hot embedding backward?, the table gradient's stages)
    "columns over all (spmdzero)": (False, [(None, ("fsdp", "fsdp_inner"))]),
    "rows over fsdp, then columns": (False, [("fsdp", None), ("fsdp", "fsdp_inner")]),
    "columns over fsdp, then rows": (False, [(None, "fsdp"), ("fsdp_inner", "fsdp")]),
    "columns over fsdp, then all": (False, [(None, "fsdp"), (None, ("fsdp", "fsdp_inner"))]),
    "one-hot backward, rows then columns": (True, [("fsdp", None), ("fsdp", "fsdp_inner")]),
}


def measure(devices, vocab: int, width: int, tokens_per_chip: int, one_hot: bool, stages) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from spmdzero.tpu.collectives import summarize_collectives

    n = len(devices)
    mesh = Mesh(np.array(devices).reshape(n // 2, 2), ("fsdp", "fsdp_inner"))
    batch = ("fsdp", "fsdp_inner")
    tokens = tokens_per_chip * n

    @jax.custom_vjp
    def embed_one_hot(table, ids):
        return table[ids]

    embed_one_hot.defvjp(lambda table, ids: (table[ids], (ids, table.shape[0])),
                         lambda res, g: (jax.nn.one_hot(res[0], res[1], dtype=g.dtype).T @ g, None))

    def loss(params, ids):
        table, w = params
        h = embed_one_hot(table, ids) if one_hot else table[ids]
        h = jax.lax.with_sharding_constraint(h, NamedSharding(mesh, P(batch, None)))
        logits = jnp.tanh(h @ w) @ table.T
        return -jnp.mean(jax.nn.log_softmax(logits)[jnp.arange(tokens), ids])

    def step(params, ids):
        g_table, g_w = jax.grad(loss)(params, ids)
        for spec in stages:
            g_table = jax.lax.with_sharding_constraint(g_table, NamedSharding(mesh, P(*spec)))
        for spec in (("fsdp", None), ("fsdp", "fsdp_inner")):
            g_w = jax.lax.with_sharding_constraint(g_w, NamedSharding(mesh, P(*spec)))
        return g_table, g_w

    replicated = NamedSharding(mesh, P())
    args = ((jax.ShapeDtypeStruct((vocab, width), jnp.float32, sharding=replicated),
             jax.ShapeDtypeStruct((width, width), jnp.float32, sharding=replicated)),
            jax.ShapeDtypeStruct((tokens,), jnp.int32, sharding=NamedSharding(mesh, P(batch))))
    compiled = jax.jit(step).lower(*args).compile()
    collectives = summarize_collectives(compiled.as_text())
    minimum = (n - 1) / n * 4 * (vocab * width + width * width)
    return {"ratio": sum(c["sent"] or 0 for c in collectives.values()) / minimum,
            "sent_by_kind": {kind: c["sent"] for kind, c in collectives.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--topology", default="v5e:4x4")
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--tokens-per-chip", type=int, default=128)
    args = parser.parse_args()
    from spmdzero.tpu.compile import _tpu_devices

    devices = _tpu_devices(args.topology)
    print(f"{args.topology}: table [{args.vocab}, {args.width}], {args.tokens_per_chip} tokens per chip\n")
    print("| table gradient layout | sent / minimum | bytes sent per chip, by kind |")
    print("|---|---|---|")
    for name, (one_hot, stages) in LAYOUTS.items():
        got = measure(devices, args.vocab, args.width, args.tokens_per_chip, one_hot, stages)
        print(f"| {name} | {got['ratio']:.2f} | {json.dumps(got['sent_by_kind'])} |", flush=True)


if __name__ == "__main__":
    main()
