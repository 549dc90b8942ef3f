"""A torch.optim optimizer on the torchax backend: its own ``step()`` traced into the update
program, its state dict read from and written to the devices."""
