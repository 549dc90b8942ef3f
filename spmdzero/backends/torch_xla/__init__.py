"""The torch_xla backend: the engine over torch_xla's lazy tensors (``engine``; its gradient
slots ``gradients``, its boundary update ``update``, its state protocol ``state``), its build
pipeline (``build``), the sharding annotations (``annotate``), the fused update op
(``fused``), layers traced once (``scan``), device batches (``batches``), meshes (``mesh``)
and the device side of checkpoints (``checkpoint``). Importing this package itself imports no
torch_xla (an optional install): its modules do.
"""

COMPILE_BACKEND = "openxla"  # torch_xla's dynamo backend: what engine.compile() and the accelerator name
