"""transformers 4.x's padding masks of state-space and linear-attention layers, without reading them.

Why: transformers 4.x's hybrid models (Bamba, Falcon-H1, Granite 4.0's GraniteMoeHybrid, Jamba,
Qwen3-Next) skip their Mamba or gated-delta layers' padding mask when it is all ones:
``if cache_position[0] > 0 or torch.all(attention_mask == 1): mask = None``. Under ``jax.jit``
that is a host read, so the whole training step of each ran eagerly (``host_reads``).
transformers 5.x decides it without reading in a trace (``create_recurrent_attention_mask``).

While a step is traced (``kept``), their ``_update_mamba_mask`` / ``_update_linear_attn_mask``
keep the mask as given, for a forward over as many positions as the mask holds (training and
evaluation, no cache), where transformers would drop an all-ones mask: the layers multiply their
states by the mask, and by ones that changes nothing. A forward that continues from a cache (fewer
positions than the mask) gets no mask, as in transformers. The mask of a decoding step is never
read either: its length is a shape.
"""

from __future__ import annotations

import contextlib

import torch

from spmdzero.backends.torchax.patches import transformers_methods


def _kept(original):
    def update(self, attention_mask, cache_position: torch.Tensor):
        if attention_mask is None or attention_mask.dim() != 2 or cache_position.shape[0] != attention_mask.shape[1]:
            return None
        return attention_mask

    return update


# transformers 4.x's recurrent padding masks (transformers_methods.Replacement)
REPLACED = (
    ("bamba", "BambaModel", "_update_mamba_mask", _kept),
    ("falcon_h1", "FalconH1Model", "_update_mamba_mask", _kept),
    ("granitemoehybrid", "GraniteMoeHybridModel", "_update_mamba_mask", _kept),
    ("jamba", "JambaModel", "_update_mamba_mask", _kept),
    ("qwen3_next", "Qwen3NextModel", "_update_linear_attn_mask", _kept),
)


@contextlib.contextmanager
def patched(trace):
    """While a step is traced: ``REPLACED``'s masks kept, on transformers 4.x."""
    with transformers_methods.replaced(REPLACED if transformers_methods.transformers_4() else ()):
        yield
