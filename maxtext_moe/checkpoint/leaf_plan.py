"""Which Hugging Face tensor fills which slice of MaxText's scanned parameter tree, and how.

MaxText side (read from maxtext 0.2.5's models, see `upstream.maxtext.model.param_leaves`): layers are scanned,
so a per-layer weight is one leaf with a layer axis (logical name `dense_layers` / `moe_layers` /
`layers`, at a position that differs by model and collection); routed experts add an `exp` axis.
Linear kernels are [in, out] where Hugging Face stores [out, in], and per-head kernels split a flat HF
dimension into (heads, dim). The names come from the family (`families/`).

Every target leaf gets a `LeafPlan`: which HF tensor fills each (layer, expert) slice and how.
Shape legend: L layers in a stack, E experts.
"""

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from math import prod
from typing import Any

import numpy as np

from maxtext_moe.checkpoint.relayout import StoredTensor, relayout
from maxtext_moe.errors import UserError

_LAYER_AXES = ("dense_layers", "moe_layers", "layers")
# Slices above this many elements are written in row blocks: 16M elements is 32 MB in bf16, bigger than
# DeepSeek-V3's expert and attention slices (<= 14.7M), so only the embeddings are cut (into ~57 blocks).
MAX_CHUNK_ELEMS = 16 * 2**20


@dataclass(frozen=True)
class AbstractLeaf:
  """One MaxText parameter: its collection-qualified path, shape and logical axis names."""

  path: tuple[str, ...]  # e.g. ("params", "decoder", "moe_layers", ...) or ("MoEBiasVar", "decoder", ...)
  shape: tuple[int, ...]
  names: tuple[str | None, ...]


@dataclass(frozen=True)
class LeafPlan:
  """How to fill one MaxText leaf from HF tensors: slice (layer l, expert e) <- hf_name(l, e)."""

  leaf: AbstractLeaf
  hf_template: str  # with {layer} and {e} placeholders
  first_layer: int  # HF layer index of slice 0 of the layer axis
  layer_axis: int | None
  expert_axis: int | None
  transpose: bool
  in_dims: int
  rows_per_chunk: int = 0  # > 0: split each slice into blocks of this many HF rows (big tensors only)
  scale: float = 1.0  # MaxText's value = HF's x scale (Mixtral's query kernel: 1/sqrt(head_dim))
  float32: bool = False  # kept in float32 whatever the output dtype (DeepSeek's correction bias)

  @property
  def row_axis(self) -> int | None:
    """The leaf axis that holds HF's rows (its first dim), when exactly one axis does."""
    axes = [i for i in range(len(self.leaf.shape)) if i not in (self.layer_axis, self.expert_axis)]
    rows = axes[self.in_dims :] if self.transpose else axes[:1]
    return rows[0] if len(rows) == 1 else None

  @property
  def slice_shape(self) -> tuple[int, ...]:
    return tuple(d for i, d in enumerate(self.leaf.shape) if i not in (self.layer_axis, self.expert_axis))

  @property
  def chunk_shape(self) -> tuple[int, ...]:
    return tuple(1 if i in (self.layer_axis, self.expert_axis) else d for i, d in enumerate(self.leaf.shape))

  @property
  def hf_shape(self) -> tuple[int, ...]:
    """The HF tensor's shape: [out, in] for a transposed kernel, else the MaxText slice shape."""
    s = self.slice_shape
    return (prod(s[self.in_dims :]), prod(s[: self.in_dims])) if self.transpose else s

  def slices(self) -> Iterator[tuple[str, tuple[slice, ...]]]:
    """(HF name, MaxText index) for every whole (layer, expert) slice of the leaf."""
    n_layers = self.leaf.shape[self.layer_axis] if self.layer_axis is not None else 1
    n_experts = self.leaf.shape[self.expert_axis] if self.expert_axis is not None else 1
    for li in range(n_layers):
      for e in range(n_experts):
        index = [slice(None)] * len(self.leaf.shape)
        if self.layer_axis is not None:
          index[self.layer_axis] = slice(li, li + 1)
        if self.expert_axis is not None:
          index[self.expert_axis] = slice(e, e + 1)
        yield self.hf_template.format(layer=self.first_layer + li, e=e), tuple(index)

  def chunks(self) -> Iterator[tuple[str, slice, tuple[slice, ...]]]:
    """(HF name, HF row range, MaxText index): `slices`, each cut into `rows_per_chunk`-row blocks."""
    axis = self.row_axis
    for name, index in self.slices():
      n_rows = self.hf_shape[0] if self.hf_shape else 1
      step = self.rows_per_chunk if self.rows_per_chunk > 0 and axis is not None else n_rows
      for r in range(0, max(n_rows, 1), max(step, 1)):
        rows = slice(r, min(r + step, n_rows))
        if step == n_rows:
          yield name, rows, index
        else:
          yield name, rows, tuple(rows if i == axis else s for i, s in enumerate(index))

  def write_chunk_shape(self) -> tuple[int, ...]:
    """The chunk grid: one (layer, expert) slice, or a block of `rows_per_chunk` rows of it."""
    shape = list(self.chunk_shape)
    if self.rows_per_chunk > 0 and self.row_axis is not None:
      shape[self.row_axis] = min(self.rows_per_chunk, shape[self.row_axis])
    return tuple(shape)

  def to_maxtext(self, hf: StoredTensor | np.ndarray, index: tuple[slice, ...], dtype) -> np.ndarray:
    """HF tensor (or a block of its rows), dequantized if FP8 -> a new C-ordered MaxText chunk of `dtype`
    for `index` (with size-1 layer/expert axes). Always a fresh array, never a view of `hf` (which may be
    a memmap)."""
    x = relayout(hf, dtype, transpose=self.transpose, scale=self.scale)
    return x.reshape(tuple(len(range(*s.indices(d))) for s, d in zip(index, self.leaf.shape, strict=True)))

  def to_hf(self, chunk):
    """MaxText chunk -> HF tensor (inverse of `to_maxtext`)."""
    s = self.slice_shape
    x = chunk.reshape(s)
    if not self.transpose:
      return x if self.scale == 1.0 else relayout(x, x.dtype, scale=1.0 / self.scale)
    x = x.reshape(prod(s[: self.in_dims]), prod(s[self.in_dims :]))
    return relayout(x, x.dtype, transpose=True, scale=1.0 / self.scale)


def _mapping(family: Any, path: tuple[str, ...], cfg: Any) -> tuple[str, bool, int, int] | None:
  """(HF name, transpose, in_dims, HF index of the stack's first layer) of a MaxText path (no collection)."""
  if path in family.global_table:
    return (*family.global_table[path], 0)
  for stack, first in family.stacks(cfg).items():
    n = len(stack)
    if path[:n] == stack and path[n:] in family.layer_table:
      return (*family.layer_table[path[n:]], first)
  return family.extra(path, cfg)


def _scale(family: Any, path: tuple[str, ...], cfg: Any) -> float:
  for stack in family.stacks(cfg):
    n = len(stack)
    if path[:n] == stack and path[n:] in family.scales:
      return float(family.scales[path[n:]](cfg))
  return 1.0


def leaf_plans(
  leaves: list[AbstractLeaf], family: Any, cfg: Any, *, max_chunk_elems: int = MAX_CHUNK_ELEMS
) -> list[LeafPlan]:
  """A LeafPlan for every MaxText leaf of `family`'s model `cfg`; a leaf the family's mapping does not
  know is an error, not a silent skip. Slices above `max_chunk_elems` (the embeddings) are cut into
  blocks of whole 128-row groups (FP8 scale blocks stay whole), so no chunk is bigger than that."""
  plans = []
  for leaf in leaves:
    path = leaf.path[1:]  # drop the collection ("params" / "MoEBiasVar")
    layer_axis = next((i for i, n in enumerate(leaf.names) if n in _LAYER_AXES), None)
    expert_axis = next((i for i, n in enumerate(leaf.names) if n == "exp"), None)
    found = _mapping(family, path, cfg)
    if found is None:
      raise UserError(f"no Hugging Face {family.architecture} mapping for MaxText parameter {'/'.join(leaf.path)}")
    name, transpose, in_dims, first = found
    template = name if name.startswith(("model.", "lm_head")) else f"model.layers.{{layer}}.{name}"
    float32 = name.endswith(family.float32_suffixes) if family.float32_suffixes else False
    p = LeafPlan(
      leaf, template, first, layer_axis, expert_axis, transpose, in_dims, 0, _scale(family, path, cfg), float32
    )
    elems, rows = prod(p.slice_shape), (p.hf_shape or (1,))[0]
    if elems > max_chunk_elems and p.row_axis is not None:
      p = dataclasses.replace(p, rows_per_chunk=max(1, max_chunk_elems // (elems // rows) // 128) * 128)
    plans.append(p)
  return plans
