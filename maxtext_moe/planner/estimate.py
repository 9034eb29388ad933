"""The memory model: one device's bytes at the training step's peak, from the resolved config alone.

Nothing is compiled or allocated, so it answers for 1,024 GPUs on a laptop (`memory_plan.py` searches
fixes with it).

The estimate (bytes per device; T = tokens per device, V = vocab, D = model dim, F = expert hidden dim):

  state        parameters (weight_dtype) + Adam's two moments (mu_dtype), each leaf divided by the mesh axes
               its logical names resolve to (MaxText's logical_axis_rules, flax's resolution), minus what
               offload puts on the host
  grads        one grad_dtype copy of the sharded parameters
  scan copy    with param_scan_axis != 0 the stacked layer weights are re-laid out layer-major once for the
               scanned backward (seen in XLA's buffer assignment; MaxText's param_scan_axis=0 avoids it)
  saved        what the remat policy keeps per layer: the layer input (T x D) under `full`; under `custom`
               each tensor MaxText names that the layer's backward needs, where the config puts it (attention's
               projections and output, the MLP's gated inputs, the experts' GEMM outputs); on the host when
               offloaded
  peak         the larger of two phases, each buffer counted as often as XLA keeps it live there
               (`xla_buffers`: XLA:GPU's counts for a GPU recipe, XLA:CPU's for a CPU one):
                 loss     float32 (the model's loss head's and each MTP head's) and compute-dtype T x V
                          logits-sized buffers
                 layer    the backward of one MoE layer while some logits-sized buffers are still live:
                            MoE: R routed rows x D and x F at the experts' largest moment, S received
                              rows x D
                            + attention: B x H x L x L scores (and masks) for dot-product attention; for
                              flash, 4 x T x H x (qk + v head dims)
                            + one layer's weights as computed with (`layer_weights`: gathered over FSDP,
                              each device's experts): the experts' matrices with their weight gradients,
                              the other weights of a MoE and a dense layer
                            + T x D residual-stream temporaries
                            + with FP8/MXFP8 dense GEMMs (`quantization`), their quantized operands: one
                              layer's non-expert weights and the widest GEMM input, row- and column-wise
  MoE rows R   what our dispatchers allocate, dropless sizes being worst cases:
                 local  T x K;  all_to_all  EP x cap x K (cap = T dropless);  ragged_all_to_all  T x EP x K;
                 with moe_buffers=bounded (all_to_all, ragged_all_to_all) one round's EP x (G + K - 1),
                 G = ceil(factor x T x K / EP): extra rounds cost time, not memory; MaxText's TE block
                 (te_moe_block) ragged_buffer_factor x T x K (it stops when the buffer overflows)

`maxtext-moe bench plan` checks the whole estimate against XLA:CPU's compiled `memory_analysis()`, and
`bench plan --gpu` against XLA:GPU's for every GPU model we ship. XLA:GPU's scheduler spends memory it
has to spare on overlap (docs/design-facts.md): the counts are what it keeps at the recipe's flags.
"""

import dataclasses
import math
from typing import Any

import numpy as np

from maxtext_moe.config.layout import mesh_sizes
from maxtext_moe.config.quantization import number_format
from maxtext_moe.errors import UserError
from maxtext_moe.moe.settings import outputs_recomputed, received_rows, routed_rows
from maxtext_moe.planner import layer_weights, saved_activations, xla_buffers
from maxtext_moe.planner.shards import mesh_axes_of, shard_elements

GIB = 2**30


_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1}


def dtype_bytes(dtype: Any) -> int:
  name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
  if name not in _DTYPE_BYTES:
    raise UserError(f"the planner does not know dtype '{name}'; use one of {', '.join(_DTYPE_BYTES)}")
  return _DTYPE_BYTES[name]


@dataclasses.dataclass
class Estimate:
  """One device's memory, in bytes, and where it goes."""

  params: int
  optimizer: int
  grads: int
  scan_copy: int
  saved_activations: int
  logits_phase: int
  layer_phase: int
  moe_rows: int
  moe_dispatch: int
  attention: int
  layer_weights: int  # a layer's backward: its weights gathered, the experts' weight gradients
  layer_activations: int  # a layer's backward: residual-stream temporaries
  host: int
  device_total: int
  hbm: int | None
  host_capacity: int | None
  tflops_per_step: float
  tokens_per_step: int
  fp8_copies: int = 0  # a layer's backward: the quantized copies of the dense GEMMs' operands (FP8 dense)
  host_state: int = 0  # of `host`: the optimizer state and parameters offload puts there (no activations)
  overrides: list[str] = dataclasses.field(default_factory=list)

  @property
  def fits(self) -> bool:
    device_ok = self.hbm is None or self.device_total <= self.hbm
    host_ok = self.host_capacity is None or self.host <= self.host_capacity
    return device_ok and host_ok


def _moe_rows(cfg: Any, tokens: int, ep: int, dispatch: str) -> tuple[int, int]:
  """(routed rows handed to the grouped GEMM, rows of the exchange's receive buffer) on one device
  (`moe.settings.routed_rows`, `received_rows`); (0, 0) without experts."""
  if int(cfg.num_experts) <= 1:
    return 0, 0
  factor = float(getattr(cfg, "ragged_buffer_factor", -1.0) or -1.0)
  if maxtext_te_block(cfg) and ep > 1 and factor > 0:  # TE EP's receive buffer at `factor` x the balanced load
    return math.ceil(factor * tokens * int(cfg.num_experts_per_tok)), 0
  args = (dispatch, tokens, int(cfg.num_experts_per_tok))
  kw = {"num_ranks": ep, "capacity_factor": float(cfg.moe_capacity_factor), "buffers": cfg.moe_buffers}
  kw |= {"buffer_factor": float(cfg.moe_buffer_factor), "num_experts": int(cfg.num_experts)}
  return routed_rows(*args, **kw), received_rows(*args, **kw)


def maxtext_te_block(cfg: Any) -> bool:
  """Whether the experts run in MaxText's own Transformer Engine MoE block (`te_moe_block`), not ours."""
  return bool(getattr(cfg, "te_moe_block", False)) and saved_activations.value_of(cfg.moe_impl) == "maxtext"


def ours_with_te_ep(cfg: Any, dispatch: str) -> bool:
  """Whether our block runs with TE's NCCL EP (its compiled programs' buffers, `xla_buffers`); MaxText's
  TE block keeps the counts read before TE's EP compiled."""
  return dispatch == "te_ep" and not maxtext_te_block(cfg)


def experts_recomputed(cfg: Any, dispatch: str) -> bool:
  """Whether the experts' GEMM outputs are recomputed in the backward whatever the remat policy names:
  in MaxText's TE block (TE's fused moe() keeps residuals of its own, which a policy recomputes) and in
  ours under the bounded rounds (`moe.settings.outputs_recomputed`)."""
  return maxtext_te_block(cfg) or outputs_recomputed(dispatch, cfg.moe_buffers)


def _state_bytes(cfg: Any, leaves: list, rules: list, sizes: dict[str, int]) -> tuple[int, int, int, int]:
  """(parameters, Adam state, gradients, scanned-weights copy) bytes per device, before offload."""
  w_b, g_b = dtype_bytes(cfg.weight_dtype), dtype_bytes(cfg.grad_dtype)
  mu_b = dtype_bytes(cfg.mu_dtype or cfg.weight_dtype)
  param_elems = scanned_elems = 0
  for path, shape, names in leaves:
    if path[0] != "params":
      continue
    n = shard_elements(shape, names, rules, sizes)
    param_elems += n
    if any(name in ("layers", "dense_layers", "moe_layers") for name in names):
      scanned_elems += n
  opt_slots = 2 if str(cfg.opt_type).lower().endswith(("adamw", "adam_pax")) else 0
  scan_copy = scanned_elems * w_b if int(cfg.param_scan_axis) != 0 and cfg.scan_layers else 0
  return param_elems * w_b, param_elems * mu_b * opt_slots, param_elems * g_b, scan_copy


def _logits_bytes(cfg: Any, tokens: int, d_b: int, copies: xla_buffers.Copies) -> tuple[int, int]:
  """(the loss phase's logits-sized buffers, those still live in a layer's backward): per loss head, the
  model's and each multi-token-prediction layer's."""
  vocab, narrow = int(cfg.vocab_size), d_b if d_b < 4 else 0
  mtp = int(getattr(cfg, "mtp_num_layers", 0) or 0)
  f32_logits = copies.loss_f32_logits + copies.loss_f32_logits_per_mtp_head * mtp
  loss = tokens * vocab * (f32_logits * 4 + copies.loss_narrow_logits * narrow)
  layer = tokens * vocab * (copies.layer_f32_logits * 4 + copies.layer_narrow_logits_per_head * (1 + mtp) * narrow)
  return loss, layer


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


def _layer_weights_bytes(one: layer_weights.LayerWeights, d_b: int, copies: xla_buffers.Copies, *, te_ep: bool) -> int:
  """One layer's weights in its backward (`layer_weights`): the experts' matrices (gathered, transposed and
  their weight gradients when stored split over FSDP), the other weights of a layer of each kind, gathered."""
  gathered = copies.te_ep_experts_gathered if te_ep else copies.experts_gathered
  narrow, f32 = gathered if one.experts_sharded else (copies.experts_local, 0)
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


def estimate(
  cfg: Any,
  leaves: list,
  *,
  num_devices: int,
  dispatch: str,
  hbm_gib: float | None,
  host_gib: float | None,
  tflops: float,
) -> Estimate:
  """The per-device estimate for a resolved config and its parameter leaves (see the module docstring)."""
  sizes = mesh_sizes(cfg, num_devices)
  rules = [(name, tuple(axes) if isinstance(axes, list) else axes) for name, axes in cfg.logical_axis_rules]
  d_b = dtype_bytes(cfg.dtype)
  params, optimizer, grads, scan_copy = _state_bytes(cfg, leaves, rules, sizes)

  batch_shards = math.prod(sizes.get(a, 1) for a in mesh_axes_of(("activation_batch",), rules)[0])
  tokens = int(cfg.per_device_batch_size * num_devices) * int(cfg.max_target_length) // max(batch_shards, 1)
  copies = xla_buffers.for_hardware(cfg.hardware)
  rows, received = _moe_rows(cfg, tokens, sizes.get("expert", 1), dispatch)
  te_ep = ours_with_te_ep(cfg, dispatch)
  moe_dispatch = _moe_dispatch_bytes(cfg, rows, received, d_b, copies, te_ep=te_ep)
  attention = _attention_bytes(cfg, tokens, d_b, copies)
  one = layer_weights.of(leaves, rules, sizes, moe_model=int(cfg.num_experts) > 1)
  weights = _layer_weights_bytes(one, d_b, copies, te_ep=te_ep)
  activations = copies.layer_narrow_by_d * tokens * int(cfg.emb_dim) * d_b
  fp8 = _fp8_dense_bytes(cfg, one, tokens)
  logits_phase, layer_logits = _logits_bytes(cfg, tokens, d_b, copies)
  layer_phase = layer_logits + moe_dispatch + attention + weights + activations + fp8

  saved, saved_host = saved_activations.total(cfg, tokens, d_b, rows, recomputed=experts_recomputed(cfg, dispatch))
  host = host_state = 0
  if cfg.optimizer_memory_host_offload:
    host_state, optimizer = host_state + optimizer, 0
  if cfg.parameter_memory_host_offload:
    host_state, params = host_state + params, 0
  host = saved_host + host_state
  return Estimate(
    params=params,
    optimizer=optimizer,
    grads=grads,
    scan_copy=scan_copy,
    saved_activations=saved,
    logits_phase=logits_phase,
    layer_phase=layer_phase,
    moe_rows=rows,
    moe_dispatch=moe_dispatch,
    attention=attention,
    layer_weights=weights,
    layer_activations=activations,
    fp8_copies=fp8,
    host=host,
    device_total=params + optimizer + grads + scan_copy + saved + max(logits_phase, layer_phase),
    hbm=None if hbm_gib is None else int(hbm_gib * GIB),
    host_capacity=None if host_gib is None else int(host_gib * GIB),
    tflops_per_step=tflops,
    tokens_per_step=tokens,
    host_state=host_state,
  )
