"""GraniteMoE's and JetMoE's mixtures of experts traced as one program, each chip routing its own rows.

Why: their router sorts the (token, expert) pairs over the whole batch and reads each expert's
count into a list (``expert_size.tolist()``) to split them: a host read under ``jax.jit``, so the
step ran eagerly (JetMoE's 4 zoo steps: 80 s on 5.x, 6 s compiled). And a sort over the whole
batch, which the step splits over the chips, moves every chip's pairs to the others
(``moe_rows``). So, while a step is traced (``moe_experts.grouped``), their blocks are restated:

* the ``forward`` of GraniteMoE's, GraniteMoE-Shared's and Granite 4.0's (GraniteMoeHybrid)
  block on 4.x, and JetMoE's blocks on both versions (its experts' ``forward``, its attention
  experts' ``map`` and ``reduce``): the routing as the router computes it, and the experts' 3-D
  projections over each chip's pairs (``moe_rows``);
* their routers and experts too, for a block that keeps its own code (its experts not 3-D
  weights): the count stays a tensor, and the split-and-loop is one grouped matmul over the
  router's sorted pairs.

On transformers 5.x GraniteMoE's experts are ``use_experts_implementation``'s, which
``moe_experts.grouped_experts_forward`` replaces.
"""

from __future__ import annotations

import torch

from spmdzero.backends.torchax.patches import moe_rows, transformers_methods


def _stacked_experts(*linears) -> bool:
    """Whether each of GraniteMoE's or JetMoE's ``ParallelExperts`` is its 3-D weight."""
    return all(isinstance(getattr(linear, "weight", None), torch.Tensor) and linear.weight.dim() == 3
               for linear in linears)


def _routed(self, layer_input: torch.Tensor):
    """GraniteMoE's and JetMoE's routing of ``layer_input`` ``[batch, length, width]``, as the
    router's lines compute it: its logits (the module called, so that the hooks recording them
    see it; what it sorts goes unused), the top k of them and a softmax over those (the gates),
    and the pairs sorted within each chip's rows. Returns the rows ``[T, width]``, the logits,
    the gates ``[T, k]`` and the ``moe_rows.Pairs``."""
    x = layer_input.reshape(-1, layer_input.shape[-1])
    logits = self.router(x)[4]
    top_logits, chosen = logits.topk(self.router.top_k, dim=1)
    gates = torch.softmax(top_logits, dim=1).type_as(x)
    return x, logits, gates, moe_rows.Pairs.by_expert(chosen, self.router.num_experts)


def _routed_block_forward(original):
    """The ``forward`` of GraniteMoE's block (GraniteMoE-Shared's and Granite 4.0's alike, 4.x)
    and of JetMoE's (both versions, its output bias added): the experts' two projections (3-D
    weights ``[E, out, in]``, the first one's halves gated) over each chip's pairs
    (``moe_rows``), not over the router's one list sorted over the whole batch. 4.x's blocks
    return the router's logits too."""

    def forward(self, layer_input: torch.Tensor):
        if not _stacked_experts(self.input_linear, self.output_linear):
            return original(self, layer_input)
        batch, length, _ = layer_input.size()
        x, logits, gates, pairs = _routed(self, layer_input)
        gate, up = moe_rows.grouped_mm(pairs.of_tokens(x), self.input_linear.weight.transpose(1, 2),
                                       pairs.offsets).chunk(2, dim=-1)
        out = moe_rows.grouped_mm(self.activation(gate) * up, self.output_linear.weight.transpose(1, 2),
                                  pairs.offsets)
        out = out * pairs.of_choices(gates)[..., None]
        zeros = torch.zeros((batch * length, self.input_size), dtype=out.dtype, device=out.device)
        out = pairs.added_to_tokens(zeros, out).view(batch, length, self.input_size)
        if getattr(self, "bias", None) is not None:  # JetMoE
            out = out + self.bias
        return (out, logits) if transformers_methods.transformers_4() else out

    return forward


def _attention_experts_map(original):
    """JetMoE's mixture of attention heads, its ``map``: each pair's query projection, by each
    chip's pairs, back in (token, choice) order; the pairs go on to ``reduce`` in its
    ``topo_info``."""

    def map(self, layer_input: torch.Tensor):
        if not _stacked_experts(self.input_linear, self.output_linear):
            return original(self, layer_input)
        batch, length, _ = layer_input.size()
        x, logits, gates, pairs = _routed(self, layer_input)
        out = moe_rows.grouped_mm(pairs.of_tokens(x), self.input_linear.weight.transpose(1, 2), pairs.offsets)
        return pairs.unsorted(out).view(batch, length, self.top_k, -1), logits, (pairs, gates)

    return map


def _attention_experts_reduce(original):
    """JetMoE's mixture of attention heads, its ``reduce``: each pair's output projection by
    the pairs ``map`` sorted, weighted and added to its token, plus the bias."""

    def reduce(self, layer_input: torch.Tensor, topo_info):
        if not isinstance(topo_info[0], moe_rows.Pairs):
            return original(self, layer_input, topo_info)
        pairs, gates = topo_info
        batch, length, choices, width = layer_input.size()
        x = pairs.of_choices(layer_input.reshape(batch * length, choices, width))
        out = moe_rows.grouped_mm(x, self.output_linear.weight.transpose(1, 2), pairs.offsets)
        out = out * pairs.of_choices(gates)[..., None]
        zeros = torch.zeros((batch * length, self.input_size), dtype=out.dtype, device=out.device)
        return pairs.added_to_tokens(zeros, out).view(batch, length, self.input_size) + self.bias

    return reduce


def _top_k_gating(original):
    """GraniteMoE's and JetMoE's router, its lines with the experts' token counts left a tensor
    (transformers reads them into a list, ``expert_size.tolist()``, to split the sorted pairs)."""

    def forward(self, hidden_states: torch.Tensor):
        logits = self.layer(hidden_states).float()
        top_k_logits, top_k_indices = logits.topk(self.top_k, dim=1)
        top_k_gates = torch.softmax(top_k_logits, dim=1).type_as(hidden_states)
        zeros = torch.zeros([top_k_gates.size(0), self.num_experts], dtype=top_k_gates.dtype, device=top_k_gates.device)
        expert_size = zeros.scatter(1, top_k_indices, 1).long().sum(0)
        _, index_sorted_experts = top_k_indices.flatten().sort(0)
        batch_index = index_sorted_experts.div(self.top_k, rounding_mode="trunc")
        batch_gates = top_k_gates.flatten()[index_sorted_experts]
        return index_sorted_experts, batch_index, batch_gates, expert_size, logits

    return forward


def _parallel_experts(original):
    """GraniteMoE's and JetMoE's experts over pairs sorted by expert: with the token counts a
    tensor (``_top_k_gating``), one grouped matmul instead of a split and a loop."""

    def forward(self, inputs: torch.Tensor, expert_size):
        if not isinstance(expert_size, torch.Tensor):
            return original(self, inputs, expert_size)
        offsets = torch.cumsum(expert_size, 0).to(torch.int32)
        return torch._grouped_mm(inputs, self.weight.transpose(1, 2), offs=offsets)

    return forward


def _entries(model: str, prefix: str, blocks: tuple) -> tuple:
    return (*((model, f"{prefix}{block}", method, replacement) for block, method, replacement in blocks),
            (model, f"{prefix}TopKGating", "forward", _top_k_gating),
            (model, f"{prefix}ParallelExperts", "forward", _parallel_experts))


# transformers 4.x's (transformers_methods.Replacement)
GRANITE = (*_entries("granitemoe", "GraniteMoe", (("MoE", "forward", _routed_block_forward),)),
           *_entries("granitemoeshared", "GraniteMoeShared", (("MoE", "forward", _routed_block_forward),)),
           *_entries("granitemoehybrid", "GraniteMoeHybrid", (("MoE", "forward", _routed_block_forward),)))
# transformers 4.x's and 5.x's
JETMOE = _entries("jetmoe", "JetMoe", (("MoE", "forward", _routed_block_forward),
                                      ("MoA", "map", _attention_experts_map),
                                      ("MoA", "reduce", _attention_experts_reduce)))
