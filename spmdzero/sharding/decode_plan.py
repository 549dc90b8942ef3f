"""The layout of generation, as pure data: DeepSpeed's Hybrid Engine, the SPMD way.

Training lays a ZeRO-3 model's weights out by ``fsdp`` (``plan.py``): gathered whole for every
use. Decoding reads every weight once per token, so gathering them would send the whole model
per token. Generation instead lays the weights out tensor-parallel, as DeepSpeed's Hybrid
Engine copies them into its inference containers (``ReplaceWithTensorSlicing``: QKV and the
MLP's input by columns, the attention output and the MLP's output by rows): each chip of a
``tensor`` group holds its heads and its MLP columns, the activations between blocks are
all-reduced, and the KV cache is split by heads. The ``data`` axis splits the batch over the
groups. The compiler inserts the collectives from these annotations.

``decode_plan(named shapes, mesh shape, kv heads)`` gives, per weight, its partition spec, and
the KV cache's; it needs no device. The roles come from the weights' names: the projection
names of the model families transformers builds this way (Llama, Mistral, Qwen, Gemma, Phi-3,
GPT-NeoX, OPT, BLOOM, Falcon; T5's and BART's encoders and decoders). A weight with no role, or whose split dim does not divide by
the group, is replicated (norms, biases, position tables)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping

DATA_AXIS, TENSOR_AXIS = "data", "tensor"

# the last part of a Linear weight's module name -> which dim of its [out, in] weight splits
COLUMN = ("q_proj", "k_proj", "v_proj", "qkv_proj", "gate_proj", "up_proj", "gate_up_proj", "query_key_value",
          "fc1", "dense_h_to_4h", "q", "k", "v", "wi", "wi_0", "wi_1")  # output features: heads, MLP columns
ROW = ("o_proj", "down_proj", "dense", "fc2", "dense_4h_to_h", "out_proj", "o", "wo")  # input features: the rows
EMBEDDING = ("embed_tokens", "word_embeddings", "wte", "embed_in", "shared")  # [vocab, width]: split the width
OUTPUT = ("lm_head", "embed_out")  # [vocab, width]: split the vocabulary

PartitionSpec = tuple


@dataclass(frozen=True)
class DecodePlan:
    """Per weight, its layout during generation; the KV cache's layout ``[batch, kv heads,
    length, head dim]``; the mesh it is for."""

    mesh_shape: Mapping[str, int]
    weights: Mapping[str, PartitionSpec]
    cache: PartitionSpec

    @property
    def tensor_parallel(self) -> int:
        return self.mesh_shape[TENSOR_AXIS]

    def describe(self) -> str:
        split = sum(1 for spec in self.weights.values() if any(spec))
        heads = "split by heads" if self.cache[1] else "replicated over the tensor group (fewer KV heads than chips)"
        return (f"generation layout: {self.mesh_shape[DATA_AXIS]} data x {self.tensor_parallel} tensor-parallel; "
                f"{split} of {len(self.weights)} weights split, KV cache {heads}")


def _role(name: str) -> str | None:
    parts = name.split(".")
    owner = parts[-2] if len(parts) > 1 else ""
    for role, names in (("column", COLUMN), ("row", ROW), ("embedding", EMBEDDING), ("output", OUTPUT)):
        if owner in names:
            return role
    return None


def weight_spec(name: str, shape: tuple, tensor: int) -> PartitionSpec:
    """The layout of one weight (see the module docstring)."""
    role = _role(name)
    if len(shape) != 2 or role is None or tensor == 1:
        return (None,) * len(shape)
    dim = {"column": 0, "output": 0, "row": 1, "embedding": 1}[role]
    if shape[dim] % tensor:
        return (None,) * len(shape)
    return tuple(TENSOR_AXIS if d == dim else None for d in range(2))


def decode_plan(named_shapes: Iterable[tuple[str, tuple]], data: int, tensor: int, kv_heads: int) -> DecodePlan:
    """The generation layout of these weights on a ``data x tensor`` mesh."""
    if data < 1 or tensor < 1:
        raise ValueError(f"a generation mesh needs positive axes, got data={data}, tensor={tensor}")
    weights = {name: weight_spec(name, tuple(shape), tensor) for name, shape in named_shapes}
    heads = TENSOR_AXIS if tensor > 1 and kv_heads % tensor == 0 else None
    return DecodePlan({DATA_AXIS: data, TENSOR_AXIS: tensor}, weights, (DATA_AXIS, heads, None, None))
