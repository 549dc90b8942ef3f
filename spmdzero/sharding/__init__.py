"""Layer ``sharding``: what is split how, as pure data. Mesh shapes and axes (``mesh``), the
per-parameter plan of ZeRO layouts (``plan``) and DeepSpeed's batch arithmetic (``batch``).
No devices: nothing here imports torch_xla or JAX. It may import ``config``.
"""
