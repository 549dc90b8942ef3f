"""The torch_xla backend: the engine over torch_xla's lazy tensors (``engine``), its build
pipeline (``build``), the sharding annotations (``annotate``), the fused update op
(``fused``), layers traced once (``scan``), device batches (``batches``), meshes (``mesh``)
and the device side of checkpoints (``checkpoint``).
"""
