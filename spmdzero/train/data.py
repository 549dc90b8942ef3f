"""Host batches as DeepSpeed's loader draws them, for a backend to place on its devices.

One process feeds all of its host's devices, so one host batch holds the micro-batches
of every DeepSpeed rank the host stands for (``BatchSizes.host_ranks``). ``ShardedDataLoader``
draws each rank's samples with the same ``DistributedSampler`` DeepSpeed's loader uses
(shuffled, seed 0) and concatenates them in rank order, so the host trains on exactly
what those DeepSpeed ranks would.

Shape buckets (``shape_buckets``): XLA compiles one program per input shape, so batches
padded to the longest sequence recompile at almost every step. ``pad_sequences`` pads the
sequence dim of the named dict inputs (``PAD_VALUES``) to a bucket's length, consistently with
the attention mask, so the losses are unchanged."""

from __future__ import annotations
from collections.abc import Mapping
from typing import Any, Callable, Optional, Union
import torch
from torch.utils.data import DataLoader, DistributedSampler
from spmdzero.sharding.batch import BatchSizes


def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, (list, tuple)):
        mapped = [map_tensors(o, fn) for o in obj]
        return type(obj)(*mapped) if hasattr(obj, "_fields") else type(obj)(mapped)
    if isinstance(obj, Mapping):
        return like(obj, ((k, map_tensors(v, fn)) for k, v in obj.items()))
    return obj


def like(mapping: Mapping, items) -> Mapping:
    """A mapping of ``mapping``'s type with ``items``: a dict, an OrderedDict, or a
    ``transformers.BatchEncoding`` (what Hugging Face collators return: a ``UserDict``, not a
    dict); a plain dict for a mapping type that cannot be built from pairs."""
    items = list(items)
    try:
        return type(mapping)(items)
    except Exception:
        return dict(items)


def _first_batch_size(obj: Any) -> Optional[int]:
    found: list[int] = []
    map_tensors(obj, lambda t: found.append(t.shape[0]) if t.dim() and not found else None)
    return found[0] if found else None


PAD_ID = "pad_id"  # stands for the model's pad token id (config.pad_token_id, else 0)


# The dict inputs the shape buckets pad along dim 1 (the sequence), and with what:
# ids with the pad token, masks and segment/position ids with 0, labels with -100 (the
# ignore index of Hugging Face losses). Other keys, 1-D tensors (classification labels)
# and positional tensors are left alone.
PAD_VALUES: dict[str, Any] = {
    "input_ids": PAD_ID, "attention_mask": 0, "token_type_ids": 0, "position_ids": 0, "labels": -100,
    "decoder_input_ids": PAD_ID, "decoder_attention_mask": 0,
}


def model_pad_id(module: torch.nn.Module) -> int:
    """The pad token id of a Hugging Face model (``config.pad_token_id``), else 0."""
    pad_id = getattr(getattr(module, "config", None), "pad_token_id", None)
    return pad_id if isinstance(pad_id, int) else 0


def pad_sequences(obj: Any, length: Union[int, Callable[[int], int]], pad_id: int = 0,
                  cuts: Optional[list] = None, skip: Optional[Callable[[Mapping], bool]] = None) -> Any:
    """Pad every dict in ``obj`` that has an ``attention_mask`` (the mask is what keeps the
    padding out of the result) to a sequence length of ``length(fed)`` (a bucket's,
    ``shape_buckets.SequenceBuckets.length``), or a multiple of ``length`` when it is an int.
    Host tensors only: padding a tensor already on the device would not change the step's
    input shapes. ``cuts`` collects ``(rows, padded length, length fed)`` of each padded key;
    a dict that ``skip`` picks is left as it is."""
    if isinstance(length, int):
        multiple = length
        length = lambda fed: fed + -fed % multiple  # noqa: E731
    if _has_host_mask(obj):
        if skip is not None and skip(obj):
            return obj
        unknown = _unknown_sequences(obj)
        if unknown:  # padding the mask and not these would give the model sequences of two lengths
            _say_unpadded(unknown)
            return obj
        keys = _sequence_keys(obj)
        if cuts is not None:
            cuts.extend((v.shape[0], length(v.shape[1]), v.shape[1]) for k, v in obj.items() if k in keys)
        return like(obj, ((k, _pad_dim1(v, length(v.shape[1]), _pad_value(k, pad_id)))
                          if k in keys else (k, v) for k, v in obj.items()))
    if isinstance(obj, Mapping):
        return like(obj, ((k, pad_sequences(v, length, pad_id, cuts, skip)) for k, v in obj.items()))
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(pad_sequences(o, length, pad_id, cuts, skip) for o in obj)
    return obj


def _align_sequences(parts: tuple, pad_id: int) -> tuple:
    """Ranks' dict batches padded to one sequence length per key (each rank's collator pads to
    its own longest row), by the same rule as ``pad_sequences``; other parts unchanged."""
    if not all(_has_host_mask(p) for p in parts):
        return parts
    keys = set.intersection(*(_sequence_keys(p) for p in parts))
    longest = {k: max(p[k].shape[1] for p in parts) for k in keys}
    return tuple(like(p, ((k, _pad_dim1(v, longest[k], _pad_value(k, pad_id)) if k in keys else v)
                          for k, v in p.items())) for p in parts)


def _has_host_mask(obj: Any) -> bool:
    mask = obj.get("attention_mask") if isinstance(obj, Mapping) else None
    return isinstance(mask, torch.Tensor) and mask.dim() >= 2 and mask.device.type != "xla"


def _sequence_keys(batch: dict) -> set:
    """The ``PAD_VALUES`` keys of ``batch`` holding host tensors whose dim 1 is a sequence
    length of the dict: the encoder's (the mask's) or, for seq2seq, the decoder's. A named
    tensor whose dim 1 is neither (multi-label classification targets) is not a sequence."""
    lengths = {t.shape[1] for k, t in batch.items() if k in ("attention_mask", "decoder_input_ids",
                                                            "decoder_attention_mask")
               and isinstance(t, torch.Tensor) and t.dim() >= 2}
    return {k for k, t in batch.items() if k in PAD_VALUES and isinstance(t, torch.Tensor) and t.dim() >= 2
            and t.device.type != "xla" and t.shape[1] in lengths}


def _unknown_sequences(batch: dict) -> list[str]:
    """Keys of host tensors whose dim 1 has the mask's length but that ``PAD_VALUES`` does not
    name (a script's own ``src_tokens``): their padding value is unknown."""
    mask = batch["attention_mask"].shape[1]
    return sorted(k for k, t in batch.items() if k not in PAD_VALUES and isinstance(t, torch.Tensor)
                  and t.dim() >= 2 and t.device.type != "xla" and t.shape[1] == mask)


_TOLD_UNPADDED: set = set()


def _say_unpadded(keys: list[str]) -> None:
    """Said once per set of keys: a dict left unpadded by the shape buckets."""
    if tuple(keys) not in _TOLD_UNPADDED:
        _TOLD_UNPADDED.add(tuple(keys))
        import warnings

        warnings.warn(f"spmdzero: shape buckets leave a batch with keys {keys} unpadded: their dim 1 "
                      "is the attention_mask's sequence length, and spmdzero does not know their padding value "
                      "(it pads input_ids, labels, attention_mask, ...: docs/config.md, Shape buckets). Pad them in "
                      "your collator (to a multiple of N) for fixed shapes (noted once)", stacklevel=5)


def _pad_value(key: str, pad_id: int) -> int:
    return pad_id if PAD_VALUES[key] == PAD_ID else PAD_VALUES[key]


def _pad_dim1(t: torch.Tensor, length: int, value: int) -> torch.Tensor:
    if t.shape[1] >= length:
        return t
    pad = t.new_full((t.shape[0], length - t.shape[1], *t.shape[2:]), value)
    return torch.cat([t, pad], dim=1)


def caller_stacklevel() -> int:
    """The ``stacklevel`` that points a warning at the first frame outside spmdzero and torch
    (the user's ``engine(...)`` or ``for batch in loader``), from wherever it is raised."""
    import os
    import sys

    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # spmdzero/, every layer
    internal = (package, os.path.dirname(torch.__file__))
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(internal):
        frame, level = frame.f_back, level + 1
    return level




class ShardedDataLoader:
    """DeepSpeed's training loader, one host batch per micro-step, handed to ``place`` (the
    backend's: torch_xla's puts it on the devices split along the batch axes; the torchax
    backend's engine places batches itself, so its loader yields them from the host).

    Each DeepSpeed rank this host stands for (``BatchSizes.host_ranks``: its data-parallel
    devices under rule "device", the process itself under rule "process") draws
    ``train_micro_batch_size_per_gpu`` rows with DeepSpeed's ``DistributedSampler``; the
    host batch is their concatenation in rank order."""

    def __init__(self, dataset, batch: BatchSizes, place: Optional[Callable] = None,
                 collate_fn: Optional[Callable] = None, drop_last: bool = False, process_index: int = 0,
                 buckets=None, pad_id: int = 0):
        self.batch, self.place = batch, place
        self.buckets, self.pad_id = buckets, pad_id  # shape_buckets.SequenceBuckets, or None: as collated
        self.rank_loaders = [
            DataLoader(dataset, batch_size=batch.rows_per_rank, collate_fn=collate_fn, drop_last=drop_last,
                       sampler=DistributedSampler(dataset, num_replicas=batch.ranks, rank=r))
            for r in batch.host_ranks(process_index)
        ]

    def __len__(self) -> int:
        return len(self.rank_loaders[0])

    def __iter__(self):
        for per_rank in zip(*self.rank_loaders):
            host_batch = _concat(per_rank, pad_id=self.pad_id)
            if self.buckets is not None:
                host_batch = pad_sequences(host_batch, self.buckets.length, self.pad_id)
            yield host_batch if self.place is None else self.place(host_batch)

    # ---- DeepSpeedDataLoader's attributes, read by scripts ---------------------------------
    @property
    def dataset(self):
        return self.rank_loaders[0].dataset

    @property
    def batch_size(self) -> int:
        """DeepSpeed's: train_micro_batch_size_per_gpu, the rows one rank draws per micro-step
        (a host batch holds that times the ranks this host stands for)."""
        return self.batch.rows_per_rank

    @property
    def data_sampler(self):
        """The DistributedSampler (``set_epoch`` reshuffles); a group that forwards
        ``set_epoch`` when this host stands for several ranks."""
        samplers = [loader.sampler for loader in self.rank_loaders]
        return samplers[0] if len(samplers) == 1 else _SamplerGroup(samplers)

    sampler = data_sampler


class _SamplerGroup:
    def __init__(self, samplers: list):
        self.samplers = samplers

    def set_epoch(self, epoch: int) -> None:
        for sampler in self.samplers:
            sampler.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.samplers[0])


def _concat(parts: tuple, rows: Optional[tuple] = None, pad_id: int = 0, field: str = "batch") -> Any:
    """One host batch from the ranks' batches: tensors along the rows, per-row lists (such as
    the strings a collate function returns for a text field) concatenated so they stay
    aligned with the rows, containers field by field, anything else from the first rank."""
    rows = rows if rows is not None else tuple(_first_batch_size(p) for p in parts)
    first = parts[0]
    if isinstance(first, torch.Tensor):
        if not first.dim():
            return first
        if len({tuple(p.shape[1:]) for p in parts}) > 1:
            raise ValueError(
                f"the ranks' batches have different shapes for {field}: {[tuple(p.shape) for p in parts]}. Each rank "
                "is collated separately; pad to a fixed length in your collate_fn (dicts with an attention_mask "
                "are padded to the longest rank automatically)")
        return torch.cat(parts)
    if isinstance(first, list) and all(_is_row_list(p, n) for p, n in zip(parts, rows)):
        return [item for p in parts for item in p]
    if isinstance(first, (list, tuple)):
        merged = [_concat(tuple(p[i] for p in parts), rows, pad_id, f"{field}[{i}]") for i in range(len(first))]
        return type(first)(*merged) if hasattr(first, "_fields") else type(first)(merged)
    if isinstance(first, Mapping):
        parts = _align_sequences(parts, pad_id)
        return like(first, ((k, _concat(tuple(p[k] for p in parts), rows, pad_id, f"{field}[{k!r}]")) for k in first))
    return first


def _is_row_list(obj: Any, rows: Optional[int]) -> bool:
    """A list with one plain value (not a tensor or container) per row of its batch."""
    return (isinstance(obj, list) and rows is not None and len(obj) == rows
            and not any(isinstance(v, (torch.Tensor, list, tuple, Mapping)) for v in obj))
