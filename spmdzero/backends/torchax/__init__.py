"""The torchax backend: the module traced once by JAX through torchax (``engine``), its
build pipeline (``build``), layers traced once (``scan``) and the device side of checkpoints
(``checkpoint``)."""
