"""Layer ``tpu``: the TPU side, reachable from any machine. Capture an engine's step as
StableHLO (``capture``), compile it with libtpu's compile-only client (``compile``), move its
shardings onto a larger topology (``retarget``), and report per-chip memory and collectives
(``report``, ``chips``). It may import ``observe`` and the layers below it.
"""
