"""Layer ``backends``: the two ways a step runs. ``torch_xla``: the module re-traced by torch_xla
every step, one lazy graph compiled once. ``torchax``: the module traced once under ``jax.jit``.
Each has a ``build`` module (config, mesh, plan, optimizer into an engine) and an ``engine``.
The two never import each other; both may import ``train`` and everything below it.
"""
