"""Per-token counts of the step-time model: the forward FLOPs of MaxText's custom-remat tensors (what a
policy recomputes) and the memory-bound ops' bytes (`workload` multiplies them by tokens and layers)."""

from typing import Any

from maxtext_moe.planner.estimate import dtype_bytes
from maxtext_moe.planner.loss_phase import tiles
from maxtext_moe.planner.saved_activations import value_of

_REMAT_NAMES = (
  "query_proj",
  "key_proj",
  "value_proj",
  "query_wa_proj",
  "kv_wa_proj",
  "out_proj",
  "context",
  "mlpwi_0",
  "mlpwi_1",
  "mlpwo",
  "moe_mlpwi_0",
  "moe_mlpwi_1",
  "moe_mlpwo",
)


def projection_shapes(cfg: Any) -> dict[str, tuple[int, int]]:
  """(N, K) of every GEMM of one MoE layer by the name MaxText's custom remat gives its output (the routed
  experts' per token and expert, the shared experts' all of them together)."""
  emb, heads = int(cfg.emb_dim), int(cfg.num_query_heads)
  ffn, shared = int(cfg.moe_mlp_dim), int(cfg.shared_experts or 0)
  if str(cfg.attention_type) == "mla":
    nope, rope, v = int(cfg.qk_nope_head_dim), int(cfg.qk_rope_head_dim), int(cfg.v_head_dim)
    q_lora, kv_lora = int(cfg.q_lora_rank), int(cfg.kv_lora_rank)
    out = {"query_wa_proj": (q_lora, emb)} if q_lora else {}
    out |= {
      "query_proj": (heads * (nope + rope), q_lora or emb),
      "kv_wa_proj": (kv_lora + rope, emb),
      "key_proj": (heads * nope, kv_lora),
      "value_proj": (heads * v, kv_lora),
      "out_proj": (emb, heads * v),
    }
  else:
    hd, kv = int(cfg.head_dim), int(cfg.num_kv_heads)
    out = {"query_proj": (heads * hd, emb), "key_proj": (kv * hd, emb), "value_proj": (kv * hd, emb)}
    out["out_proj"] = (emb, heads * hd)
  out |= {"moe_mlpwi_0": (ffn, emb), "moe_mlpwi_1": (ffn, emb), "moe_mlpwo": (emb, ffn)}
  if shared:
    out |= {"mlpwi_0": (ffn * shared, emb), "mlpwi_1": (ffn * shared, emb), "mlpwo": (emb, ffn * shared)}
  return out


def _per_token_forward_flops(cfg: Any) -> dict[str, float]:
  """Forward FLOPs per token of one MoE layer's named tensors (the names of MaxText's custom remat)."""
  k = int(cfg.num_experts_per_tok)
  out = {n: 2 * nn * kk * (k if n.startswith("moe_") else 1) for n, (nn, kk) in projection_shapes(cfg).items()}
  seq, heads = int(cfg.max_target_length), int(cfg.num_query_heads)
  if str(cfg.attention_type) == "mla":
    qk, v = int(cfg.qk_nope_head_dim) + int(cfg.qk_rope_head_dim), int(cfg.v_head_dim)
    out["context"] = 2 * seq * heads * (qk + v) / 2  # causal
  else:
    out["context"] = 4 * seq * heads * int(cfg.head_dim) / 2
  return {n: out.get(n, 0) for n in _REMAT_NAMES}


def gemm_shapes(cfg: Any, rows: int, dense_layers: int, moe_layers: int) -> dict[str, list[tuple]]:
  """{class: [(M, N, K, FLOPs per step share)]} of one GPU's GEMMs: the dense ones at `rows` (tokens per
  micro-batch), the routed experts' at their rows per GPU (`rows` x top-k, every local expert in one
  grouped kernel), the unembedding at `rows` x vocabulary."""
  k = int(cfg.num_experts_per_tok)
  out: dict[str, list[tuple]] = {"dense": [], "grouped": [], "head": []}
  for name, (n, kk) in projection_shapes(cfg).items():
    if name.startswith("moe_"):
      out["grouped"].append((rows * k, n, kk, 2.0 * n * kk * k * moe_layers))
    elif not name.startswith("mlp"):
      out["dense"].append((rows, n, kk, 2.0 * n * kk * (moe_layers + dense_layers)))
    else:
      out["dense"].append((rows, n, kk, 2.0 * n * kk * moe_layers))
  mlp, emb = int(cfg.mlp_dim), int(cfg.emb_dim)
  if dense_layers:  # the dense layers' gated MLP
    out["dense"] += [(rows, mlp, emb, 4.0 * mlp * emb * dense_layers), (rows, emb, mlp, 2.0 * mlp * emb * dense_layers)]
  out["head"].append((rows, int(cfg.vocab_size), emb, 2.0 * int(cfg.vocab_size) * emb))
  return out


def recompute_tflops(cfg: Any, tokens: int, layers: int, moe_layers: int) -> tuple[dict[str, float], str]:
  """({class: TFLOPs the custom remat policy recomputes per step}, how it was counted); `full` is counted
  by the caller (the whole forward again)."""
  policy = str(cfg.remat_policy)
  if policy == "full":
    return {}, "remat_policy full: the whole forward again"
  if policy != "custom":
    return {}, f"remat_policy {policy}: recompute not modelled (counted as none)"
  per_token = _per_token_forward_flops(cfg)
  # A dense MLP's down projection (`mlpwo`) is never kept: its output feeds only the residual add, whose
  # backward reads nothing of it, so MaxText's backward never runs it again whatever its key says.
  names = [n for n in _REMAT_NAMES if n != "mlpwo" and value_of(getattr(cfg, n, "device")) == "remat"]
  out = {"dense": 0.0, "grouped": 0.0, "attention": 0.0}
  dense_layers = layers - moe_layers
  for n in names:
    cls = "grouped" if n.startswith("moe_") else "attention" if n == "context" else "dense"
    out[cls] += per_token.get(n, 0) * tokens * (moe_layers if n.startswith(("moe_", "mlp")) else layers) / 1e12
    if n in ("mlpwi_0", "mlpwi_1") and dense_layers:  # the same names in the dense layers' wider MLP
      out[cls] += 2 * int(cfg.emb_dim) * int(cfg.mlp_dim) * tokens * dense_layers / 1e12
  return out, "remat_policy custom: recomputes " + (", ".join(names) or "nothing")


def head_rerun_tflops(cfg: Any, tokens: int, full: bool) -> float:
  """TFLOPs per step of the output head's forward run again: MaxText's vocab tiling (`num_vocab_tiling` > 1)
  computes each chunk's logits again in its backward (`vocab_tiling_nnx_loss`). Under `full` remat the
  caller's whole-forward-again already counts the head's forward (MaxText's remat covers the decoder layers
  only, so without tiling that share is not run: an over-count of 2 x D x V per token left as it was)."""
  tiled = tiles(cfg) > 1
  return 2 * tokens * int(cfg.emb_dim) * int(cfg.vocab_size) / 1e12 if tiled and not full else 0.0


QUANT_BYTES = {"fp8": 5, "mxfp8": 4, "bf16": 0}  # per element quantized: amax read + read + write; MX: read + 2 writes
# A GEMM epilogue that writes the next GEMM's input: bytes per element (bf16; FP8 one copy; MXFP8 row- and
# column-wise copies for the forward and the weight gradient).
EPILOGUE_BYTES = {"fp8": 1, "mxfp8": 2}


def memory_bytes_per_token(
  cfg: Any, rows_per_token: float, fmts: dict[str, str], fused_mlp: bool = False
) -> tuple[float, float]:
  """(MoE layer, dense layer) forward bytes per token read and written by memory-bound ops (the module
  docstring), plus the quantization of every FP8/MXFP8 GEMM's input (`QUANT_BYTES` per element). With
  `fused_mlp` (Transformer Engine's fused grouped MLP) the routed experts' gated activation and the
  quantization of their down projection's input run in the first GEMM's epilogue, which writes only that
  input (`EPILOGUE_BYTES`)."""
  emb, heads = int(cfg.emb_dim), int(cfg.num_query_heads)
  act_b = dtype_bytes(cfg.dtype)
  if str(cfg.attention_type) == "mla":
    qk, v = int(cfg.qk_nope_head_dim) + int(cfg.qk_rope_head_dim), int(cfg.v_head_dim)
    gemm_inputs = 2 * emb + int(cfg.q_lora_rank) + int(cfg.kv_lora_rank) + heads * v
  else:
    qk = v = int(cfg.head_dim)
    gemm_inputs = emb + heads * v
  common = 4 * emb + 6 * emb + 2 * heads * (2 * qk + v)
  k, ffn, shared = int(cfg.num_experts_per_tok), int(cfg.moe_mlp_dim), int(cfg.shared_experts or 0)
  moe = common + 2 * int(cfg.num_experts) + 4 * rows_per_token * emb + 3 * shared * ffn
  dense_q, grouped_q = QUANT_BYTES[fmts.get("dense", "bf16")], QUANT_BYTES[fmts.get("grouped", "bf16")]
  moe_quant = dense_q * (gemm_inputs + shared * (emb + ffn)) + grouped_q * k * emb
  if fused_mlp:
    moe_quant += EPILOGUE_BYTES.get(fmts.get("grouped", "bf16"), act_b) * k * ffn
  else:
    moe += 3 * k * ffn
    moe_quant += grouped_q * k * ffn
  dense_quant = dense_q * (gemm_inputs + emb + int(cfg.mlp_dim))
  return moe * act_b + moe_quant, (common + 3 * int(cfg.mlp_dim)) * act_b + dense_quant
