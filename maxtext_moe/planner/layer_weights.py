"""One layer's weights as a device computes with them: the weights term of a layer's backward in the memory
model (`estimate.py`).

A scanned layer's weights are stored split over the mesh axes their logical names resolve to. Before the
layer runs, the FSDP-style axes (fsdp, fsdp_transpose, sequence, context, data, and expert on any dimension
but the experts') are gathered away: every device computes the whole layer, except that each keeps only its
own experts (the `exp` dimension stays split over the expert axis) and tensor-parallel axes stay split.
XLA:GPU gathers them in the compute dtype (docs/design-facts.md). How many copies of these a backward holds
is XLA's (`xla_buffers.Copies`).

Example (DeepSeek-V3 671B, EP=64 x FSDP=8): an expert matrix wi_0 [256, 58, 7168, 2048] ('exp',
'moe_layers', 'embed_moe', 'mlp_moe') is stored as [4, 58, 896, 2048] per device and computed with as
[4, 7168, 2048] per layer: `experts` counts 3 such matrices, and `experts_sharded` is true.
"""

from dataclasses import dataclass

from maxtext_moe.planner.shards import shard_elements

# Logical names of a scanned layer stack's dimension: which kind of layer it holds (None: the model's kind).
_STACKS = {"moe_layers": "moe", "dense_layers": "dense", "layers": None}


@dataclass(frozen=True)
class LayerWeights:
  """Elements of one layer's weights on one device, as computed with (gathered)."""

  experts: int  # one MoE layer's expert matrices ([E_l, D, F] x 3)
  experts_sharded: bool  # stored split over an FSDP-style axis, so gathered for every layer
  moe_other: int  # one MoE layer's other weights: attention, router, shared experts, norms
  dense: int  # one dense layer's weights (a model without experts: every layer)


def of(leaves: list, rules: list, sizes: dict[str, int], *, moe_model: bool, in_block: bool = False) -> LayerWeights:
  """One layer's weights of each kind, from the parameter leaves ((path, shape, logical names)), the logical
  axis rules and the mesh axis sizes. Layers that are not scanned (no stack dimension) count nothing.
  `in_block`: the experts run in our dropless block, which gathers their tensor axes too
  (`shards.stays_split`)."""
  experts = moe_other = dense = 0
  sharded = False
  for path, shape, names in leaves:
    stack = next((n for n in names if n in _STACKS), None)
    if path[0] != "params" or stack is None:
      continue
    kind = _STACKS[stack] or ("moe" if moe_model else "dense")
    expert_leaf = kind == "moe" and "exp" in names
    computed = shard_elements(shape, names, rules, sizes, gathered=True, skip=stack, in_block=in_block and expert_leaf)
    if expert_leaf:
      experts += computed
      sharded |= shard_elements(shape, names, rules, sizes, skip=stack) < computed
    elif kind == "moe":
      moe_other += computed
    else:
      dense += computed
  return LayerWeights(experts, sharded, moe_other, dense)
