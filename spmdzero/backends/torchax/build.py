"""The torchax backend's build pipeline (``spmdzero.initialize`` with ``spmd.backend:
"torchax"``, the default): the same batch arithmetic, plan and return value as torch_xla's, the
JAX mesh, and the module's checks (batch norms it can update, sparse gradients)."""

from __future__ import annotations
from typing import Optional
import torch
from spmdzero.config.errors import ConfigError
from spmdzero.config.schema import DeepSpeedConfig
from spmdzero.sharding.mesh import check_user_mesh, global_shape, mesh_shape, resolve_hybrid_shape, resolve_mesh_shape
from spmdzero.backends.torchax.patches import batchnorm
from spmdzero.backends.torchax.engine.engine import TorchaxEngine
from spmdzero.backends.torchax.engine.mesh import user_mesh_devices
from spmdzero.backends.torchax.engine.scan import apply_scan_layers, lay_out_gradients
from spmdzero.train.build import refuse_sparse_gradients, setup_training
from spmdzero import runtime
from spmdzero.runtime import jax_runtime


def _require_torchax() -> None:
    """torch_xla 2.9's wheel carries an older torchax copy (it imports flax) in the same
    ``torchax/`` folder: installed after torchax 0.0.13, it overwrites its files, while pip still
    lists 0.0.13. That case gets the command that repairs it, not a bare ImportError."""
    try:
        import torchax  # noqa: F401
    except ImportError as err:
        files, listed = _torchax_versions()
        if files is not None and listed is not None and files != listed:
            raise ConfigError(f"spmd.backend='torchax' needs torchax {TORCHAX_VERSION}: pip lists torchax {listed}, but "
                              f"the files installed are torchax {files}, the copy torch_xla's wheel carries ({err}), "
                              "which overwrote them. Repair with: pip install --force-reinstall --no-deps "
                              f"torchax=={TORCHAX_VERSION}") from err
        raise ConfigError(f"spmd.backend='torchax' needs the torchax package ({err}): "
                          f"pip install torchax=={TORCHAX_VERSION} (a dependency of spmdzero)") from err


TORCHAX_VERSION = "0.0.13"  # pyproject.toml's pin


def _torchax_versions() -> tuple[Optional[str], Optional[str]]:
    """(the version torchax's installed ``__init__.py`` says, the version pip's metadata lists),
    each None when unknown; nothing is imported."""
    import importlib.metadata
    import importlib.util
    import re

    try:
        spec = importlib.util.find_spec("torchax")
        with open(spec.origin, encoding="utf-8") as f:
            found = re.search(r"""^__version__\s*=\s*["']([^"']+)["']""", f.read(), re.M)
        files = found.group(1) if found else None
    except (ImportError, AttributeError, TypeError, OSError, ValueError):
        files = None
    try:
        listed = importlib.metadata.version("torchax")
    except importlib.metadata.PackageNotFoundError:
        listed = None
    return files, listed


def build(model: torch.nn.Module, cfg: DeepSpeedConfig, mesh=None, optimizer=None, model_parameters=None,
          training_data=None, lr_scheduler=None, collate_fn=None, config_dict: Optional[dict] = None,
          shape_only_devices: Optional[int] = None):
    """``spmdzero.initialize`` for this backend: the same batch arithmetic, plan and return value.

    ``shape_only_devices`` (``spmdzero.aot``): a shape-only engine for that many devices, on an
    abstract mesh, one process; its state is ``jax.ShapeDtypeStruct``s, nothing is placed, and
    its step is traced (``TorchaxEngine.trace_step``), never run. The model's parameters may be
    on the ``meta`` device."""

    _require_torchax()
    refuse_sparse_gradients(model)
    batchnorm.check_replaceable(model)  # the others' running statistics are updated as torch does
    shape_only = shape_only_devices is not None
    devices = None  # the mesh's devices in order: JAX's, or a given mesh's
    if shape_only:  # a topology this machine need not have: the mesh the config gives on that many chips
        if cfg.spmd.dcn_mesh is not None:
            raise ConfigError("spmd.dcn_mesh: the TPU compile (spmdzero aot) of the torchax backend compiles for one "
                              "slice; remove spmd.dcn_mesh from the config given to it")
        if mesh is not None:
            raise ValueError("a shape-only engine's mesh is the config's (spmd.mesh), not initialize(mesh=...)")
        shape = resolve_mesh_shape(cfg.spmd.mesh, shape_only_devices)
        process_index, process_count = 0, 1
    else:
        if cfg.spmd.compile_cache_dir:  # before this engine's first program compiles
            jax_runtime.enable_compile_cache(cfg.spmd.compile_cache_dir)
        if mesh is not None:
            check_user_mesh(mesh, ("jax", "torch_xla"))
            if cfg.spmd.mesh is not None or cfg.spmd.dcn_mesh is not None:
                raise ValueError("a mesh was given twice: as initialize(mesh=...) and in the config's 'spmd' section")
            shape = mesh_shape(mesh)
            devices = user_mesh_devices(mesh, runtime.device_count())
        elif cfg.spmd.dcn_mesh is not None:  # data across slices, the rest within one (backends/torchax/engine/mesh.py)
            ici, dcn = resolve_hybrid_shape(cfg.spmd.mesh, cfg.spmd.dcn_mesh, runtime.device_count())
            shape = global_shape(ici, dcn)
        else:
            shape = resolve_mesh_shape(cfg.spmd.mesh, runtime.device_count())
        process_index, process_count = runtime.hosts()
        if process_count > 1 and not jax_runtime.selected():
            raise RuntimeError(f"spmd.backend='torchax' on {process_count} hosts needs {jax_runtime.VARIABLE}=torchax "
                               "before `import spmdzero` (JAX then joins the hosts into one mesh; see "
                               "docs/multihost.md); this process runs torch_xla's runtime")
    setup = setup_training(model, cfg, shape, _TorchaxBuild(model), process_index=process_index,
                           process_count=process_count, optimizer=optimizer, model_parameters=model_parameters,
                           lr_scheduler=lr_scheduler, training_data=training_data, collate_fn=collate_fn)
    engine = TorchaxEngine(model, setup.optimizer, setup.scheduler, cfg, setup.batch, setup.plan, shape,
                           shape_only_devices or runtime.device_count(), setup.loader, config_dict, devices=devices,
                           shape_only=shape_only)
    if cfg.spmd.scan_layers:  # before the first forward traces the loop
        lay_out_gradients(model, engine.mesh, setup.plan)
    return engine, engine.optimizer, setup.loader, setup.scheduler


class _TorchaxBuild:
    """What ``setup_training`` asks of this backend (``train.build.BuildBackend``)."""

    even = True  # JAX shards only dims that divide by the axis size (a 10-class head on 8 devices)

    def scan_layers(self, module: torch.nn.Module, cfg: DeepSpeedConfig) -> dict:
        """The block stack as one ``jax.lax.scan`` (``engine/scan.py``)."""
        return apply_scan_layers(module, cfg.spmd.scan_layers, cfg.spmd.remat)

    def __init__(self, model: torch.nn.Module):
        self._model = model

    def prepare_optimizer(self, optimizer) -> None:
        """This backend runs the optimizer over the module's parameters: spmdzero's as JAX
        functions, a torch.optim one's own step traced (``optim/torch_optim.py``)."""
        members = {id(p) for p in self._model.parameters()}  # after scan_layers stacked them
        for i, group in enumerate(optimizer.param_groups):
            strays = [tuple(p.shape) for p in group["params"] if id(p) not in members]
            if strays:
                raise ValueError(f"spmd.backend='torchax' trains the module's parameters only: param group {i} of "
                                 f"model_parameters holds {len(strays)} tensor(s) that are not parameters of the "
                                 f"model (shapes {strays[:3]}); register them on the module (nn.Parameter) or use "
                                 "spmd.backend='torch_xla'")

    def batch_placement(self, plan, batch):
        return None  # batches stay on the host; the engine's forward places them
