"""Layer ``cli``, the top: the ``spmdzero`` command (``main``), ``spmdzero launch``
(``launch``) and ``spmdzero config check`` (``config_check``). Nothing imports it but the
console script and ``python -m spmdzero``.
"""
