"""transformers' causal and bidirectional masks handed to the flash kernel as what they are:
causality, key padding, packed-sequence ids.

Why: inside a trace transformers cannot read a mask's values, so it never skips the mask: a
decoder's SDPA gets a dense ``[batch, 1, L, S]`` boolean mask (Llama at 4k tokens, 16 rows: 256
MiB of mask, and the exact path's 4 GiB of scores per head group). The mask is always one of a few
structures, built in ``masking_utils.create_causal_mask``: causal; causal and the batch's 2D
``attention_mask`` (key padding); causal and packed-sequence ids (from ``position_ids``, which
Llama-style models always pass). 5.x's encoders (BERT) build theirs in
``create_bidirectional_mask``: key padding alone. The flash kernel takes each of these as
segment ids.

While a step that runs the flash kernel is traced (``attention.choosing``), this module wraps
transformers' ``"sdpa"`` mask function and ``"sdpa"`` attention function:

* the mask is still built as transformers builds it, and the structure it came from is attached
  to it (``_spmdzero_flash``): only a mask made by ``bidirectional_mask_function`` alone, or by
  ``causal_mask_function``, alone or with
  packed-sequence ids (``and_masks``, ``packed_sequence_mask_function`` and 5.x's
  ``remap_positions_for_packed_sequence`` are wrapped to remember their parts), with queries and
  keys of one length and no offset or window;
* the attention function sends a mask carrying that structure to the kernel; the dense mask is
  then unused and XLA drops it. Any other mask (sliding windows, offsets, a mask the model
  changed on the way, whose attribute is then gone) takes transformers' own path unchanged.
"""

from __future__ import annotations

import contextlib
import sys
from types import SimpleNamespace

_TAG = "_spmdzero_flash"


@contextlib.contextmanager
def structured(call_kernel):
    """transformers' "sdpa" mask and attention functions as this module says, while traced.
    ``call_kernel(module, query, key, value, structure, dropout, scaling)`` runs the kernel
    (``None``: it declined, transformers' own path runs)."""
    masking = sys.modules.get("transformers.masking_utils")
    modeling = sys.modules.get("transformers.modeling_utils")
    if masking is None or modeling is None or not hasattr(masking, "ALL_MASK_ATTENTION_FUNCTIONS"):
        yield
        return
    masks = masking.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
    functions = modeling.ALL_ATTENTION_FUNCTIONS._global_mapping
    if "sdpa" not in masks or "sdpa" not in functions:
        yield
        return
    saved = dict(and_masks=masking.and_masks, packed=masking.packed_sequence_mask_function, mask=masks["sdpa"],
                 attention=functions["sdpa"], remap=getattr(masking, "remap_positions_for_packed_sequence", None))

    def and_masks(*parts):
        combined = saved["and_masks"](*parts)
        combined._spmdzero_parts = parts
        return combined

    def packed_sequence_mask_function(ids):
        inner = saved["packed"](ids)
        inner._spmdzero_segments = ids
        return inner

    def remap_positions_for_packed_sequence(function, position_ids):
        # 5.x: causality by position within each packed sequence, which is by index there
        remapped = saved["remap"](function, position_ids)
        remapped._spmdzero_remapped = function
        return remapped

    def sdpa_mask(*args, **kwargs):
        mask = saved["mask"](*args, **kwargs)
        structure = _structure(masking, kwargs) if not args else None
        if structure is not None and mask is not None:
            setattr(mask, _TAG, structure)
        return mask

    def sdpa_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None,
                       **kwargs):
        structure = getattr(attention_mask, _TAG, None)
        if structure is not None and kwargs.get("position_bias") is None and not kwargs.get("softcap"):
            out = call_kernel(module, query, key, value, structure, dropout, scaling)
            if out is not None:
                return out.transpose(1, 2).contiguous(), None
        return saved["attention"](module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                  is_causal=is_causal, **kwargs)

    masking.and_masks, masking.packed_sequence_mask_function = and_masks, packed_sequence_mask_function
    if saved["remap"] is not None:
        masking.remap_positions_for_packed_sequence = remap_positions_for_packed_sequence
    masks["sdpa"], functions["sdpa"] = sdpa_mask, sdpa_attention
    try:
        yield
    finally:
        masking.and_masks, masking.packed_sequence_mask_function = saved["and_masks"], saved["packed"]
        if saved["remap"] is not None:
            masking.remap_positions_for_packed_sequence = saved["remap"]
        masks["sdpa"], functions["sdpa"] = saved["mask"], saved["attention"]


def _structure(masking, kwargs: dict):
    """The kernel's view of the mask ``create_causal_mask`` asked for, or None. Both of
    transformers' signatures: 5.x gives ``q_length``/``q_offset``, 4.x ``cache_position``."""
    function = kwargs.get("mask_function", masking.causal_mask_function)
    parts = getattr(function, "_spmdzero_parts", (function,))
    if len(parts) > 2:
        return None
    segments = None
    if len(parts) == 2:
        segments = getattr(parts[1], "_spmdzero_segments", None)
        if segments is None:
            return None
    # by position ids within packed sequences (5.x): by index there, packed ids being given
    base = (getattr(parts[0], "_spmdzero_remapped", None) if segments is not None else None) or parts[0]
    if base is masking.causal_mask_function:
        causal = True
    elif base is getattr(masking, "bidirectional_mask_function", None) and segments is None:
        causal = False  # 5.x's encoders (BERT, RoBERTa, ...): key padding at most
    else:
        return None
    cache_position = kwargs.get("cache_position")
    q_length = kwargs.get("q_length", None if cache_position is None else cache_position.shape[0])
    kv_length = kwargs.get("kv_length")
    if q_length is None or q_length != kv_length or kwargs.get("local_size") is not None:
        return None
    if any(not isinstance(kwargs.get(k, 0), int) or kwargs.get(k, 0) != 0 for k in ("q_offset", "kv_offset")):
        return None
    padding = kwargs.get("attention_mask")
    if padding is not None and (padding.dim() != 2 or padding.shape[-1] != kv_length):
        return None
    return SimpleNamespace(causal=causal, segments=segments, key_padding=padding)


def carried(originals: list, views: list) -> list:
    """``views`` (a ``scan_layers`` loop's own tensors for ``originals``, the layer's arguments)
    with the structure a mask carried outside the loop: the loop body's mask is a new tensor."""
    for original, view in zip(originals, views):
        structure = getattr(original, _TAG, None)
        if structure is not None:
            setattr(view, _TAG, structure)
    return views
