"""How a parameter is split over the mesh: the mesh axes of each dimension (MaxText's logical axis rules,
resolved as flax resolves them), a device's shard, and the axes a weight stays split over while a layer
computes with it (the others, FSDP-style, are gathered first)."""

import math

import flax.linen as nn

# Mesh axes a weight stays split over while a layer computes with it; `expert` too on the experts' own
# dimension (each device computes its own experts). The others (data, fsdp, fsdp_transpose, sequence,
# context, and expert on any other dimension) are gathered before the layer runs.
KEPT_AXES = frozenset({"tensor", "tensor_transpose", "tensor_sequence", "autoregressive", "stage"})
# MaxText's tensor parallelism: `tensor` splits every activation's embedding, heads, MLP or vocabulary
# dimension, `tensor_sequence` its sequence (base.yml's activation rules); the batch stays whole over both.
TENSOR_AXES = ("tensor", "tensor_sequence")


def tensor_ways(sizes: dict[str, int]) -> int:
  """Ways each activation is split by tensor parallelism (`TENSOR_AXES`): a device holds 1/that of the
  activations of the tokens its tensor-parallel group shares."""
  return math.prod(sizes.get(a, 1) for a in TENSOR_AXES)


def mesh_axes_of(names: tuple, rules: list) -> list[tuple[str, ...]]:
  """Mesh axes each dim of an array with logical `names` is sharded over, by flax's rule resolution (what
  MaxText's shardings use): rules in priority order, each mesh axis used at most once per array."""
  return [
    () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    for axes in nn.logical_to_mesh_axes(names, rules)
  ]


def shard_elements(
  shape: tuple,
  names: tuple,
  rules: list,
  sizes: dict[str, int],
  *,
  gathered: bool = False,
  skip: str | None = None,
  in_block: bool = False,
) -> int:
  """Elements of one device's shard of a parameter: each dim divided by the sizes of the mesh axes its
  logical name resolves to (rounded up; a layout that does not divide is refused by `divisibility.check`).
  `gathered`: only by the axes it stays split over while a layer computes (`stays_split`); `skip`: the
  dimension of that logical name left out (one layer's slice of a scanned stack); `in_block`: an expert
  weight our MoE block computes with (`stays_split`)."""
  total = 1
  for dim, name, axes in zip(shape, names, mesh_axes_of(names, rules), strict=True):
    if skip is None or name != skip:
      split = [a for a in axes if not gathered or stays_split(a, name, in_block=in_block)]
      total *= -(-dim // math.prod(sizes.get(a, 1) for a in split))
  return total


def stays_split(axis: str, name: str | None, *, in_block: bool = False) -> bool:
  """Whether a weight dimension with logical `name` stays split over mesh `axis` while a layer computes.
  `in_block`: an expert weight of our dropless block, which its shard_map takes split over the expert axis
  alone (`moe.block.moe_block`): the tensor axes are gathered like FSDP's, and split the block's tokens."""
  if in_block:
    return (axis == "expert" and name == "exp") or axis == "stage"
  return axis in KEPT_AXES or (axis == "expert" and name == "exp")
