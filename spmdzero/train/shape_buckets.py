"""Shape buckets: the sequence lengths a forward's padded inputs take, and its outputs cut back
to the lengths fed.

Why: XLA compiles one program per input shape. Collators that pad each batch to its longest
row (Hugging Face's ``DataCollatorWithPadding``, TRL's SFT collator) give a new length almost
every step, and a 7B step on a TPU is minutes of compiling per length. Serving stacks on TPU
(vLLM-TPU, JetStream) pad to powers of two; so does the engine, by default on the torchax
backend: a dict input that carries an ``attention_mask`` is padded on the host to the next
power of two from 128 (``FLOOR``), at most the model's positions (``model_positions``), with the
mask's zeros and the labels' -100 (``data.PAD_VALUES``), so the loss is unchanged. A run whose
rows reach ``max_length`` then compiles at most ``1 + log2(max_length / 128)`` programs.
``"spmd": {"pad_to_multiple_of": N}`` pads to multiples of N instead, and ``"spmd":
{"shape_buckets": false}`` leaves the lengths as fed.

What the script gets back has the length it fed: every output of ``[rows, padded length, ...]``
is cut back to ``[rows, length fed, ...]`` (``cut_back``, a view of the padded output, so a loss
computed from it reaches the compiled backward with zeros for the padding). The cut runs outside
the compiled step: the step's program sees the bucket's shape only. torch_xla traces the whole
step, the cut included, so there a cut would compile a program per length again: that backend
pads only when asked (``shape_buckets`` true or ``pad_to_multiple_of``), and its outputs keep the
padded length.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.utils import _pytree as torch_pytree

FLOOR = 128  # the smallest bucket: shorter rows cost little to pad, and each bucket is a compile

# config attributes that bound a model's sequence length (learned or fixed position tables); the
# smallest one found is the cap, so that no padded input reaches past any table
_POSITION_LIMITS = ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "max_sequence_length",
                    "seq_length", "max_source_positions", "max_target_positions")
_SUB_CONFIGS = ("text_config", "encoder", "decoder")


# inputs of a vision or speech tower beside the text: their token counts and positions are tied
# to the text's (image tokens, padding images), and the default buckets leave such a batch as fed
# (SmolVLM's padding images gave NaN losses padded); pad_to_multiple_of still pads them
_TOWER_INPUTS = ("pixel_", "image_", "video_", "input_features", "input_values")


def tower_inputs(batch) -> bool:
    """Whether a dict batch carries inputs of a vision or speech tower (``_TOWER_INPUTS``)."""
    return any(isinstance(k, str) and k.startswith(_TOWER_INPUTS) and v is not None for k, v in batch.items())


@dataclass(frozen=True)
class SequenceBuckets:
    """Where a sequence of a given length is padded to: a multiple of ``multiple`` when set,
    else the next power of two from ``FLOOR``, at most ``cap`` (a longer one is left as it is:
    the model refuses it itself)."""

    multiple: Optional[int] = None
    cap: Optional[int] = None

    def length(self, fed: int) -> int:
        if self.multiple:
            return fed + -fed % self.multiple
        if self.cap is not None and fed >= self.cap:
            return fed
        bucket = max(FLOOR, 1 << max(fed - 1, 0).bit_length())
        return bucket if self.cap is None else min(bucket, self.cap)

    def describe(self) -> str:
        if self.multiple:
            return f"multiples of {self.multiple} (spmd.pad_to_multiple_of)"
        top = f"up to {self.cap} (the model's positions)" if self.cap is not None else "and up"
        return f"{FLOOR}, {2 * FLOOR}, {4 * FLOOR}, ... {top}"


def buckets_for(spmd, module: torch.nn.Module, on_by_default: bool) -> Optional["SequenceBuckets"]:
    """The buckets a forward's inputs are padded to under ``spmd`` (the config's section):
    multiples of ``pad_to_multiple_of`` when set; powers of two when ``shape_buckets`` is true,
    or unset on a backend where they are ``on_by_default``; else None (as fed)."""
    if spmd.pad_to_multiple_of:
        return SequenceBuckets(multiple=spmd.pad_to_multiple_of)
    if spmd.shape_buckets or (spmd.shape_buckets is None and on_by_default):
        return SequenceBuckets(cap=model_positions(module))
    return None


def model_positions(module: torch.nn.Module) -> Optional[int]:
    """The longest sequence a Hugging Face model's position tables take: the smallest of the
    limits its config (and its text, encoder or decoder config) names; None when it names none
    (relative or rotary positions without a limit, a plain torch module)."""
    configs = [getattr(module, "config", None)]
    configs += [getattr(configs[0], name, None) for name in _SUB_CONFIGS]
    limits = [getattr(c, name, None) for c in configs if c is not None for name in _POSITION_LIMITS]
    limits = [n for n in limits if isinstance(n, int) and not isinstance(n, bool) and n > 0]
    return min(limits) if limits else None


def cut_back(output: Any, cuts: tuple) -> Any:
    """``output`` with each tensor of ``[rows, padded, ...]`` cut back to ``[rows, fed, ...]``,
    for each ``(rows, padded, fed)`` of ``cuts`` (a padded length reached from one length fed:
    an encoder's and a decoder's lengths padded to the same bucket from two lengths are
    ambiguous, and left as they are). A tensor of ``[rows, padded - 1, ...]`` is a shifted
    sequence (next-token log-probabilities: position i scores token i + 1, as TRL's fused LM
    head returns them) and is cut to ``[rows, fed - 1, ...]``: left at the padded length, its
    last positions were the padding's, and a loss on them (``log_probs[:, -k:]``) trained on
    nothing."""
    fed_lengths: dict = {}
    for rows, padded, fed in cuts:
        if padded != fed:
            fed_lengths.setdefault((rows, padded), set()).add(fed)
    exact = {key: next(iter(fed)) for key, fed in fed_lengths.items() if len(fed) == 1}
    if not exact:
        return output

    def cut(leaf):
        if isinstance(leaf, torch.Tensor) and leaf.dim() >= 2:
            fed = exact.get((leaf.shape[0], leaf.shape[1]))
            if fed is not None:
                return leaf[:, :fed]
            shifted = exact.get((leaf.shape[0], leaf.shape[1] + 1))
            if shifted is not None:
                return leaf[:, :shifted - 1]
        return leaf

    leaves, spec = torch_pytree.tree_flatten(output)
    return torch_pytree.tree_unflatten([cut(leaf) for leaf in leaves], spec)
