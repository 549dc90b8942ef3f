"""The tensors the engine hands back to the script (torchax tensors over JAX arrays), the ops a
script runs on them, and the script's own host tensors beside them."""
