"""``import deepspeed`` (and every ``deepspeed.X``) resolves to ``spmdzero.compat.deepspeed``.

A meta-path finder placed first maps each ``deepspeed[.X]`` name to the same module object
as ``spmdzero.compat.deepspeed[.X]``, so a script and all of its helper modules share one
set of modules, whichever name imported them first. Names of DeepSpeed features spmdzero
does not provide (pipeline parallelism, MoE layers, inference...) raise
``UnsupportedFeatureError``, an ImportError that names the feature.

The same finder also answers ``importlib.metadata`` for the distribution ``deepspeed``.
Hugging Face transformers and accelerate check for DeepSpeed by its installed metadata
(``importlib.metadata.version("deepspeed")``, ``dep_version_check``), not only by import,
so without it ``TrainingArguments(deepspeed=...)`` stops before training. The version says
what it is: DeepSpeed's API release followed by ``+spmdzero.<version>``. It exists only in
a process where the alias is installed (``spmdzero launch``, ``spmdzero.alias_deepspeed()``).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.metadata
import importlib.util
import pathlib
import sys

from spmdzero.runtime import jax_runtime

from . import hugging_face
from .deepspeed_version import VERSION

ALIAS = "deepspeed"
TARGET = "spmdzero.compat.deepspeed"


class _SameModule(importlib.abc.Loader):
    """Hands the already imported compat module to the import system under the alias name."""

    def __init__(self, module):
        self.module = module
        self.spec = module.__spec__

    def create_module(self, spec):
        return self.module

    def exec_module(self, module):
        module.__spec__ = self.spec  # the import system set the alias's spec; keep the module's own


class _CompatDistribution(importlib.metadata.Distribution):
    """The metadata of the ``deepspeed`` distribution as spmdzero's layer presents it: a name,
    a version and a summary; no files (nothing is installed under that name)."""

    def read_text(self, filename):
        if filename != "METADATA":
            return None
        return ("Metadata-Version: 2.1\nName: deepspeed\n"
                f"Version: {VERSION}\n"
                "Summary: spmdzero's DeepSpeed compatibility layer (not DeepSpeed): ZeRO-1/2 on XLA devices\n")

    def locate_file(self, path):
        return pathlib.Path(__file__).parent / "deepspeed" / path


def _names_deepspeed(name) -> bool:
    return name is not None and name.replace("-", "_").replace(".", "_").lower() == ALIAS


class DeepSpeedAlias(importlib.abc.MetaPathFinder):
    def find_distributions(self, context=importlib.metadata.DistributionFinder.Context()):
        """``importlib.metadata`` asks every meta-path finder: answer for ``deepspeed`` only
        (a query for all distributions, name None, is left to the real installs)."""
        return iter([_CompatDistribution()]) if _names_deepspeed(context.name) else iter(())

    def find_spec(self, fullname, path=None, target=None):
        if fullname != ALIAS and not fullname.startswith(ALIAS + "."):
            return None
        from .deepspeed._unsupported import check_supported

        check_supported(fullname)
        real = TARGET + fullname[len(ALIAS):]
        try:
            module = importlib.import_module(real)
        except ModuleNotFoundError as err:
            if err.name != real:
                raise
            raise ModuleNotFoundError(f"No module named {fullname!r}: spmdzero's DeepSpeed compatibility layer does "
                                      "not provide it (see docs/migrating.md for what it does)", name=fullname) from None
        return importlib.util.spec_from_loader(fullname, _SameModule(module), is_package=hasattr(module, "__path__"))


def _is_ours(module) -> bool:
    return getattr(module, "__name__", "").startswith(TARGET)


def install() -> None:
    """Make ``deepspeed`` resolve to spmdzero's compatibility layer in this process, and send
    Hugging Face's Trainer and accelerate down their DeepSpeed path (``hugging_face``).
    Idempotent; refused when the real DeepSpeed is already imported."""
    real = sorted(name for name, module in sys.modules.items()
                  if (name == ALIAS or name.startswith(ALIAS + ".")) and module is not None and not _is_ours(module))
    if real:
        where = getattr(sys.modules[real[0]], "__file__", None) or "?"
        raise RuntimeError(f"the real DeepSpeed is already imported in this process ({real[0]!r} from {where}); "
                           "spmdzero cannot alias `deepspeed` over it. Alias before anything imports deepspeed "
                           "(call spmdzero.alias_deepspeed() first, or run the script with `spmdzero launch`).")
    if not any(isinstance(finder, DeepSpeedAlias) for finder in sys.meta_path):
        sys.meta_path.insert(0, DeepSpeedAlias())
        hugging_face.route_to_deepspeed("torchax" if jax_runtime.selected() else "torch_xla")


def installed() -> bool:
    return any(isinstance(finder, DeepSpeedAlias) for finder in sys.meta_path)
