"""The libtpu compiler flags spmdzero compiles with, in one place.

The AOT compile (``spmdzero.tpu.compile``, libtpu's compile-only client) and a TPU VM's
runtime (``spmdzero.runtime.process.bootstrap``, before torch_xla starts libtpu) both call
``apply``: the same flags, merged the same way with the user's ``LIBTPU_INIT_ARGS``, so
``spmdzero aot`` reports the program the real run compiles. libtpu reads
``LIBTPU_INIT_ARGS`` once, when it loads, and stops the process on a flag it does not know
("ERROR: Unknown command line flag"): each flag here was checked against
``LIBTPU_VERSIONS``.

A flag the user sets in ``LIBTPU_INIT_ARGS`` wins over ours. ``SPMDZERO_LIBTPU_FLAGS=0``
applies none of them (the AOT compile, inheriting the environment, then agrees).
"""

from __future__ import annotations

import os

# torch_xla 2.9's libtpu, which FLAGS were measured on, and jax 0.10.2's, which loads them and
# compiles docs/tpu.md's table to the same collectives with them (`make test` runs `aot` on both)
LIBTPU_VERSIONS = ("0.0.21", "0.0.42")
OPT_OUT = "SPMDZERO_LIBTPU_FLAGS"

FLAGS: dict[str, str] = {
    # A ZeRO-2 gradient split by columns whose rows are not a multiple of 128 x chips (GPT-2's
    # tied [50257, 768] table on v5e:2x2: libtpu lays it out rows-minor) was all-reduced in
    # full and sliced (1.17x the data-parallel minimum for GPT-2 124M); with this flag libtpu
    # reduce-scatters it (JAX `a.T @ b`, 50257 rows, 4 chips: all-reduce 221 MiB sent per chip
    # -> reduce-scatter 110 MiB; `spmdzero aot`, GPT-2 124M ZeRO-2: 1.17x -> 1.02x). The test
    # model's programs on v5e:2x2 and v5e:4x4 compile the same with or without it (docs/tpu.md).
    "xla_tpu_use_minor_sharding_for_major_trivial_input": "true",
    # A random tensor sharded over the chips (dropout's bits: u32[global batch, seq, width] for
    # a residual dropout) is by default generated whole on every chip and sliced, so every chip
    # holds the global batch's bits. Measured when attention dropout still drew its
    # u32[global batch, heads, seq, seq] this way (it now hashes positions: flash_dropout.py):
    # 3 GiB per chip for GPT-2 124M on v5e:4x4 (4 x 1024 tokens per chip), 16 x more on
    # v5e-256. With this flag each chip draws only its shard, from the key offset by its
    # partition id: those masks then depend on the chip count (the same seed on the same
    # topology draws the same ones).
    "xla_tpu_spmd_rng_bit_generator_unsafe": "true",
}


def flag_names(args: str) -> set[str]:
    """The flag names set in a ``LIBTPU_INIT_ARGS`` string: ``--name=value``, ``--name value``,
    ``--name`` and absl's ``--noname`` (a boolean set false)."""
    names = set()
    for token in args.split():
        if not token.startswith("-"):
            continue  # a value after "--name"
        name = token.lstrip("-").split("=", 1)[0]
        names.add(name)
        if name.startswith("no"):
            names.add(name[2:])
    return names


def merged(user_args: str, flags: dict[str, str] | None = None) -> str:
    """``user_args`` followed by each of ``flags`` the user did not set."""
    flags = FLAGS if flags is None else flags
    mine = flag_names(user_args)
    added = [f"--{name}={value}" for name, value in flags.items() if name not in mine]
    return " ".join(part for part in (user_args.strip(), *added) if part)


def enabled(environ=None) -> bool:
    """Whether spmdzero's flags apply: ``SPMDZERO_LIBTPU_FLAGS`` unset, 1 or 0."""
    value = (os.environ if environ is None else environ).get(OPT_OUT, "1").strip().lower()
    if value not in ("0", "1", "true", "false", ""):
        raise ValueError(f"{OPT_OUT}={value!r}: use 1 (apply spmdzero's libtpu flags, the default) or 0 (none)")
    return value in ("1", "true", "")


def apply(environ=None) -> str:
    """Set ``LIBTPU_INIT_ARGS`` in ``environ`` (``os.environ``) to the user's flags plus
    spmdzero's, unless ``SPMDZERO_LIBTPU_FLAGS=0``; return it. Call before libtpu loads."""
    environ = os.environ if environ is None else environ
    user = environ.get("LIBTPU_INIT_ARGS", "")
    args = merged(user) if enabled(environ) else user.strip()
    if args or "LIBTPU_INIT_ARGS" in environ:
        environ["LIBTPU_INIT_ARGS"] = args
    return args
