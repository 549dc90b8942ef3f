"""The torchax engine's programs as plain functions: the training state (``train_state``), the
forward, training and VJP programs (``forward``), the backward of a loss computed outside the
module (``backward``), the update at the boundary (``update``), each built by a ``build_*``
function from what it needs, named (``setup.ProgramSetup``, ``update.UpdateSetup``). The
engine (``engine/``) holds the state, keeps the programs by key and calls them."""
