"""torch ops on JAX where torchax's own lowering gives other values or other memory than torch:
attention (exact and flash), dropout, cross-entropy, autocast, activation checkpointing, custom
autograd Functions, and what a trace must know without reading the devices."""
