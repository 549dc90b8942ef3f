"""The torchax backend: the module traced once by JAX through torchax. Its folders, by concern:

* ``engine/``: the engine, its training state and its programs (forward, backward, update);
* ``patches/``: model families' forwards made traceable (one module a family, entered together);
* ``lowering/``: torch ops on JAX where torchax's own lowering does not serve;
* ``outputs/``: the tensors handed back to the script, and its host tensors beside them;
* ``optim/``: torch.optim optimizers traced into the update, and their state dicts.

``build`` is the backend's entry: ``spmdzero.initialize`` calls it."""
