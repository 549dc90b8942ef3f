"""Layer ``optim``: the math of an optimizer step. Update rules written once over an array
namespace (``optimizers``), DeepSpeed's LR schedules (``schedules``), and mixed precision with
loss scaling (``precision``). It may import ``sharding``, ``config`` and ``runtime``; a
backend passes in its own whole-group update (torch_xla's fused op).
"""
