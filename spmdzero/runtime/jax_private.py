"""The JAX internals spmdzero reaches, in one module: each one has no public API that does
the same, and each is checked here on every JAX version spmdzero is tested on (0.7.1 and
0.10.2, the two ends of ``make test``). A JAX release that moves one breaks here, in one place
(tests/test_jax_private.py resolves every name), not deep inside a step.

Everything else in spmdzero uses JAX's public API (``jax``, ``jax.extend``,
``jax.interpreters.mlir``, ``jaxlib.xla_client``); tests/test_jax_private.py also refuses
``jax._src`` anywhere but here.
"""

from __future__ import annotations

import contextlib


def backends_started() -> bool:
    """Whether JAX has started its devices. Every public way to ask (``jax.devices()``,
    ``jax.process_count()``) starts them, which must not happen before ``jax.distributed``
    joins the hosts or before the CPU device count is set."""
    from jax._src import xla_bridge

    return xla_bridge.backends_are_initialized()


def joined_process() -> tuple[int, int]:
    """(this process's index, how many) as ``jax.distributed`` joined them, without starting
    the devices (``jax.process_index()`` would)."""
    from jax._src import distributed

    state = distributed.global_state
    return int(state.process_id), int(state.num_processes)


def on_cloud_tpu_vm() -> bool:
    """Whether JAX found TPU chips and libtpu when it was imported (its own test for a TPU VM,
    which no public API exposes)."""
    from jax._src import cloud_tpu_init

    return bool(cloud_tpu_init.running_in_cloud_tpu_vm)


@contextlib.contextmanager
def mosaic_ir_version_at_most(version: int):
    """Pallas kernels serialized at Mosaic IR ``version`` or older, for a libtpu that reads no
    newer. On a TPU VM JAX picks the version from the runtime's build date; a lowering for TPU
    on a machine without one takes JAX's newest, which an older libtpu refuses."""
    from jax._src import tpu_custom_call

    newest = tpu_custom_call.get_ir_version

    def chosen(ctx):
        picked = newest(ctx)
        return version if picked is None else min(picked, version)

    tpu_custom_call.get_ir_version = chosen
    try:
        yield
    finally:
        tpu_custom_call.get_ir_version = newest


def compile_module(client, module, devices: list, options, load: bool):
    """Compile an MLIR module for ``devices`` of ``client``: loaded on a live client (XLA:CPU),
    not loaded on a compile-only one (libtpu's, for a topology). JAX's own entry points for this
    changed between releases (0.7's ``backend_compile`` is gone in 0.10), and so did what the
    client's methods take: the module's bytecode in jaxlib 0.7, the module itself in 0.10 (a
    wrong type is refused before anything compiles)."""
    import jax.interpreters.mlir as mlir
    from jaxlib import xla_client as xc

    method = client.compile_and_load if load else client.compile
    executable_devices = xc.DeviceList(tuple(devices))
    try:
        return method(module, executable_devices, options)
    except TypeError:  # jaxlib 0.7: "incompatible function arguments"
        return method(mlir.module_to_bytecode(module), executable_devices, options)


def hlo_cost_analysis(client, hlo_text: str) -> dict:
    """XLA's cost analysis (FLOPs, bytes accessed) of a program given as HLO text, on
    ``client``. jaxlib exposes both steps only in its extension module, whose layout moved
    (``_xla.hlo_module_from_text`` in 0.7, ``hlo.hlo_module_from_text`` in 0.10)."""
    from jaxlib import xla_client as xc

    hlo = getattr(xc, "hlo", None)
    from_text = getattr(hlo, "hlo_module_from_text", None) or xc._xla.hlo_module_from_text
    return dict(xc._xla.hlo_module_cost_analysis(client, from_text(hlo_text)))


def wrap_with_sharding_op(ctx, value, aval, proto):
    """GSPMD's ``Sharding`` custom call around ``value`` in a lowering rule (torch_xla's
    partitioner reads it; no public lowering helper writes it)."""
    from jax._src.interpreters import mlir

    return mlir.wrap_with_sharding_op(ctx, value, aval, proto)
