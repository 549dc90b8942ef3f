"""Experts whose weights transformers keeps in layouts of their own, traced as grouped matmuls.

Why: these classes loop over the experts that got tokens (``expert_hit = (...).nonzero()``,
``torch.where(mask)``) on transformers 5.x too, outside the ``grouped_mm`` experts
implementation that ``moe_experts.grouped_experts_forward`` stands in for. Under ``jax.jit`` the
loop is a host read, and the whole forward and backward ran eagerly (``host_reads``): four
steps of a 2-layer model of 32 hidden units took 70 to 100 s here, where a compiled Mixtral
takes 4 s. While a step is traced (``moe_experts.grouped``) each runs as the others do: the
(token, expert) pairs sorted by expert within each chip's rows (``moe_rows``), one grouped
matmul per projection, each pair weighted as the loop weighs it and summed per token.

* DBRX (``DbrxExperts``, both versions): the experts' GLU weights are three ``[E * F, H]``
  parameters, viewed as ``[E, F, H]``.
* LongCat-Flash on 5.x (``LongcatFlashExperts``): ``gate_up_proj [E + Z, 2F, H]`` and
  ``down_proj [E, H, F]`` for the E routed experts, and Z zero-computation experts that hand the
  token back as it is (an index past the routed ones: such pairs sort last, in no group, and
  take the token's own row). On 4.x its ``moe`` is DeepSeek's over a list ending in
  ``nn.Identity`` experts, which ``moe_experts.mixture`` groups the same way.
* Switch Transformers (5.x's ``SwitchTransformersExperts``, 4.x's ``SwitchTransformersSparseMLP``):
  top-1 experts given as a one-hot mask after the capacity cut (a dropped token's row is all
  zeros: a sentinel, so its output is 0, as in the loop), each expert a non-gated ``wi``/``wo``
  MLP of bias-free Linears.

Anything else (PEFT's adapters on these weights, quantized layers) keeps transformers' loop.
"""

from __future__ import annotations

import torch
from torch.nn.utils import parametrize

from spmdzero.backends.torchax.patches import moe_rows


def _plain(module, *names: str) -> bool:
    """Whether ``module``'s weights ``names`` are its own (no parametrization: PEFT's adapters on
    them are one)."""
    return not any(parametrize.is_parametrized(module, name) for name in names)


def _dbrx_glu(mlp, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor, experts: int, ffn: int):
    """DBRX's experts on the tokens ``x`` ``[T, H]``: ``w2^T (act(x w1^T) * x v1^T)``."""
    pairs = moe_rows.Pairs.by_expert(chosen, experts)
    shape = (experts, ffn, x.shape[-1])
    rows = pairs.of_tokens(x)
    gate = moe_rows.grouped_mm(rows, mlp.w1.view(shape).transpose(1, 2), pairs.offsets)
    up = moe_rows.grouped_mm(rows, mlp.v1.view(shape).transpose(1, 2), pairs.offsets)
    out = moe_rows.grouped_mm(mlp.activation_fn(gate) * up, mlp.w2.view(shape), pairs.offsets)
    return pairs.weighted_sum(out, weights, x.dtype)


def _dbrx_experts(original):
    """5.x's ``DbrxExperts.forward(hidden_states, top_k_index, top_k_weights)``."""

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        mlp = self.mlp
        if not _plain(mlp, "w1", "v1", "w2"):
            return original(self, hidden_states, top_k_index, top_k_weights)
        batch = hidden_states.shape[0]
        x = hidden_states.reshape(-1, self.hidden_size)
        out = _dbrx_glu(mlp, x, top_k_index, top_k_weights, self.num_experts, self.ffn_hidden_size)
        return out.view(batch, -1, self.hidden_size)

    return forward


def _dbrx_experts_4(original):
    """4.x's ``DbrxExperts.forward(x, weights, top_weights, top_experts)``."""

    def forward(self, x: torch.Tensor, weights: torch.Tensor, top_weights: torch.Tensor, top_experts: torch.Tensor):
        mlp = self.mlp
        if not _plain(mlp, "w1", "v1", "w2"):
            return original(self, x, weights, top_weights, top_experts)
        batch, length, width = x.shape
        out = _dbrx_glu(mlp, x.view(-1, width), top_experts, top_weights, mlp.moe_num_experts, mlp.ffn_hidden_size)
        return out.reshape(batch, length, width)

    return forward


def _identity_experts(original):
    """5.x's ``LongcatFlashExperts.forward``: routed GLU experts, then zero-computation ones."""

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        if self.gate_up_proj is None or not _plain(self, "gate_up_proj", "down_proj"):
            return original(self, hidden_states, top_k_index, top_k_weights)
        routed = self.num_routed_experts
        pairs = moe_rows.Pairs.by_expert(top_k_index, routed)
        rows = pairs.of_tokens(hidden_states)
        gate, up = moe_rows.grouped_mm(rows, self.gate_up_proj[:routed].transpose(1, 2), pairs.offsets).chunk(2, -1)
        out = moe_rows.grouped_mm(self.act_fn(gate) * up, self.down_proj.transpose(1, 2), pairs.offsets)
        out = torch.where((pairs.of_choices(top_k_index) >= routed)[..., None], rows, out)
        return pairs.weighted_sum(out, top_k_weights, hidden_states.dtype)

    return forward


def _switch_grouped(experts: list, x: torch.Tensor, selected: torch.Tensor, weights: torch.Tensor):
    """Switch Transformers' experts (``wi``, activation, dropout, ``wo``) on the tokens ``x``
    ``[T, H]``, ``selected`` ``[T, 1, E]`` one-hot (zeros where the capacity dropped the token: a
    sentinel, whose output is 0 as in the loop), each token's output times ``weights`` ``[T, 1]``;
    None where the experts are not bias-free Linears."""
    plain = all(moe_rows.plain_linear(e.wi) and moe_rows.plain_linear(e.wo) for e in experts)
    if len({type(e) for e in experts}) != 1 or not plain:
        return None
    chosen = torch.where(selected.sum(-1) > 0, selected.argmax(-1), len(experts))
    pairs = moe_rows.Pairs.by_expert(chosen, len(experts))
    wi = moe_rows.stacked([e.wi for e in experts])
    wo = moe_rows.stacked([e.wo for e in experts])
    first = experts[0]
    inner = first.dropout(first.act(moe_rows.grouped_mm(pairs.of_tokens(x), wi, pairs.offsets)))
    out = moe_rows.grouped_mm(inner.to(wo.dtype), wo, pairs.offsets)
    return pairs.weighted_sum(out, weights, x.dtype)


def _switch_experts(original):
    """5.x's ``SwitchTransformersExperts.forward(hidden_states, selected_experts [T, 1, E],
    routing_weights [T, 1])``."""

    def forward(self, hidden_states: torch.Tensor, selected_experts: torch.Tensor, routing_weights: torch.Tensor):
        experts = [self[f"expert_{i}"] for i in range(self.num_experts)]
        out = _switch_grouped(experts, hidden_states, selected_experts, routing_weights)
        return original(self, hidden_states, selected_experts, routing_weights) if out is None else out

    return forward


def _switch_sparse_mlp_4(original):
    """4.x's ``SwitchTransformersSparseMLP.forward``: the router's mask ``[B, S, E]``, the experts'
    outputs scaled by the router's probability afterwards."""

    def forward(self, hidden_states: torch.Tensor):
        router_mask, router_probs, router_logits = self.router(hidden_states)
        batch, length, width = hidden_states.shape
        experts = [getattr(self.experts, f"expert_{i}") for i in range(router_mask.shape[-1])]
        x = hidden_states.reshape(-1, width)
        out = _switch_grouped(experts, x, router_mask.reshape(-1, 1, router_mask.shape[-1]), x.new_ones(x.shape[0], 1))
        if out is None:
            return original(self, hidden_states)
        return router_probs * out.view(batch, length, width), (router_logits, torch.argmax(router_mask, dim=-1))

    return forward


# transformers 4.x's (transformers_methods.Replacement)
REPLACED_4 = (("dbrx", "DbrxExperts", "forward", _dbrx_experts_4),
              ("switch_transformers", "SwitchTransformersSparseMLP", "forward", _switch_sparse_mlp_4))
# transformers 5.x's
REPLACED_5 = (("dbrx", "DbrxExperts", "forward", _dbrx_experts),
              ("longcat_flash", "LongcatFlashExperts", "forward", _identity_experts),
              ("switch_transformers", "SwitchTransformersExperts", "forward", _switch_experts))
