"""Layer ``train``: what every backend shares. DeepSpeed's engine API over a backend's step
(``engine_base``), the build pipeline's pieces (``build``), and host batches (``data``). It may
import ``io``, ``tpu``, ``observe`` and the layers below them, never a backend.
"""
