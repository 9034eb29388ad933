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

import math
from dataclasses import dataclass

from maxtext_moe.planner.shards import mesh_axes_of, stays_split

# Logical names of a scanned layer stack's dimension: which kind of layer it holds (None: the model's kind).
_STACKS = {"moe_layers": "moe", "dense_layers": "dense", "layers": None}


@dataclass(frozen=True)
class LayerWeights:
  """Elements of one layer's weights on one device, as computed with (gathered)."""

  experts: int  # one MoE layer's expert matrices ([E_l, D, F] x 3)
  experts_sharded: bool  # stored split over an FSDP-style axis, so gathered for every layer
  moe_other: int  # one MoE layer's other weights: attention, router, shared experts, norms
  dense: int  # one dense layer's weights (a model without experts: every layer)


def _layer_elements(
  shape: tuple, names: tuple, rules: list, sizes: dict[str, int], *, stack: str, gathered: bool
) -> int:
  """Elements of one layer's slice of a stacked weight on one device: as stored, or `gathered` (its
  FSDP-style axes gathered away, as a layer computes with it)."""
  total = 1
  for dim, name, axes in zip(shape, names, mesh_axes_of(names, rules), strict=True):
    if name != stack:
      split = [a for a in axes if not gathered or stays_split(a, name)]
      total *= -(-dim // math.prod(sizes.get(a, 1) for a in split))
  return total


def of(leaves: list, rules: list, sizes: dict[str, int], *, moe_model: bool) -> LayerWeights:
  """One layer's weights of each kind, from the parameter leaves ((path, shape, logical names)), the logical
  axis rules and the mesh axis sizes. Layers that are not scanned (no stack dimension) count nothing."""
  experts = moe_other = dense = 0
  sharded = False
  for path, shape, names in leaves:
    stack = next((n for n in names if n in _STACKS), None)
    if path[0] != "params" or stack is None:
      continue
    kind = _STACKS[stack] or ("moe" if moe_model else "dense")
    computed = _layer_elements(shape, names, rules, sizes, stack=stack, gathered=True)
    if kind == "moe" and "exp" in names:
      experts += computed
      sharded |= _layer_elements(shape, names, rules, sizes, stack=stack, gathered=False) < computed
    elif kind == "moe":
      moe_other += computed
    else:
      dense += computed
  return LayerWeights(experts, sharded, moe_other, dense)
