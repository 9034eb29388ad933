"""The DeepSeek-V3 name and layout mapping between Hugging Face and MaxText's scanned parameter tree.

MaxText side (read from maxtext 0.2.5's model, see `upstream.model.param_leaves`): layers are
scanned, so a per-layer weight is one leaf with a layer axis (logical name `dense_layers` /
`moe_layers`, axis 1 for params, 0 for the `MoEBiasVar` collection that holds DeepSeek's
`e_score_correction_bias`); routed experts add an `exp` axis. Linear kernels are [in, out] where
Hugging Face stores [out, in], and MLA's per-head kernels split a flat HF dimension into (heads, dim).
The MTP module is HF layer `num_hidden_layers` (its embed_tokens and shared_head.head are copies of
the main model's and are not stored twice in MaxText).

Every target leaf gets a `LeafPlan`: which HF tensor fills each (layer, expert) slice and how.
Shape legend: L layers in a stack, E experts.
"""

import re
from collections.abc import Iterator
from dataclasses import dataclass
from math import prod

import numpy as np

from maxtext_moe.checkpoint.relayout import StoredTensor, relayout
from maxtext_moe.errors import UserError

# (MaxText path inside a layer, HF name inside `model.layers.{i}.`, transpose, leading in-dims)
# `in_dims`: how many leading dims of the MaxText slice form HF's input features (o_proj: heads x v).
_LAYER = {
  ("pre_self_attention_layer_norm", "scale"): ("input_layernorm.weight", False, 0),
  ("post_self_attention_layer_norm", "scale"): ("post_attention_layernorm.weight", False, 0),
  ("self_attention", "wq_a", "kernel"): ("self_attn.q_a_proj.weight", True, 1),
  ("self_attention", "q_norm", "scale"): ("self_attn.q_a_layernorm.weight", False, 0),
  ("self_attention", "wq_b", "kernel"): ("self_attn.q_b_proj.weight", True, 1),
  ("self_attention", "query", "kernel"): ("self_attn.q_proj.weight", True, 1),
  ("self_attention", "wkv_a", "kernel"): ("self_attn.kv_a_proj_with_mqa.weight", True, 1),
  ("self_attention", "kv_norm", "scale"): ("self_attn.kv_a_layernorm.weight", False, 0),
  ("self_attention", "wkv_b", "kernel"): ("self_attn.kv_b_proj.weight", True, 1),
  ("self_attention", "out", "kernel"): ("self_attn.o_proj.weight", True, 2),
  ("mlp", "wi_0", "kernel"): ("mlp.gate_proj.weight", True, 1),
  ("mlp", "wi_1", "kernel"): ("mlp.up_proj.weight", True, 1),
  ("mlp", "wo", "kernel"): ("mlp.down_proj.weight", True, 1),
  ("DeepSeekMoeBlock_0", "MoeBlock_0", "gate", "kernel"): ("mlp.gate.weight", True, 1),
  ("DeepSeekMoeBlock_0", "MoeBlock_0", "gate", "bias"): ("mlp.gate.e_score_correction_bias", False, 0),
  ("DeepSeekMoeBlock_0", "MoeBlock_0", "wi_0"): ("mlp.experts.{e}.gate_proj.weight", True, 1),
  ("DeepSeekMoeBlock_0", "MoeBlock_0", "wi_1"): ("mlp.experts.{e}.up_proj.weight", True, 1),
  ("DeepSeekMoeBlock_0", "MoeBlock_0", "wo"): ("mlp.experts.{e}.down_proj.weight", True, 1),
  ("DeepSeekMoeBlock_0", "shared_experts", "wi_0", "kernel"): ("mlp.shared_experts.gate_proj.weight", True, 1),
  ("DeepSeekMoeBlock_0", "shared_experts", "wi_1", "kernel"): ("mlp.shared_experts.up_proj.weight", True, 1),
  ("DeepSeekMoeBlock_0", "shared_experts", "wo", "kernel"): ("mlp.shared_experts.down_proj.weight", True, 1),
}
_GLOBAL = {
  ("token_embedder", "embedding"): ("model.embed_tokens.weight", False, 0),
  ("decoder", "decoder_norm", "scale"): ("model.norm.weight", False, 0),
  ("decoder", "logits_dense", "kernel"): ("lm_head.weight", True, 1),
}
_MTP = {
  ("mtp_1_embedding_norm", "scale"): ("enorm.weight", False, 0),
  ("mtp_1_hidden_state_norm", "scale"): ("hnorm.weight", False, 0),
  ("mtp_1_projection", "kernel"): ("eh_proj.weight", True, 1),
  ("mtp_1_final_norm", "scale"): ("shared_head.norm.weight", False, 0),
}
# HF tensors that MaxText does not store (copies of the main model's).
HF_SKIPPED = re.compile(r"model\.layers\.\d+\.(embed_tokens|shared_head\.head)\.weight$")
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
    x = relayout(hf, dtype, transpose=self.transpose)
    return x.reshape(tuple(len(range(*s.indices(d))) for s, d in zip(index, self.leaf.shape, strict=True)))

  def to_hf(self, chunk):
    """MaxText chunk -> HF tensor (inverse of `to_maxtext`)."""
    s = self.slice_shape
    x = chunk.reshape(s)
    if not self.transpose:
      return x
    return relayout(x.reshape(prod(s[: self.in_dims]), prod(s[self.in_dims :])), x.dtype, transpose=True)


def leaf_plans(
  leaves: list[AbstractLeaf], *, first_dense: int, num_layers: int, max_chunk_elems: int = MAX_CHUNK_ELEMS
) -> list[LeafPlan]:
  """A LeafPlan for every MaxText leaf; a leaf this mapping does not know is an error, not a silent skip.
  Slices above `max_chunk_elems` (the embeddings) are cut into blocks of whole 128-row groups (FP8
  scale blocks stay whole), so no chunk is bigger than that."""
  plans = []
  for leaf in leaves:
    path = leaf.path[1:]  # drop the collection ("params" / "MoEBiasVar")
    layer_axis = next((i for i, n in enumerate(leaf.names) if n in _LAYER_AXES), None)
    expert_axis = next((i for i, n in enumerate(leaf.names) if n == "exp"), None)
    found = None
    if path in _GLOBAL:
      found = (*_GLOBAL[path], 0)
    elif path[:2] == ("decoder", "dense_layers") and path[2:] in _LAYER:
      found = (*_LAYER[path[2:]], 0)
    elif path[:2] == ("decoder", "moe_layers") and path[2:] in _LAYER:
      found = (*_LAYER[path[2:]], first_dense)
    elif path[0] == "mtp_block" and (m := re.fullmatch(r"mtp_layer_(\d+)", path[1])):
      mtp_layer = num_layers + int(m.group(1)) - 1
      rest = path[2:]
      if rest in _MTP:
        found = (*_MTP[rest], mtp_layer)
      elif rest[0] == "mtp_1_transformer_layer" and rest[1:] in _LAYER:
        found = (*_LAYER[rest[1:]], mtp_layer)
    if found is None:
      raise UserError(f"no Hugging Face mapping for MaxText parameter {'/'.join(leaf.path)}")
    name, transpose, in_dims, first = found
    template = name if name.startswith(("model.", "lm_head")) else f"model.layers.{{layer}}.{name}"
    p = LeafPlan(leaf, template, first, layer_axis, expert_axis, transpose, in_dims)
    elems, rows = prod(p.slice_shape), (p.hf_shape or (1,))[0]
    if elems > max_chunk_elems and p.row_axis is not None:
      per_row = elems // rows
      p = LeafPlan(
        leaf,
        template,
        first,
        layer_axis,
        expert_axis,
        transpose,
        in_dims,
        max(1, max_chunk_elems // per_row // 128) * 128,
      )
    plans.append(p)
  return plans


def is_correction_bias(plan: LeafPlan) -> bool:
  """DeepSeek-V3's e_score_correction_bias (the gate's bias in MaxText)."""
  return plan.hf_template.endswith("e_score_correction_bias")
