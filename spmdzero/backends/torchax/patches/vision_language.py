"""Vision-language models' forwards, computed with tensor ops while a step is traced: the Qwen-VL
family's multimodal rotary positions (M-RoPE), Qwen3-VL's deepstack features, and the padding
images of Idefics3 and SmolVLM.

Why: these models' forwards read values on the host where tensor ops compute the same thing, so
under ``jax.jit`` every one went eagerly (``host_reads``), op by op, even with the Qwen models'
image grids kept on the host (``shape_inputs``).

**Positions.** ``get_rope_index`` of Qwen2-VL, Qwen2.5-VL, Qwen3-VL and GLM-4V gives every token
three positions (time, height, width): text counts up by one, an image's tokens take its patch
grid's positions from where the text stopped, and the text after it goes on from there.
transformers walks each row on the host to find the images (``input_token_type.tolist()`` in
5.x, ``input_ids[attention_mask == 1]`` and ``.index(image_token_id)`` in 4.x). Here the same
positions come from tensor ops over the whole batch, given the grids on the host:

* each token's kind (text, image, video): 5.x's ``mm_token_type_ids``; 4.x's image and video
  token ids;
* a run of one kind among the row's unpadded tokens is one image or video, numbered in the batch's
  order, as transformers takes the grids in order;
* what each grid contributes, its tokens' positions from the run's start and how far the text
  moves on after it, comes from transformers' own ``get_rope_index``, run on the host on a row of
  that one image (``_one_item``), so a class's rule (4.x's temporal spacing, 5.x's
  ``max(h, w)``) is its own. A rule that is not "the run's start plus a fixed offset" is found
  there, and the method then runs as transformers wrote it (and the forward eagerly);
* then a text token's position is the count of what came before it, and an image token's is its
  run's start plus its offset. Padding gets transformers' value (4.x: 1, 5.x: 0), and so do the
  deltas that generation continues from: each row's largest position + 1 - its length (4.x: with
  the padding, 5.x: without).

GLM-4V marks a video's frames with image tokens between video tokens, so its positions are
computed here only on 5.x's token types and for images; Qwen3-VL's frames, each its own run
between timestamps, are items of their own, as transformers splits its grids.

**Deepstack.** Qwen3-VL adds features of its vision tower's inner layers to the image tokens'
hidden states in its first layers: ``hidden_states[visual_pos_masks, :] + visual_embeds``, a
boolean index, whose shape is a value. Here they are scattered into place in the mask's order, as
``masked_scatter`` puts image features, and added.

**Padding images.** Idefics3 and SmolVLM take ``pixel_values`` of shape (rows, images, C, H,
W), a row with fewer images padded by all-zero ones, and drop those before the vision tower
(``pixel_values[real_images_inds]``, a boolean index). On transformers 5.x, here every image goes
through the tower (a padding one with a whole pixel mask, so that its features are finite), and
the real images' features are put first, in order (a stable sort): the features the image tokens
take (``masked_scatter`` takes them in order) are the same. The padding images cost their compute,
none when every row has as many images. transformers 4.x's Idefics3 reads in its vision
embeddings too: its forward stays eager there.

Swapped in for the trace only (``transformers_methods``); otherwise, and in plain torch,
transformers' own methods run. Positions are computed here only where the grids are host tensors
and the ids traced.
"""

from __future__ import annotations

import contextlib
import functools
import inspect

import numpy as np
import torch

from spmdzero.backends.torchax.patches import transformers_methods

IMAGE, VIDEO = 1, 2


def _is_traced(t) -> bool:
    return isinstance(t, torch.Tensor) and type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter)


def _is_host(t) -> bool:
    return t is None or type(t) is torch.Tensor


def _one_item(model, original, kind: int, grid: tuple, spacing, lead: int):
    """transformers' positions for one row: ``lead`` text tokens, a vision start token, one image
    (``kind`` IMAGE) or video of ``grid`` (``spacing``: its seconds per grid, Qwen2.5-VL's), one
    text token. Returns (its tokens' positions less the run's start, shape (3, n); how far the
    text after it moves on); ``_items`` compares two leads to find a rule that is not additive."""
    config = model.config
    m = config.vision_config.spatial_merge_size
    n = int(np.prod(grid)) // (m * m)
    token = config.image_token_id if kind == IMAGE else config.video_token_id
    start_token = getattr(config, "vision_start_token_id", None)
    special = {config.image_token_id, getattr(config, "video_token_id", None), start_token}
    text = next(i for i in range(len(special) + 1) if i not in special)
    opening = start_token if start_token is not None else text
    ids = torch.tensor([[text] * lead + [opening] + [token] * n + [text]])
    types = torch.tensor([[0] * (lead + 1) + [kind] * n + [0]])
    arguments = {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                 "image_grid_thw": torch.tensor([grid]) if kind == IMAGE else None,
                 "video_grid_thw": torch.tensor([grid]) if kind == VIDEO else None}
    parameters = inspect.signature(original).parameters
    if "mm_token_type_ids" in parameters:
        arguments["mm_token_type_ids"] = types
    if "second_per_grid_ts" in parameters and kind == VIDEO:
        arguments["second_per_grid_ts"] = torch.tensor([spacing])
    positions, _ = original(model, **{k: v for k, v in arguments.items() if k in parameters})
    positions = positions[:, 0].long()
    start = lead + 1
    return positions[:, start:start + n] - start, int(positions[0, -1]) - start


def _items(model, original, kind: int, grids, spacings) -> tuple | None:
    """The per-item table of one kind: (offsets of every item's tokens, concatenated, (3, N);
    each item's first column in it; each item's advance), or None if some rule is not additive."""
    if grids is None or grids.numel() == 0:
        return None
    columns, firsts, advances = [], [], []
    for k, grid in enumerate(grids.tolist()):
        spacing = float(spacings[k]) if spacings is not None and kind == VIDEO else None
        found = [_one_item(model, original, kind, tuple(grid), spacing, lead) for lead in (0, 2)]
        if not torch.equal(found[0][0], found[1][0]) or found[0][1] != found[1][1]:
            return None
        firsts.append(sum(c.shape[1] for c in columns))
        columns.append(found[0][0])
        advances.append(found[0][1])
    return torch.cat(columns, dim=1), torch.tensor(firsts), torch.tensor(advances)


def positions(kinds: torch.Tensor, valid: torch.Tensor, tables: dict, transformers_4: bool):
    """Every token's three positions, (3, B, S), and each row's delta, (B, 1), by the rule in the
    module docstring. ``kinds``: 0 text, IMAGE, VIDEO per token; ``valid``: the unpadded tokens;
    ``tables``: ``_items``' table by kind. 4.x gives padding position 1 and takes a delta from the
    row's whole length, 5.x padding 0 and the unpadded length."""
    batch, length = kinds.shape
    index = torch.arange(length, device=kinds.device).expand(batch, length)
    kinds = torch.where(valid, kinds, -1)
    # the kind of the unpadded token before each one (-1 for the row's first)
    before = torch.cummax(torch.nn.functional.pad(torch.where(valid, index, -1), (1, 0), value=-1)[:, :-1], dim=1)[0]
    previous = torch.where(before >= 0, torch.gather(kinds, 1, before.clamp(min=0)), -1)
    starts = valid & (kinds != previous)
    count = valid.long().cumsum(1) - 1  # the token's place among the row's unpadded ones
    offset = count - torch.cummax(torch.where(starts, count, -1), dim=1)[0]
    step = torch.where(kinds == 0, 1, 0)
    relative = torch.zeros(3, batch, length, dtype=torch.long, device=kinds.device)
    advance = torch.zeros(batch, length, dtype=torch.long, device=kinds.device)
    for kind, (columns, firsts, advances) in tables.items():
        mine = kinds == kind
        item = ((starts & mine).flatten().long().cumsum(0) - 1).view(batch, length).clamp(0, firsts.shape[0] - 1)
        run_advance = advances.to(kinds.device)[item]
        step = step + torch.where(starts & mine, run_advance, 0)
        advance = torch.where(mine, run_advance, advance)
        column = (firsts.to(kinds.device)[item] + offset).clamp(0, columns.shape[1] - 1)
        relative = torch.where(mine, columns.to(kinds.device)[:, column], relative)
    through = step.cumsum(1)  # what the row counted up to and including each token
    text = (through - 1).expand(3, batch, length)
    result = torch.where(kinds == 0, text, through - advance + relative)
    result = torch.where(valid, result, 1 if transformers_4 else 0)
    largest = torch.where(valid, result, torch.iinfo(torch.int32).min).amax(dim=(0, 2))
    deltas = (largest + 1 - (length if transformers_4 else valid.long().sum(1))).unsqueeze(1)
    return result, deltas


# classes whose get_rope_index splits a video's grid into its frames (Qwen3-VL puts a timestamp
# between them): a video's run is then a frame, and its items are the frames' grids
_FRAMES_APART = frozenset({"Qwen3VLModel", "Qwen3VLMoeModel"})
# GLM-4V marks a video's frames with image tokens between video tokens: computed here on 5.x's
# token types and for images only; its videos, and its 4.x method, are transformers' own
_IMAGES_BY_TYPES = frozenset({"Glm4vModel", "Glm4vMoeModel"})
_touched: list = []  # the models whose positions were computed in this trace (``computed``)


def _traced(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def get_rope_index(self, *args, **kwargs):
        arguments = signature.bind(self, *args, **kwargs).arguments
        ids, mask = arguments.get("input_ids"), arguments.get("attention_mask")
        grids = arguments.get("image_grid_thw"), arguments.get("video_grid_thw")
        spacings = arguments.get("second_per_grid_ts")
        types = arguments.get("mm_token_type_ids")
        if not (_is_traced(ids) and all(_is_host(g) for g in grids) and _is_host(spacings)) \
                or ids.dim() != 2 or (mask is not None and mask.dim() != 2):
            return original(self, *args, **kwargs)
        if type(self).__name__ in _IMAGES_BY_TYPES and (grids[1] is not None or types is None):
            return original(self, *args, **kwargs)
        if grids[1] is not None and type(self).__name__ in _FRAMES_APART:
            frames = grids[1].repeat_interleave(grids[1][:, 0], dim=0)
            grids = grids[0], torch.cat([torch.ones_like(frames[:, :1]), frames[:, 1:]], dim=1)
        tables = {}
        for kind, grid in ((IMAGE, grids[0]), (VIDEO, grids[1])):
            if grid is not None and grid.numel():
                table = _items(self, original, kind, grid, spacings)
                if table is None:
                    return original(self, *args, **kwargs)
                tables[kind] = table
        if not tables:
            return original(self, *args, **kwargs)
        by_types = "mm_token_type_ids" in signature.parameters  # 5.x; 4.x finds them by their token ids
        if by_types:
            if types is None:
                return original(self, *args, **kwargs)
            kinds = types.long()
        else:
            config = self.config
            videos = torch.where(ids == config.video_token_id, VIDEO, 0)
            kinds = torch.where(ids == config.image_token_id, IMAGE, videos)
        valid = torch.ones_like(ids, dtype=torch.bool) if mask is None else mask.bool()
        _touched.append(self)
        return positions(kinds, valid, tables, transformers_4=not by_types)

    return get_rope_index


def _scattered(original):
    def _deepstack_process(self, hidden_states, visual_pos_masks, visual_embeds):
        if not _is_traced(hidden_states):
            return original(self, hidden_states, visual_pos_masks, visual_embeds)
        where = visual_pos_masks.to(hidden_states.device).bool().unsqueeze(-1).expand_as(hidden_states)
        features = visual_embeds.to(hidden_states.device, hidden_states.dtype)
        return hidden_states + torch.zeros_like(hidden_states).masked_scatter(where, features)

    return _deepstack_process


def _padding_kept(original):
    signature = inspect.signature(original)

    def get_image_features(self, *args, **kwargs):
        arguments = signature.bind(self, *args, **kwargs).arguments
        pixels, pixel_mask = arguments.get("pixel_values"), arguments.get("pixel_attention_mask")
        if not _is_traced(pixels) or pixels.dim() != 5:
            return original(self, *args, **kwargs)
        rows, images, channels, height, width = pixels.shape
        pixels = pixels.to(dtype=self.dtype).reshape(rows * images, channels, height, width)
        real = (pixels == 0.0).sum(dim=(-1, -2, -3)) != channels * height * width
        whole = torch.ones(rows * images, height, width, dtype=torch.bool, device=pixels.device)
        pixel_mask = whole if pixel_mask is None else \
            pixel_mask.reshape(rows * images, height, width).bool() | ~real[:, None, None]
        size = self.config.vision_config.patch_size
        patches = pixel_mask.unfold(dimension=1, size=size, step=size).unfold(dimension=2, size=size, step=size)
        extra = {k: v for k, v in arguments.get("kwargs", {}).items() if k != "return_dict"}  # outputs, as asked
        outputs = self.vision_model(pixel_values=pixels, patch_attention_mask=patches.sum(dim=(-1, -2)) > 0,
                                    return_dict=True, **extra)
        features = self.connector(outputs.last_hidden_state)
        first = torch.argsort((~real).int(), stable=True)  # the real images first, in their order
        outputs.pooler_output = [features[first].reshape(-1, features.shape[-1])]
        return outputs

    return get_image_features


# (model, class, method, replacement), on both transformers releases where the class has the method
REPLACED = (*((model, cls, "get_rope_index", _traced) for model, cls in (
                ("qwen2_vl", "Qwen2VLModel"), ("qwen2_5_vl", "Qwen2_5_VLModel"), ("qwen3_vl", "Qwen3VLModel"),
                ("qwen3_vl_moe", "Qwen3VLMoeModel"), ("glm4v", "Glm4vModel"), ("glm4v_moe", "Glm4vMoeModel"))),
            ("qwen3_vl", "Qwen3VLTextModel", "_deepstack_process", _scattered),
            ("qwen3_vl_moe", "Qwen3VLMoeTextModel", "_deepstack_process", _scattered))
# transformers 5.x's Idefics3 and SmolVLM (4.x's read in their vision embeddings too)
PADDING_KEPT = (("idefics3", "Idefics3Model", "get_image_features", _padding_kept),
                ("smolvlm", "SmolVLMModel", "get_image_features", _padding_kept))


@contextlib.contextmanager
def patched(trace):
    """While a step is traced: ``REPLACED``'s methods as this module computes them. The deltas
    transformers keeps on the model (``rope_deltas``, for generation to continue from) are the
    trace's values: dropped after it, so that the module's next host call computes its own."""
    try:
        with transformers_methods.replaced(REPLACED + (() if transformers_methods.transformers_4() else PADDING_KEPT)):
            yield
    finally:
        for model in _touched:
            if not _is_host(getattr(model, "rope_deltas", None)):
                model.rope_deltas = None
        _touched.clear()
