"""The torchax backend: the module traced once by JAX through torchax (``engine``), its
build pipeline (``build``) and the device side of checkpoints (``checkpoint``)."""
