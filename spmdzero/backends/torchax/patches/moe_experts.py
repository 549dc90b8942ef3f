"""transformers 4.x's mixtures of experts traced as one program: the experts as grouped matmuls.

Why: transformers 4.x's mixture-of-experts blocks loop over the experts that got tokens
(``expert_hit = (...).nonzero()``) and pick each one's tokens with ``torch.where(mask)``: shapes
read from the values. Under ``jax.jit`` that is a host read, so the whole forward and backward
of every such model (Mixtral, Qwen2-MoE, Qwen3-MoE, MiniMax, DeepSeek-V3, GLM-4.5, gpt-oss...) ran
eagerly, op by op (``host_reads``), and each new count of tokens per expert compiled its ops
again: 60 to 210 s for four steps of a 2-layer model of 32 hidden units here, against 5 to 13 s
compiled; hopeless at real sizes. transformers 5.x routes the same blocks through ``grouped_mm``,
which ``lowerings.grouped_mm`` lowers.

While a step is traced (``grouped``), those 4.x blocks compute the same sum with static shapes:
the (token, chosen expert) pairs sorted by expert within each chip's rows (``moe_rows``), each
expert's projections stacked, and each projection one grouped matmul over the sorted pairs
(``jax.lax.ragged_dot``); each pair's output is weighted and added back to its token (as
``index_add_`` adds). Every token reaches the experts it chose and no other, in the loop's order
(expert by expert), so the values are the loop's. The routing, shared experts and everything
around the experts compute what transformers 4.x's lines do, restated here:

* ``forward`` of the blocks written as Mixtral's (router softmax, top-k, normalized as the block
  says, Mixtral's jitter, Qwen2-MoE's, Qwen3-Next's and Qwen3-Omni's talker's shared expert):
  Mixtral, Qwen2-MoE, Qwen3-MoE, Qwen3-Next, Qwen3-Omni-MoE (thinker and talker), MiniMax,
  OLMoE, FlexOlmo, Jamba; Hunyuan-MoE's, whose shared MLP is
  ungated; Ernie 4.5's, whose float32 router picks by corrected scores;
* ``moe`` of DeepSeek-V3, GLM-4.5, GLM-4.5V and dots.llm1 (the experts given the router's choice,
  summed in its weights' dtype);
* gpt-oss's and Qwen3-VL-MoE's experts (``GptOssExperts``, ``Qwen3VLMoeTextExperts``) where they
  loop (in training; their other path is one batched matmul);
* GraniteMoE's, GraniteMoE-Shared's and Granite 4.0's (GraniteMoeHybrid) blocks, and JetMoE's
  on 5.x too, whose router reads each expert's count into a list (``moe_routers``).

Experts whose projections carry PEFT's LoRA (``target_modules="all-linear"`` reaches them) group
the same way: the base weights, the As and the Bs each one grouped matmul. Experts that are
neither (a LoRA bias, DoRA, quantized layers...) run every expert on every token, weighted by
what each token gave it (0 where it chose another): static shapes at E/k times the experts'
arithmetic, said once in a warning. DBRX's, LongCat-Flash's and Switch Transformers' experts,
stored in layouts of their own, are ``moe_layouts``'. PhiMoE's block keeps transformers' own
sparse mixer (it samples the route in training, with its own backward) and groups its experts.
On 5.x, the experts implementation ``grouped_mm`` (``integrations.moe``: every class it
decorates, GraniteMoE's included) is ``grouped_experts_forward``, which sorts
within each chip's rows. The torch_xla backend cuts its graph at the read instead.
``transformers_methods`` swaps the methods in for the trace only.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from spmdzero.backends.torchax.patches import moe_layouts, moe_routers, moe_rows, transformers_methods

# an expert MLP's projections, as (gate, up, down) attribute names: down(act(gate(x)) * up(x))
PROJECTIONS = (("w1", "w3", "w2"), ("gate_proj", "up_proj", "down_proj"))


# what a PEFT LoRA Linear (``peft.tuners.lora.layer.Linear``) has: read by name, peft not imported
_LORA = ("base_layer", "lora_A", "lora_B", "lora_dropout", "scaling", "active_adapters", "merged",
         "disable_adapters", "lora_variant", "_cast_input_dtype")


def _lora_projection(layers) -> Optional[Callable]:
    """PEFT's vanilla LoRA on every expert's projection, as peft's forward computes it,
    ``base(x) + B(A(dropout(x))) * scaling`` for each active adapter, with the bases, the As and
    the Bs each one grouped matmul; None for anything else (DoRA and other variants, a LoRA
    bias, merged or disabled adapters, adapters that differ between the experts)."""
    first = layers[0]
    if not all(type(layer) is type(first) and all(hasattr(layer, a) for a in _LORA) for layer in layers):
        return None
    if any(layer.merged or layer.disable_adapters for layer in layers):
        return None
    if not all(moe_rows.plain_linear(layer.base_layer) for layer in layers):
        return None
    adapters = []
    for name in [a for a in first.active_adapters if a in first.lora_A]:
        if any(name not in layer.lora_A or name in layer.lora_variant or layer.scaling[name] != first.scaling[name]
               or not (moe_rows.plain_linear(layer.lora_A[name]) and moe_rows.plain_linear(layer.lora_B[name]))
               for layer in layers):
            return None
        adapters.append((moe_rows.stacked([layer.lora_A[name] for layer in layers]),
                         moe_rows.stacked([layer.lora_B[name] for layer in layers]),
                         first.lora_dropout[name], first.scaling[name]))
    base = moe_rows.stacked([layer.base_layer for layer in layers])

    def project(x, offsets):
        result = moe_rows.grouped_mm(x, base, offsets)
        dtype = result.dtype
        for a, b, dropout, scaling in adapters:
            x = first._cast_input_dtype(x, a.dtype)
            result = result + moe_rows.grouped_mm(moe_rows.grouped_mm(dropout(x), a, offsets), b, offsets) * scaling
        return result.to(dtype)

    return project


def _projection(layers) -> Optional[Callable]:
    """One projection of every expert as ``project(sorted pairs, offsets)``, grouped matmuls over
    the experts; None unless they are all plain bias-free Linears, or all PEFT LoRA on such."""
    if any(layer is None for layer in layers):
        return None
    if all(moe_rows.plain_linear(layer) for layer in layers):
        weights = moe_rows.stacked(layers)
        return lambda x, offsets: moe_rows.grouped_mm(x, weights, offsets)
    return _lora_projection(layers)


def grouped_experts(experts) -> Optional[tuple]:
    """``(activation, gate, up, down)`` of experts that are MLPs of plain Linear layers (LoRA on
    them included), each projection a ``_projection``; None otherwise (``mixture`` then runs
    every expert on every token)."""
    experts = list(experts)
    if not experts or len({type(e) for e in experts}) != 1 or not hasattr(experts[0], "act_fn"):
        return None
    for names in PROJECTIONS:
        projections = [_projection([getattr(e, name, None) for e in experts]) for name in names]
        if all(p is not None for p in projections):
            return (experts[0].act_fn, *projections)
    return None


def _dense(hidden, chosen, weights, experts, dtype) -> torch.Tensor:
    """Every expert on every token, each token's output weighted by what it gave that expert (0
    where it chose another): static shapes for any expert module, at E/k times the experts'
    arithmetic. The loop's sum, in its order (expert by expert), plus exact zeros."""
    experts = list(experts)
    warnings.warn(f"spmdzero: the experts ({type(experts[0]).__name__}) are not MLPs of plain Linear layers or of "
                  f"PEFT LoRA on them, so each of the {len(experts)} runs on every token (the compiled step's static "
                  f"shapes): {len(experts) / chosen.shape[1]:g} times their arithmetic", stacklevel=4)
    out = torch.zeros(hidden.shape, dtype=dtype, device=hidden.device)
    for index, expert in enumerate(experts):
        share = (weights * (chosen == index)).sum(-1)
        out = out + (expert(hidden) * share[:, None]).to(dtype)
    return out


def mixture(hidden: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, experts, dtype: torch.dtype
            ) -> torch.Tensor:
    """``sum over k of weights[t, k] * experts[chosen[t, k]](hidden[t])`` for each token ``t``,
    in ``dtype``, as transformers' loop adds them: grouped matmuls where ``grouped_experts``
    allows (``nn.Identity`` experts at the end of the list hand their tokens back), else
    ``_dense``."""
    experts = list(experts)
    routed = len(experts)
    while routed and type(experts[routed - 1]) is torch.nn.Identity:  # LongCat-Flash's zero-computation experts
        routed -= 1
    grouped = grouped_experts(experts[:routed])
    if grouped is None:
        return _dense(hidden, chosen, weights, experts, dtype)
    act_fn, gate, up, down = grouped
    pairs = moe_rows.Pairs.by_expert(chosen, routed)  # an identity expert's pairs sort last, in no group
    x = pairs.of_tokens(hidden)
    out = down(act_fn(gate(x, pairs.offsets)) * up(x, pairs.offsets), pairs.offsets)
    if routed < len(experts):
        out = torch.where((pairs.of_choices(chosen) >= routed)[..., None], x, out)
    added = (out * pairs.of_choices(weights)[..., None]).to(dtype)
    return pairs.added_to_tokens(torch.zeros(hidden.shape, dtype=dtype, device=hidden.device), added)


def _top_k(self, router_logits: torch.Tensor, normalize: bool):
    """The softmax top-k routing these blocks share: float32 weights, normalized where said."""
    weights = F.softmax(router_logits, dim=1, dtype=torch.float)
    weights, chosen = torch.topk(weights, self.top_k, dim=-1)
    if normalize:
        weights /= weights.sum(dim=-1, keepdim=True)
    return weights, chosen


def _sparse_block_forward(normalize: bool = True):
    """The ``forward`` of Mixtral's block and those written as it is (``REPLACED``): Mixtral's
    jitter, the router (``gate``, Jamba's ``router``), top-k normalized where the block's
    ``norm_topk_prob`` says (``normalize`` where it has none: Mixtral always, Jamba never), the
    experts as ``mixture``, and Qwen2-MoE's gated shared expert."""

    def replacement(original):
        def forward(self, hidden_states: torch.Tensor):
            batch, length, width = hidden_states.shape
            jitter = getattr(self, "jitter_noise", 0)
            if self.training and jitter > 0:
                hidden_states *= torch.empty_like(hidden_states).uniform_(1.0 - jitter, 1.0 + jitter)
            hidden_states = hidden_states.view(-1, width)
            router_logits = (self.gate if hasattr(self, "gate") else self.router)(hidden_states)
            weights, chosen = _top_k(self, router_logits, getattr(self, "norm_topk_prob", normalize))
            weights = weights.to(hidden_states.dtype)
            out = mixture(hidden_states, chosen, weights, self.experts, hidden_states.dtype)
            if getattr(self, "shared_expert", None) is not None:  # Qwen2-MoE, Qwen3-Next
                out = out + F.sigmoid(self.shared_expert_gate(hidden_states)) * self.shared_expert(hidden_states)
            return out.reshape(batch, length, width), router_logits

        return forward

    return replacement


def _hunyuan_forward(original):
    """Hunyuan-MoE's ``forward``: its shared MLP and its router take the unflattened states, the
    top-k always normalized, and only the states returned."""

    def forward(self, hidden_states: torch.Tensor):
        batch, length, width = hidden_states.shape
        shared = self.shared_mlp(hidden_states)
        router_logits = self.gate(hidden_states)
        hidden_states = hidden_states.view(-1, width)
        weights, chosen = _top_k(self, router_logits, True)
        out = mixture(hidden_states, chosen, weights.to(hidden_states.dtype), self.experts, hidden_states.dtype)
        return out.reshape(batch, length, width) + shared

    return forward


def _ernie_forward(original):
    """Ernie 4.5's ``forward``: its shared experts first, then a float32 router outside autocast
    that picks the top k by the corrected scores (``moe_statics``) and weighs them by the plain
    ones, normalized with a floor (``norm_min``)."""

    def forward(self, hidden_states: torch.Tensor):
        batch, length, width = hidden_states.shape
        hidden_states = hidden_states.view(-1, width)
        shared = self.shared_experts(hidden_states) if self.shared_experts is not None else None
        device_type = hidden_states.device.type
        device_type = device_type if isinstance(device_type, str) and device_type != "mps" else "cpu"
        with torch.autocast(device_type=device_type, enabled=False):
            router_logits = self.gate(hidden_states.float())
            weights = F.softmax(router_logits, dim=1, dtype=torch.float)
            _, chosen = torch.topk(self.moe_statics(weights), self.top_k, dim=-1)
            weights = torch.gather(weights, dim=-1, index=chosen)
            weights = (weights / torch.clamp(weights.sum(dim=-1, keepdim=True), min=self.norm_min)).to(hidden_states.dtype)
        out = mixture(hidden_states, chosen, weights, self.experts, hidden_states.dtype)
        if shared is not None:
            out = out + shared
        return out.reshape(batch, length, width), router_logits

    return forward


def _phimoe_forward(original):
    """PhiMoE's ``forward``: its input jitter, its router's ``sparsemixer`` (transformers' own
    function: in training it samples the route, with its own backward), the experts as
    ``mixture``."""

    def forward(self, hidden_states: torch.Tensor):
        batch, length, width = hidden_states.shape
        if self.training and self.input_jitter_noise > 0:
            hidden_states *= torch.empty_like(hidden_states).uniform_(
                1.0 - self.input_jitter_noise, 1.0 + self.input_jitter_noise)
        hidden_states = hidden_states.view(-1, width)
        router_logits = self.gate(hidden_states)
        sparsemixer = sys.modules[type(self).__module__].sparsemixer
        weights, chosen = sparsemixer(router_logits, jitter_eps=self.router_jitter_noise, training=self.training)
        out = mixture(hidden_states, chosen, weights, self.experts, hidden_states.dtype)
        return out.reshape(batch, length, width), router_logits

    return forward


def _deepseek_moe(original):
    """DeepSeek-V3's ``moe``: the routed experts, summed in the router weights' dtype."""

    def moe(self, hidden_states: torch.Tensor, topk_indices: torch.Tensor, topk_weights: torch.Tensor):
        return mixture(hidden_states, topk_indices, topk_weights, self.experts, topk_weights.dtype
                       ).type(hidden_states.dtype)

    return moe


def _gpt_oss_experts(original):
    """gpt-oss's experts in training: 3-D projections with biases, interleaved gate and up,
    clamped, weighted by the router's dense scores ``[T, E]``."""

    def forward(self, hidden_states: torch.Tensor, router_indices=None, routing_weights=None):
        if not (self.training or hidden_states.device.type == "cpu"):  # where transformers loops
            return original(self, hidden_states, router_indices, routing_weights)
        batch = hidden_states.shape[0]
        x = hidden_states.reshape(-1, self.hidden_size)
        experts = routing_weights.shape[1]
        pairs = moe_rows.Pairs.by_expert(router_indices, experts)
        expert = pairs.of_choices(router_indices)
        # a sentinel index (past the experts) weighs 0: its one-hot row has no 1 among the experts
        picked = F.one_hot(expert, experts + 1)[..., :experts]
        expert = expert.clamp(max=experts - 1)
        gate_up = moe_rows.grouped_mm(pairs.of_tokens(x), self.gate_up_proj, pairs.offsets)
        gate_up = gate_up + self.gate_up_proj_bias[expert]
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        gated = (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
        out = moe_rows.grouped_mm(gated, self.down_proj, pairs.offsets) + self.down_proj_bias[expert]
        scale = (pairs.of_tokens(routing_weights) * picked).sum(-1)
        added = (out * scale[..., None]).to(x.dtype)
        return pairs.added_to_tokens(torch.zeros_like(x), added).view(batch, -1, self.hidden_size)

    return forward


def _stacked_glu_experts(original):
    """Qwen3-VL-MoE's experts in training: 3-D projections, the gate and up halves of one
    (``gate_up_proj [E, H, 2I]``, chunked), no biases, weighted by the router's dense scores
    ``[T, E]``."""

    def forward(self, hidden_states: torch.Tensor, routing_weights: torch.Tensor, router_indices: torch.Tensor):
        if not self.training:  # its other path is one batched matmul
            return original(self, hidden_states, routing_weights, router_indices)
        batch = hidden_states.shape[0]
        x = hidden_states.reshape(-1, self.hidden_size)
        pairs = moe_rows.Pairs.by_expert(router_indices, self.num_experts)
        picked = F.one_hot(pairs.of_choices(router_indices), self.num_experts)
        gate, up = moe_rows.grouped_mm(pairs.of_tokens(x), self.gate_up_proj, pairs.offsets).chunk(2, dim=-1)
        out = moe_rows.grouped_mm(up * self.act_fn(gate), self.down_proj, pairs.offsets)
        added = (out * (pairs.of_tokens(routing_weights) * picked).sum(-1)[..., None]).to(x.dtype)
        return pairs.added_to_tokens(torch.zeros_like(x), added).view(batch, -1, self.hidden_size)

    return forward


def _experts_linear(x, weight, offsets, bias, transposed: bool):
    """transformers 5.x's ``_grouped_linear`` per block of rows: the input cast to the weights'
    dtype, ``weight`` ``[E, out, in]`` (``[E, in, out]`` where ``transposed``), a bias per pair."""
    out = moe_rows.grouped_mm(x.to(weight.dtype), weight if transposed else weight.transpose(-2, -1), offsets)
    return out if bias is None else out + bias


def grouped_experts_forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                            top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers 5.x's ``grouped_mm`` experts (``integrations.moe.grouped_mm_experts_forward``,
    every class its ``use_experts_implementation`` decorates) with the pairs sorted within each
    chip's rows (``moe_rows``): the gate (the class's own ``_apply_gate``) or activation, biases,
    the post-expert norm, and the weighted pairs summed per token as transformers sums them."""
    pairs = moe_rows.Pairs.by_expert(top_k_index, self.num_experts)
    expert = pairs.of_choices(top_k_index)
    x = pairs.of_tokens(hidden_states)
    offsets, transposed = pairs.offsets, self.is_transposed
    if self.has_gate:
        out = _experts_linear(x, self.gate_up_proj, offsets, self.gate_up_proj_bias[expert] if self.has_bias else None,
                              transposed)
        out = self._apply_gate(out)
    else:
        out = self.act_fn(_experts_linear(x, self.up_proj, offsets,
                                          self.up_proj_bias[expert] if self.has_bias else None, transposed))
    out = _experts_linear(out, self.down_proj, offsets, self.down_proj_bias[expert] if self.has_bias else None,
                          transposed)
    if self.has_post_expert_norm:
        out = self.post_expert_norm(out)
    return pairs.weighted_sum(out, top_k_weights, hidden_states.dtype)


@contextlib.contextmanager
def _experts_interface():
    """transformers 5.x's ``grouped_mm`` experts implementation as ``grouped_experts_forward``,
    for the trace only; expert parallelism (transformers' sentinels) keeps transformers' own."""
    moe = sys.modules.get("transformers.integrations.moe")
    mapping = getattr(getattr(moe, "ExpertsInterface", None), "_global_mapping", None)
    original = mapping.get("grouped_mm") if isinstance(mapping, dict) else None
    if original is None:
        yield
        return

    def forward(self, *args, **kwargs):
        if getattr(self, "_is_expert_parallel", False) or kwargs:
            return original(self, *args, **kwargs)
        return grouped_experts_forward(self, *args)

    mapping["grouped_mm"] = forward
    try:
        yield
    finally:
        mapping["grouped_mm"] = original


# transformers 4.x's blocks that loop over the experts (transformers_methods.Replacement)
REPLACED = (
    ("mixtral", "MixtralSparseMoeBlock", "forward", _sparse_block_forward()),
    ("qwen2_moe", "Qwen2MoeSparseMoeBlock", "forward", _sparse_block_forward()),
    ("qwen3_moe", "Qwen3MoeSparseMoeBlock", "forward", _sparse_block_forward()),
    ("qwen3_next", "Qwen3NextSparseMoeBlock", "forward", _sparse_block_forward()),
    ("qwen3_omni_moe", "Qwen3OmniMoeThinkerTextSparseMoeBlock", "forward", _sparse_block_forward()),
    ("qwen3_omni_moe", "Qwen3OmniMoeTalkerTextSparseMoeBlock", "forward", _sparse_block_forward()),
    ("minimax", "MiniMaxSparseMoeBlock", "forward", _sparse_block_forward()),
    ("olmoe", "OlmoeSparseMoeBlock", "forward", _sparse_block_forward()),
    ("flex_olmo", "FlexOlmoSparseMoeBlock", "forward", _sparse_block_forward()),
    ("jamba", "JambaSparseMoeBlock", "forward", _sparse_block_forward(normalize=False)),
    ("hunyuan_v1_moe", "HunYuanMoEV1Moe", "forward", _hunyuan_forward),
    ("phimoe", "PhimoeSparseMoeBlock", "forward", _phimoe_forward),
    ("ernie4_5_moe", "Ernie4_5_MoeSparseMoeBlock", "forward", _ernie_forward),
    ("deepseek_v3", "DeepseekV3MoE", "moe", _deepseek_moe),
    ("glm4_moe", "Glm4MoeMoE", "moe", _deepseek_moe),
    ("dots1", "Dots1MoE", "moe", _deepseek_moe),
    ("longcat_flash", "LongcatFlashMoE", "moe", _deepseek_moe),
    ("glm4v_moe", "Glm4vMoeTextMoE", "moe", _deepseek_moe),
    ("gpt_oss", "GptOssExperts", "forward", _gpt_oss_experts),
    ("qwen3_vl_moe", "Qwen3VLMoeTextExperts", "forward", _stacked_glu_experts),
    *moe_routers.GRANITE,
    *moe_layouts.REPLACED_4,
)
# the same loops in 5.x too
EVERY_VERSION = moe_routers.JETMOE


@contextlib.contextmanager
def patched(trace):
    """While a step is traced: transformers 4.x's expert loops (``REPLACED``) and JetMoE's on
    both versions (``EVERY_VERSION``) as grouped matmuls, and 5.x's grouped experts, each chip
    sorting its own rows' pairs as ``trace.expert_matmuls`` says (``moe_rows``)."""
    replacements = ([*REPLACED, *EVERY_VERSION] if transformers_methods.transformers_4()
                    else [*moe_layouts.REPLACED_5, *EVERY_VERSION])
    with moe_rows.splitting(trace.expert_matmuls), transformers_methods.replaced(replacements), \
            _experts_interface():
        yield
