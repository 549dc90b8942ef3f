"""transformers 4.x's mixtures of experts traced as one program: the experts as grouped matmuls.

Why: transformers 4.x's mixture-of-experts blocks loop over the experts that got tokens
(``expert_hit = (...).nonzero()``) and pick each one's tokens with ``torch.where(mask)``: shapes
read from the values. Under ``jax.jit`` that is a host read, so the whole forward and backward
of every such model (Mixtral, Qwen2-MoE, Qwen3-MoE, MiniMax, DeepSeek-V3, GLM-4.5, gpt-oss) ran
eagerly, op by op (``host_reads``), and each new count of tokens per expert compiled its ops
again: 60 to 210 s for four steps of a 2-layer model of 32 hidden units here, against 5 to 13 s
compiled; hopeless at real sizes. transformers 5.x routes the same blocks through ``grouped_mm``,
which ``lowerings.grouped_mm`` lowers.

While a step is traced (``grouped``), those 4.x blocks compute the same sum with static shapes:
the (token, chosen expert) pairs sorted by expert, each expert's projections stacked, and each
projection one grouped matmul over the sorted pairs (``torch._grouped_mm``, lowered to
``jax.lax.ragged_dot``); each pair's output is weighted and added back to its token
(``index_add_``). Every token reaches the experts it chose and no other, in the loop's order
(expert by expert), so the values are the loop's. The routing, shared experts and everything
around the experts compute what transformers 4.x's lines do, restated here:

* ``MixtralSparseMoeBlock``, ``Qwen2MoeSparseMoeBlock``, ``Qwen3MoeSparseMoeBlock``,
  ``MiniMaxSparseMoeBlock``: ``forward`` (router softmax, top-k, normalized as the block says,
  Mixtral's jitter, Qwen2-MoE's shared expert);
* ``DeepseekV3MoE``, ``Glm4MoeMoE``: ``moe`` (the experts given the router's choice, summed in its
  weights' dtype);
* ``GptOssExperts``: ``forward`` where it loops (in training; its other path is one batched matmul).

An expert whose projections are not plain bias-free ``nn.Linear`` layers (PEFT's LoRA on the
experts, say) keeps transformers' loop, and so does any other class: such a block still trains,
eagerly. transformers 5.x is left alone. The torch_xla backend cuts its graph at the read instead.
"""

from __future__ import annotations

import contextlib
import sys
from typing import Optional

import torch
import torch.nn.functional as F

# an expert MLP's projections, as (gate, up, down) attribute names: down(act(gate(x)) * up(x))
PROJECTIONS = (("w1", "w3", "w2"), ("gate_proj", "up_proj", "down_proj"))


def _pairs_by_expert(chosen: torch.Tensor, experts: int):
    """The (token, choice) pairs of ``chosen`` ``[T, K]`` sorted by expert, stably (the loop's
    order): each pair's token and its flat index, and the end offset of each expert's group."""
    flat = chosen.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = F.one_hot(flat, experts + 1)[:, :experts].sum(0)  # an index past the experts counts nowhere
    return order // chosen.shape[1], order, torch.cumsum(counts, 0).to(torch.int32)


def _stacked(experts, attributes) -> Optional[list]:
    """Each projection's weights over the experts, ``[E, in, out]`` for a grouped matmul; None
    unless every expert's projection is a plain bias-free Linear."""
    stacks = []
    for name in attributes:
        layers = [getattr(e, name, None) for e in experts]
        if not all(type(layer) is torch.nn.Linear and layer.bias is None for layer in layers):
            return None
        stacks.append(torch.stack([layer.weight for layer in layers]).transpose(1, 2))
    return stacks


def grouped_experts(experts) -> Optional[tuple]:
    """``(activation, gate, up, down)`` of experts that are MLPs of plain Linear layers, their
    weights stacked; None otherwise (the caller keeps transformers' loop)."""
    experts = list(experts)
    if not experts or len({type(e) for e in experts}) != 1 or not hasattr(experts[0], "act_fn"):
        return None
    stacks = next((s for s in (_stacked(experts, a) for a in PROJECTIONS) if s is not None), None)
    return None if stacks is None else (experts[0].act_fn, *stacks)


def mixture(hidden: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, grouped: tuple, dtype: torch.dtype
            ) -> torch.Tensor:
    """``sum over k of weights[t, k] * experts[chosen[t, k]](hidden[t])`` for each token ``t``,
    in ``dtype``, as transformers' loop adds them; ``grouped``: ``grouped_experts``'s answer."""
    act_fn, gate, up, down = grouped
    tokens, order, offsets = _pairs_by_expert(chosen, gate.shape[0])
    x = hidden[tokens]
    inner = act_fn(torch._grouped_mm(x, gate, offs=offsets)) * torch._grouped_mm(x, up, offs=offsets)
    out = torch._grouped_mm(inner, down, offs=offsets)
    added = (out * weights.reshape(-1)[order][:, None]).to(dtype)
    return torch.zeros(hidden.shape, dtype=dtype, device=hidden.device).index_add_(0, tokens, added)


def _sparse_block_forward(original):
    """Mixtral's, Qwen2-MoE's, Qwen3-MoE's and MiniMax's ``forward`` with the experts as ``mixture``."""

    def forward(self, hidden_states: torch.Tensor):
        grouped = grouped_experts(self.experts)
        if grouped is None:
            return original(self, hidden_states)
        batch, length, width = hidden_states.shape
        jitter = getattr(self, "jitter_noise", 0)
        if self.training and jitter > 0:
            hidden_states *= torch.empty_like(hidden_states).uniform_(1.0 - jitter, 1.0 + jitter)
        hidden_states = hidden_states.view(-1, width)
        router_logits = self.gate(hidden_states)
        weights = F.softmax(router_logits, dim=1, dtype=torch.float)
        weights, chosen = torch.topk(weights, self.top_k, dim=-1)
        if getattr(self, "norm_topk_prob", True):  # Mixtral always normalizes
            weights /= weights.sum(dim=-1, keepdim=True)
        weights = weights.to(hidden_states.dtype)
        out = mixture(hidden_states, chosen, weights, grouped, hidden_states.dtype)
        if hasattr(self, "shared_expert"):  # Qwen2-MoE
            out = out + F.sigmoid(self.shared_expert_gate(hidden_states)) * self.shared_expert(hidden_states)
        return out.reshape(batch, length, width), router_logits

    return forward


def _deepseek_moe(original):
    """DeepSeek-V3's ``moe``: the routed experts, summed in the router weights' dtype."""

    def moe(self, hidden_states: torch.Tensor, topk_indices: torch.Tensor, topk_weights: torch.Tensor):
        grouped = grouped_experts(self.experts)
        if grouped is None:
            return original(self, hidden_states, topk_indices, topk_weights)
        return mixture(hidden_states, topk_indices, topk_weights, grouped, topk_weights.dtype).type(hidden_states.dtype)

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
        tokens, order, offsets = _pairs_by_expert(router_indices, experts)
        expert = router_indices.reshape(-1)[order]
        valid = expert < experts
        expert = expert.clamp(max=experts - 1)
        xs = x[tokens]
        gate_up = torch._grouped_mm(xs, self.gate_up_proj, offs=offsets) + self.gate_up_proj_bias[expert]
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = gate.clamp(min=None, max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        gated = (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
        out = torch._grouped_mm(gated, self.down_proj, offs=offsets) + self.down_proj_bias[expert]
        scale = torch.where(valid, routing_weights[tokens, expert], 0)
        added = (out * scale[:, None]).to(x.dtype)
        return torch.zeros_like(x).index_add_(0, tokens, added).view(batch, -1, self.hidden_size)

    return forward


# (module, class, method, replacement): transformers 4.x's blocks that loop over the experts
REPLACED = (
    ("transformers.models.mixtral.modeling_mixtral", "MixtralSparseMoeBlock", "forward", _sparse_block_forward),
    ("transformers.models.qwen2_moe.modeling_qwen2_moe", "Qwen2MoeSparseMoeBlock", "forward", _sparse_block_forward),
    ("transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3MoeSparseMoeBlock", "forward", _sparse_block_forward),
    ("transformers.models.minimax.modeling_minimax", "MiniMaxSparseMoeBlock", "forward", _sparse_block_forward),
    ("transformers.models.deepseek_v3.modeling_deepseek_v3", "DeepseekV3MoE", "moe", _deepseek_moe),
    ("transformers.models.glm4_moe.modeling_glm4_moe", "Glm4MoeMoE", "moe", _deepseek_moe),
    ("transformers.models.gpt_oss.modeling_gpt_oss", "GptOssExperts", "forward", _gpt_oss_experts),
)


def _transformers_4() -> bool:
    transformers = sys.modules.get("transformers")
    return transformers is not None and str(getattr(transformers, "__version__", "")).startswith("4.")


@contextlib.contextmanager
def grouped():
    """While a step is traced: transformers 4.x's expert loops (``REPLACED``, in the modules
    already imported) as grouped matmuls."""
    if not _transformers_4():
        yield
        return
    saved = []
    for module_name, class_name, method, replacement in REPLACED:
        cls = getattr(sys.modules.get(module_name), class_name, None)
        if cls is None or method not in cls.__dict__:
            continue
        original = cls.__dict__[method]
        saved.append((cls, method, original))
        setattr(cls, method, replacement(original))
    try:
        yield
    finally:
        for cls, method, original in reversed(saved):
            setattr(cls, method, original)
