"""The torchax engine: its training state (one value), the programs that step it, and the
bookkeeping between them (gradients until their backward, the host module's parameters)."""
