"""A layer's backward in the memory model (`estimate.py`): the buffers one MoE (or dense) layer's backward
holds beside what is saved, at a number of tokens per device (every token of the step without pipeline
stages; with them, a microbatch's inside the pipeline and the whole batch over the stages outside it,
`stages.py`): the MoE block's routed rows and receive buffers, attention's, one layer's weights as computed
with, the residual stream's temporaries and FP8's quantized copies. How many copies XLA keeps of each is
`xla_buffers`'s.
"""

import dataclasses
import math
from typing import Any

import numpy as np

from maxtext_moe.config.quantization import number_format
from maxtext_moe.errors import UserError
from maxtext_moe.moe.buffers import EpBuffers, received_rows, routed_rows
from maxtext_moe.moe.layout import exchange_chunks, expert_nodes, routing_groups
from maxtext_moe.moe.settings import outputs_recomputed
from maxtext_moe.planner import layer_weights, saved_activations, xla_buffers

_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


def dtype_bytes(dtype: Any) -> int:
  name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
  if name not in _DTYPE_BYTES:
    raise UserError(f"the planner does not know dtype '{name}'; use one of {', '.join(_DTYPE_BYTES)}")
  return _DTYPE_BYTES[name]


def opt_slots(cfg: Any) -> int:
  """Adam's moments per parameter (0 for an optimizer without state)."""
  return 2 if str(cfg.opt_type).lower().endswith(("adamw", "adam_pax")) else 0


def _moe_rows(cfg: Any, tokens: int, ep: int, dispatch: str) -> tuple[int, int]:
  """(routed rows handed to the grouped GEMM, rows of the exchange's receive buffer) on one device
  (`moe.buffers.routed_rows`, `received_rows`); (0, 0) without experts."""
  if int(cfg.num_experts) <= 1:
    return 0, 0
  factor = float(getattr(cfg, "ragged_buffer_factor", -1.0) or -1.0)
  if maxtext_te_block(cfg) and ep > 1 and factor > 0:  # TE EP's receive buffer at `factor` x the balanced load
    return math.ceil(factor * tokens * int(cfg.num_experts_per_tok)), 0
  exchange, k = ep_buffers(cfg, ep, dispatch), int(cfg.num_experts_per_tok)
  return routed_rows(exchange, tokens, k), received_rows(exchange, tokens, k)


def ep_buffers(cfg: Any, ep: int, dispatch: str) -> EpBuffers:
  """What sizes this config's expert exchange at EP `ep` under `dispatch` (`moe.buffers.EpBuffers`)."""
  nodes = expert_nodes(cfg) if ep > 1 else 1
  return EpBuffers(
    dispatch,
    cfg.moe_buffers,
    num_ranks=ep,
    num_experts=int(cfg.num_experts),
    capacity_factor=float(cfg.moe_capacity_factor),
    buffer_factor=float(cfg.moe_buffer_factor),
    nodes=nodes,
    routing_groups=routing_groups(cfg),
    chunks=exchange_chunks(cfg, nodes=nodes),
  )


def maxtext_te_block(cfg: Any) -> bool:
  """Whether the experts run in MaxText's own Transformer Engine MoE block (`te_moe_block`), not ours."""
  return bool(getattr(cfg, "te_moe_block", False)) and saved_activations.value_of(cfg.moe_impl) == "maxtext"


def our_block(cfg: Any) -> bool:
  """Whether our dropless block computes the routed experts (`moe_impl=dropless`)."""
  return saved_activations.value_of(getattr(cfg, "moe_impl", "")) == "dropless"


def ours_with_te_ep(cfg: Any, dispatch: str) -> bool:
  """Whether our block runs with TE's NCCL EP (its compiled programs' buffers, `xla_buffers`); MaxText's
  TE block keeps the counts read before TE's EP compiled."""
  return dispatch == "te_ep" and not maxtext_te_block(cfg)


def experts_recomputed(cfg: Any, dispatch: str) -> bool:
  """Whether the experts' GEMM outputs are recomputed in the backward whatever the remat policy names:
  in MaxText's TE block (TE's fused moe() keeps residuals of its own, which a policy recomputes) and in
  ours under the bounded rounds (`moe.settings.outputs_recomputed`)."""
  return maxtext_te_block(cfg) or outputs_recomputed(dispatch, cfg.moe_buffers, nodes=expert_nodes(cfg))


def _moe_dispatch_bytes(
  cfg: Any, rows: int, received: int, d_b: int, copies: xla_buffers.Copies, *, te_ep: bool
) -> int:
  """The MoE block's buffers in its backward: the routed rows at the experts' largest moment (by D and by F;
  with TE's NCCL EP as its programs keep them, by whether the experts' forward is recomputed), their 1-byte
  copies under a quantized grouped GEMM, the exchange's receive buffers."""
  emb, ffn = int(cfg.emb_dim), int(cfg.moe_mlp_dim)
  if te_ep:
    saved = saved_activations.gated_pair_kept(cfg) and not experts_recomputed(cfg, "te_ep")
    by_d, by_f = copies.te_ep_rows[1 if saved else 0]
    narrow = (by_d * emb + by_f * ffn) * d_b
  else:
    narrow = max(by_d * emb + by_f * ffn for by_d, by_f in copies.rows_narrow) * d_b
  quantized_d, quantized_f = copies.quantized_rows if number_format(cfg.moe_gemm_quantization) != "bf16" else (0, 0)
  routed = rows * (emb * copies.rows_f32_by_d * 4 + narrow + quantized_d * emb + quantized_f * ffn)
  return routed + received * emb * copies.received_narrow_by_d * d_b


def _layer_weights_bytes(
  one: layer_weights.LayerWeights, d_b: int, copies: xla_buffers.Copies, *, te_ep: bool, chunks: int = 1
) -> int:
  """One layer's weights in its backward (`layer_weights`): the experts' matrices as the block computes with
  them (gathered when stored split over FSDP; with the exchange in `chunks` > 1, their weight gradients
  summed over the chunks besides), the other weights of a layer of each kind, gathered."""
  gathered = copies.te_ep_experts_gathered if te_ep else copies.experts_gathered
  narrow, f32 = gathered if one.experts_sharded else (copies.experts_local, 0)
  narrow += copies.experts_chunk_sums * (chunks > 1)
  experts = one.experts * (narrow * d_b + f32 * 4)
  return experts + copies.layer_weight_copies * (one.moe_other + one.dense) * d_b


# Bytes per element of a quantized GEMM operand: Transformer Engine keeps a row-wise and a column-wise
# copy (the forward's and the backward's layouts), 1 byte each, and MXFP8 one E8M0 scale per 32 elements
# of each; per-tensor FP8 scales are a few floats.
_QUANTIZED_BYTES = {"fp8": 2.0, "mxfp8": 2.0 + 2 / 32}


def _fp8_dense_bytes(cfg: Any, one: layer_weights.LayerWeights, tokens: int) -> int:
  """The quantized copies the dense GEMMs add to a layer's backward when `quantization` is FP8 or MXFP8:
  one layer's non-expert weights as computed with (the router's included, a small over-count), and the
  largest GEMM input (T x the widest of D, the MLP's hidden size, heads x value head size)."""
  fmt = number_format(cfg.quantization)
  if fmt not in _QUANTIZED_BYTES:
    return 0
  widest = max(int(cfg.emb_dim), int(cfg.mlp_dim), int(cfg.num_query_heads) * int(getattr(cfg, "v_head_dim", 0) or 0))
  return int(_QUANTIZED_BYTES[fmt] * (one.moe_other + one.dense + tokens * widest))


def _attention_bytes(cfg: Any, tokens: int, d_b: int, copies: xla_buffers.Copies) -> int:
  """The attention backward's buffers: L x L scores for dot-product attention, q/k/v/out for flash."""
  seq, heads = int(cfg.max_target_length), int(cfg.num_query_heads)
  dot_product = str(cfg.attention) == "dot_product" or (
    str(cfg.attention) == "autoselected" and str(cfg.hardware) == "cpu"
  )
  if dot_product:  # the B x H x L x L scores (and their gradient), and the masks
    scores = max(tokens // seq, 1) * heads * seq * seq
    return scores * (copies.scores_narrow * d_b + copies.scores_mask)
  mla = str(cfg.attention_type) == "mla"
  qk_dim = int(getattr(cfg, "qk_nope_head_dim", 0) or 0) + int(getattr(cfg, "qk_rope_head_dim", 0) or 0)
  qk_dim = qk_dim if mla else int(cfg.head_dim)
  v_dim = int(getattr(cfg, "v_head_dim", 0) or 0) if mla else int(cfg.head_dim)
  return 4 * tokens * heads * (qk_dim + v_dim) * d_b  # flash: q, k, v, out and their gradients


def _chunks(cfg: Any, ep: int, dispatch: str) -> int:
  """The pieces our block's exchange runs in (`moe_exchange_chunks`), 1 without one."""
  if int(cfg.num_experts) <= 1 or ep <= 1 or not our_block(cfg) or dispatch == "te_ep":
    return 1
  return exchange_chunks(cfg, nodes=expert_nodes(cfg))


def _residual_copies(cfg: Any, copies: xla_buffers.Copies) -> int:
  """[T, D] residual-stream temporaries of a layer's backward, by attention: MLA's (its projections' inputs,
  norms and their gradients at the residual width) or a plain one's."""
  mla = saved_activations.value_of(cfg.attention_type) == "mla"
  return copies.layer_narrow_by_d_mla if mla else copies.layer_narrow_by_d


@dataclasses.dataclass(frozen=True)
class LayerPhase:
  """Bytes of one layer's backward by buffer (the logits still live then are the caller's)."""

  tokens: int
  rows: int  # MoE rows handed to the grouped GEMM
  moe_dispatch: int
  attention: int
  weights: int
  activations: int
  fp8: int
  attention_saved: bool = False  # the policy keeps attention's q, k, v and output for its backward

  @property
  def total(self) -> int:
    """The larger of the layer's two moments, each with the weights, temporaries and FP8 copies: the experts'
    backward (their rows, and attention's q, k, v and output when the policy recomputes them: live until
    attention's backward, which runs after the experts'), and attention's backward (its buffers)."""
    at_experts = self.moe_dispatch + (0 if self.attention_saved else self.attention)
    return max(at_experts, self.attention) + self.weights + self.activations + self.fp8


def of(cfg: Any, one: layer_weights.LayerWeights, tokens: int, *, ep: int, dispatch: str) -> LayerPhase:
  """The backward of one layer at `tokens` per device (see the module docstring)."""
  d_b = dtype_bytes(cfg.dtype)
  copies = xla_buffers.for_config(cfg)
  rows, received = _moe_rows(cfg, tokens, ep, dispatch)
  te_ep = ours_with_te_ep(cfg, dispatch)
  return LayerPhase(
    tokens=tokens,
    rows=rows,
    moe_dispatch=_moe_dispatch_bytes(cfg, rows, received, d_b, copies, te_ep=te_ep),
    attention=_attention_bytes(cfg, tokens, d_b, copies),
    attention_saved=saved_activations.attention_saved(cfg),
    weights=_layer_weights_bytes(one, d_b, copies, te_ep=te_ep, chunks=_chunks(cfg, ep, dispatch)),
    activations=_residual_copies(cfg, copies) * tokens * int(cfg.emb_dim) * d_b,
    fp8=_fp8_dense_bytes(cfg, one, tokens),
  )
