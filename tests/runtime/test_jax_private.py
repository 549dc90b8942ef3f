"""JAX's internals are reached from one module, and each one it reaches exists in the installed
JAX: `make test` runs this file on both stacks (jax 0.7.1 and 0.10.2)."""

import pathlib
import re

import pytest

import spmdzero
from spmdzero.runtime import jax_private

PACKAGE = pathlib.Path(spmdzero.__file__).parent


def test_no_module_but_jax_private_imports_jax_internals():
    """``jax._src`` moves between releases: one module holds every use, so that a new JAX breaks
    there or nowhere."""
    found = [f"{path.relative_to(PACKAGE)}:{number}"
             for path in PACKAGE.rglob("*.py") if path.name != "jax_private.py"
             for number, line in enumerate(path.read_text().splitlines(), 1)
             if re.search(r"\bjax\._src\b|from jax import _src|jax_src", line.split("#")[0])
             and not line.lstrip().startswith(("#", '"', "'"))]
    assert not found, found


def test_every_internal_it_reaches_exists_in_this_jax():
    import jax
    from jaxlib import xla_client as xc

    jax.devices()
    assert jax_private.backends_started() is True
    index, count = jax_private.joined_process()
    assert (index, count) == (0, 1) or count >= 1
    assert jax_private.on_cloud_tpu_vm() is False  # no TPU here
    with jax_private.mosaic_ir_version_at_most(7):
        pass
    client = xc.make_cpu_client()
    cost = jax_private.hlo_cost_analysis(client, """HloModule m

ENTRY %main (a: f32[64,64], b: f32[64,64]) -> f32[64,64] {
  %a = f32[64,64]{1,0} parameter(0)
  %b = f32[64,64]{1,0} parameter(1)
  ROOT %dot = f32[64,64]{1,0} dot(%a, %b), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
""")
    assert cost["flops"] == pytest.approx(2 * 64**3)


def test_a_module_compiles_through_the_clients_own_method():
    """``compile_module`` on a live CPU client: the path ``spmdzero aot --topology cpu:N`` and
    the per-loop cost take, whichever form (bytecode or module) this jaxlib's client takes."""
    import jax
    import jax.interpreters.mlir as mlir
    import jax.numpy as jnp
    import numpy as np
    from jax.extend.backend import get_compile_options

    devices = jax.devices("cpu")[:2]
    text = jax.jit(lambda x: x * 2).lower(jax.ShapeDtypeStruct((8,), jnp.float32)).as_text()
    with mlir.make_ir_context():
        module = mlir.ir.Module.parse(text)
        options = get_compile_options(num_replicas=1, num_partitions=1, device_assignment=np.array([[devices[0].id]]),
                                      backend=devices[0].client)
        executable = jax_private.compile_module(devices[0].client, module, devices[:1], options, load=True)
    assert "multiply" in executable.hlo_modules()[0].to_string()
