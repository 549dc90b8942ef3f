"""The HBM traffic of a compiled program from the memory spaces in its HLO
(``spmdzero/tpu/hbm_traffic.py``): held to programs whose traffic is known, compiled for a
TPU, and to the memory-space cases XLA's cost analysis counts three times."""

import pytest

from spmdzero.tpu.hbm_traffic import hbm_bytes

MIB = 2**20

# a layer's cache prefetched into on-chip memory (S(1)) by an async slice and a copy, read
# there by a fusion; a one-slot in-place update of another array in HBM
PREFETCHED = """HloModule m

%fused_read (param_0: bf16[1024,1024]) -> f32[1024] {
  %param_0 = bf16[1024,1024]{1,0:T(8,128)(2,1)S(1)} parameter(0)
  %convert = f32[1024,1024]{1,0:T(8,128)S(1)} convert(%param_0)
  %zero = f32[]{:T(128)} constant(0)
  ROOT %reduce = f32[1024]{0:T(1024)S(1)} reduce(%convert, %zero), dimensions={1}, to_apply=%add
}

%fused_update (param_0.1: bf16[1024,1024], param_1.1: bf16[1,1024], param_2.1: s32[]) -> bf16[1024,1024] {
  %param_0.1 = bf16[1024,1024]{1,0:T(8,128)(2,1)} parameter(0)
  %param_1.1 = bf16[1,1024]{1,0:T(2,128)(2,1)} parameter(1)
  %param_2.1 = s32[]{:T(128)} parameter(2)
  %zero.1 = s32[]{:T(128)} constant(0)
  ROOT %dynamic-update-slice = bf16[1024,1024]{1,0:T(8,128)(2,1)} dynamic-update-slice(%param_0.1, %param_1.1, %param_2.1, %zero.1)
}

%add (x: f32[], y: f32[]) -> f32[] {
  %x = f32[]{:T(128)} parameter(0)
  %y = f32[]{:T(128)} parameter(1)
  ROOT %sum = f32[]{:T(128)} add(%x, %y)
}

ENTRY %main (p0: bf16[1024,1024], p1: bf16[1024,1024], p2: bf16[1,1024], p3: s32[]) -> (f32[1024], bf16[1024,1024]) {
  %p0 = bf16[1024,1024]{1,0:T(8,128)(2,1)} parameter(0)
  %p1 = bf16[1024,1024]{1,0:T(8,128)(2,1)} parameter(1)
  %p2 = bf16[1,1024]{1,0:T(2,128)(2,1)} parameter(2)
  %p3 = s32[]{:T(128)} parameter(3)
  %slice-start = ((bf16[1024,1024]{1,0:T(8,128)(2,1)}), bf16[512,1024]{1,0:T(8,128)(2,1)S(1)}, s32[]{:S(2)}) slice-start(%p0), slice={[0:512], [0:1024]}
  %slice-start.1 = ((bf16[1024,1024]{1,0:T(8,128)(2,1)}), bf16[512,1024]{1,0:T(8,128)(2,1)S(1)}, s32[]{:S(2)}) slice-start(%p0), slice={[512:1024], [0:1024]}
  %slice-done = bf16[512,1024]{1,0:T(8,128)(2,1)S(1)} slice-done(%slice-start)
  %slice-done.1 = bf16[512,1024]{1,0:T(8,128)(2,1)S(1)} slice-done(%slice-start.1)
  %joined = bf16[1024,1024]{1,0:T(8,128)(2,1)S(1)} custom-call(%slice-done, %slice-done.1), custom_call_target="ConcatBitcast"
  %read = f32[1024]{0:T(1024)S(1)} fusion(%joined), kind=kLoop, calls=%fused_read
  %copy-start = (f32[1024]{0:T(1024)}, f32[1024]{0:T(1024)S(1)}, u32[]{:S(2)}) copy-start(%read)
  %copy-done = f32[1024]{0:T(1024)} copy-done(%copy-start)
  %updated = bf16[1024,1024]{1,0:T(8,128)(2,1)} fusion(%p1, %p2, %p3), kind=kLoop, calls=%fused_update
  ROOT %tuple = (f32[1024]{0:T(1024)}, bf16[1024,1024]{1,0:T(8,128)(2,1)}) tuple(%copy-done, %updated)
}
"""


def test_bytes_in_on_chip_memory_and_in_place_updates_are_not_hbm_traffic():
    """The prefetched array is read from HBM once (its two slices), not again where the fusion
    reads it on chip; the result is written to HBM once by its copy; the in-place update writes
    one row and reads its update, not the array."""
    row = 1024 * 2
    expected = 2 * MIB + 1024 * 4 + (row + row) + 4  # and the slot, a scalar in HBM
    assert hbm_bytes(PREFETCHED) == expected


@pytest.fixture(scope="module")
def compiled():
    """Small programs with known traffic, compiled for v5e:2x2 (each chip holds a quarter)."""
    jax = pytest.importorskip("jax")
    import jax.numpy as jnp
    from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec as P

    from spmdzero.runtime.jax_runtime import shardy_partitioner
    from spmdzero.tpu.capture import compile_mlir

    pytest.importorskip("libtpu")
    mesh = AbstractMesh((4,), ("x",))

    def lowered(f, *args, donate=()):
        # Shardy's annotations, as aot lowers its programs: a process where torch_xla used JAX
        # (an earlier test on this worker) has it switched off, and the GSPMD module compiled
        # with every array replicated
        with shardy_partitioner(True):
            return jax.jit(f, donate_argnums=donate).trace(*args).lower(lowering_platforms=("tpu",)).as_text()

    big = jax.ShapeDtypeStruct((4096, 4096), jnp.float32, sharding=NamedSharding(mesh, P("x", None)))
    cache = jax.ShapeDtypeStruct((4, 64, 4096, 128), jnp.bfloat16, sharding=NamedSharding(mesh, P("x")))
    row = jax.ShapeDtypeStruct((4, 64, 1, 128), jnp.bfloat16, sharding=NamedSharding(mesh, P("x")))

    def update(c, r):
        return jax.lax.dynamic_update_slice(c, r, (0, 0, 7, 0))

    def read_then_update(c, r):
        return jnp.einsum("bhsd,bhtd->bhs", c, r), update(c, r)

    def looped(x):  # five trips, each reading and writing the quarter (too large to stay on chip)
        return jax.lax.fori_loop(0, 5, lambda i, y: jnp.sin(y) * i, x)

    huge = jax.ShapeDtypeStruct((16384, 16384), jnp.float32, sharding=NamedSharding(mesh, P("x", None)))

    programs = {"elementwise": lowered(lambda x: x * 2 + 1, big), "sum": lowered(lambda x: x.sum(), big),
                "looped": lowered(looped, huge),
                "update": lowered(update, cache, row, donate=(0,)),
                "read_then_update": lowered(read_then_update, cache, row, donate=(0,))}
    return {name: compile_mlir(mlir, "v5e:2x2", (), fixed_outputs=True) for name, mlir in programs.items()}


@pytest.mark.slow
def test_compiled_programs_move_the_bytes_they_must(compiled):
    """Per chip: an elementwise op reads and writes its quarter (16 MiB each), a sum reads it, a
    donated one-slot update moves the slot, and attention-like reads before the update read the
    cache (64 MiB) once."""
    assert compiled["elementwise"]["hbm_bytes"] == pytest.approx(32 * MIB, rel=0.01)
    assert compiled["sum"]["hbm_bytes"] == pytest.approx(16 * MIB, rel=0.01)
    assert compiled["update"]["hbm_bytes"] < MIB
    assert compiled["looped"]["loops"] == [5]
    # each trip counted, and the copy of the input the loop may not update in place
    assert 5 * 512 * MIB <= compiled["looped"]["hbm_bytes"] <= 6 * 512 * MIB + MIB
    assert compiled["read_then_update"]["hbm_bytes"] == pytest.approx(64 * MIB, rel=0.02)
    for report in (compiled[name] for name in ("elementwise", "sum", "update", "read_then_update")):  # where nothing is prefetched on chip, the cost analysis agrees
        assert report["hbm_bytes"] <= report["cost"]["bytes accessed"] * 1.01
