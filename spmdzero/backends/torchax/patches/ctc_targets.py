"""The CTC loss of transformers' speech models (wav2vec2 and its kin) without reading the labels.

Why: ``Wav2Vec2ForCTC`` and the nine classes built like it (HuBERT, WavLM, Data2VecAudio, SEW,
SEW-D, UniSpeech, UniSpeech-SAT, Wav2Vec2-Conformer, Wav2Vec2-BERT), the models of transformers'
``run_speech_recognition_ctc.py``, read their labels twice: ``labels.max() >= vocab_size`` before
the forward, and ``labels.masked_select(mask)`` to concatenate each row's targets, a
data-dependent shape. Under ``jax.jit`` either read sends the whole step down the eager path
(``host_reads``), on both transformers releases.

While a step is traced (``restated``) with traced labels, such a forward runs without its labels
and the loss is taken here as transformers takes it, the targets padded instead of concatenated:
each row's kept labels moved to its front in order (a stable sort), its count as its target length
(``F.ctc_loss`` takes both forms alike). The frames are transformers' own
``_get_feat_extract_output_lengths`` of the attention mask's sums (all frames without one), the
blank is ``pad_token_id``, and the reduction and ``zero_infinity`` are the config's. A label is
kept as transformers keeps it: 4.x ``label >= 0``; 5.x neither -100 nor the blank.

The range check is left out, noted once per class: a label at or past the vocabulary makes plain
torch raise ``ValueError``; the compiled step cannot stop for a value. Forwards with values (eager
runs, plain torch) run transformers' lines, check included.
"""

from __future__ import annotations

import contextlib

import torch

from spmdzero.backends.torchax.lowering import traced_checks
from spmdzero.backends.torchax.patches import transformers_methods
from spmdzero.observe.console import ensure_handler, logger

_NOTED: set = set()


def _loss(model, logits: torch.Tensor, labels: torch.Tensor, bound) -> torch.Tensor:
    _note(type(model))
    attention_mask = bound.arguments.get("attention_mask")
    if attention_mask is None:  # every frame: transformers' ones over the inputs' first two dimensions
        inputs = bound.arguments[list(bound.signature.parameters)[1]]  # input_values (Wav2Vec2-BERT: input_features)
        attention_mask = torch.ones(inputs.shape[:2], dtype=torch.long, device=inputs.device)
    blank = model.config.pad_token_id
    kept = labels >= 0 if transformers_methods.transformers_4() else (labels != -100) & (labels != blank)
    order = torch.argsort((~kept).to(torch.int32), dim=-1, stable=True)  # kept labels first, in order
    targets = torch.where(kept, labels, torch.zeros_like(labels)).gather(-1, order)
    frames = model._get_feat_extract_output_lengths(attention_mask.sum(-1)).to(torch.long)
    log_probs = torch.nn.functional.log_softmax(logits, dim=-1, dtype=torch.float32).transpose(0, 1)
    return torch.nn.functional.ctc_loss(log_probs, targets, frames, kept.sum(-1), blank=blank,
                                        reduction=model.config.ctc_loss_reduction,
                                        zero_infinity=model.config.ctc_zero_infinity)


def _note(cls) -> None:
    if cls.__name__ in _NOTED:
        return
    _NOTED.add(cls.__name__)
    ensure_handler()
    logger.warning("spmdzero: %s checks that every label is below vocab_size (labels.max()), a value the compiled "
                   "step computes; the step leaves that check out. Plain torch runs it (noted once)", cls.__name__)


def _restated(original):
    # traced labels only: with values (an eager run), transformers' lines, its check included
    return transformers_methods.loss_outside(original, lambda model, labels: traced_checks.abstract(labels), _loss)


# transformers_methods.Replacement, on both releases
REPLACED = tuple((model, cls, "forward", _restated) for model, cls in (
    ("wav2vec2", "Wav2Vec2ForCTC"), ("wav2vec2_bert", "Wav2Vec2BertForCTC"),
    ("wav2vec2_conformer", "Wav2Vec2ConformerForCTC"), ("hubert", "HubertForCTC"), ("wavlm", "WavLMForCTC"),
    ("data2vec/data2vec_audio", "Data2VecAudioForCTC"), ("sew", "SEWForCTC"), ("sew_d", "SEWDForCTC"),
    ("unispeech", "UniSpeechForCTC"), ("unispeech_sat", "UniSpeechSatForCTC")))


@contextlib.contextmanager
def patched(trace):
    """While a step is traced: ``REPLACED``'s forwards take their CTC loss on padded targets."""
    with transformers_methods.replaced(REPLACED):
        yield
