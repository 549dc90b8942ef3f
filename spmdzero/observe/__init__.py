"""Layer ``observe``: what a run tells its user. Step logs, monitors and the recompile guard
(``monitor``), the console they print on (``console``), sharding and memory reports from live
tensors (``reports``), and the parser of compiled HLO text (``hlo``). It may import ``optim``,
``sharding``, ``config`` and ``runtime``.
"""
