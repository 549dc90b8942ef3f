"""DeBERTa's sequence-classification loss over the labeled rows, without reading which they are.

Why: ``DebertaForSequenceClassification`` and ``DebertaV2ForSequenceClassification`` (DeBERTa-v3
included, a common choice for GLUE-style fine-tuning) pick the rows with a label by
``(labels >= 0).nonzero()`` when the config names no ``problem_type`` and there are several
labels: what ``AutoModelForSequenceClassification`` with ``num_labels=N`` and the Trainer give.
A count of rows picked by value is a host read under ``jax.jit``, so every training step of
these models ran eagerly (``host_reads``), on both transformers releases.

While a step is traced (``masked``), that case runs the model's forward without the labels and
takes the same loss with a mask: cross-entropy in fp32 over the rows whose label is at least 0,
averaged over their count, and 0 when no row has one (transformers' ``torch.tensor(0)``).
Every other case (regression, a ``problem_type``, soft labels) is transformers' own forward.
"""

from __future__ import annotations

import contextlib

import torch

from spmdzero.backends.torchax.patches import transformers_methods


def _loss(model, logits: torch.Tensor, labels: torch.Tensor, bound) -> torch.Tensor:
    labeled = labels >= 0
    target = torch.where(labeled, labels.long(), torch.zeros_like(labels, dtype=torch.long))
    rows = torch.nn.functional.cross_entropy(logits.view(-1, model.num_labels).float(), target, reduction="none")
    return torch.where(labeled, rows, torch.zeros_like(rows)).sum() / labeled.sum().clamp(min=1)


def _reads(model, labels: torch.Tensor) -> bool:
    """The case transformers picks by ``nonzero``: no ``problem_type``, several labels, one per row."""
    return model.config.problem_type is None and model.num_labels != 1 and labels.dim() == 1


def _masked(original):
    return transformers_methods.loss_outside(original, _reads, _loss)


# transformers_methods.Replacement, on both releases
REPLACED = (("deberta", "DebertaForSequenceClassification", "forward", _masked),
            ("deberta_v2", "DebertaV2ForSequenceClassification", "forward", _masked))


@contextlib.contextmanager
def patched(trace):
    """While a step is traced: ``REPLACED``'s forwards take the labeled rows' loss with a mask."""
    with transformers_methods.replaced(REPLACED):
        yield
