"""The version spmdzero's DeepSpeed layer reports, as ``deepspeed.__version__`` and as the
``deepspeed`` distribution's metadata (``alias.py``): the DeepSpeed release whose API it
mirrors, then ``+spmdzero.<version>``. PEP 440 compares it as that release in version
checks (transformers needs >= 0.9.3), and its local part says whose layer it is."""

from spmdzero.version import __version__ as _spmdzero_version

DEEPSPEED_API_VERSION = "0.19.6"  # the DeepSpeed release whose API the layer mirrors
VERSION = f"{DEEPSPEED_API_VERSION}+spmdzero.{_spmdzero_version}"
