"""The torchax backend: the module traced once by JAX through torchax (``engine``) and its
build pipeline (``build``)."""
