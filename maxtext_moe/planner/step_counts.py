"""Per-token counts of the step-time model: the forward FLOPs of MaxText's custom-remat tensors (what a
policy recomputes) and the memory-bound ops' bytes (`step_workload` multiplies them by tokens and layers)."""

from typing import Any

from maxtext_moe.planner.estimate import dtype_bytes
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


def _per_token_forward_flops(cfg: Any) -> dict[str, float]:
  """Forward FLOPs per token of one MoE layer's named tensors (the names of MaxText's custom remat)."""
  emb, heads = int(cfg.emb_dim), int(cfg.num_query_heads)
  k, ffn = int(cfg.num_experts_per_tok), int(cfg.moe_mlp_dim)
  shared = int(cfg.shared_experts or 0)
  seq = int(cfg.max_target_length)
  if str(cfg.attention_type) == "mla":
    nope, rope, v = int(cfg.qk_nope_head_dim), int(cfg.qk_rope_head_dim), int(cfg.v_head_dim)
    q_lora, kv_lora = int(cfg.q_lora_rank), int(cfg.kv_lora_rank)
    out = {
      "query_wa_proj": 2 * emb * q_lora if q_lora else 0,
      "query_proj": 2 * (q_lora or emb) * heads * (nope + rope),
      "kv_wa_proj": 2 * emb * (kv_lora + rope),
      "key_proj": 2 * kv_lora * heads * nope,
      "value_proj": 2 * kv_lora * heads * v,
      "out_proj": 2 * heads * v * emb,
      "context": 2 * seq * heads * (nope + rope + v) / 2,  # causal
    }
  else:
    hd, kv = int(cfg.head_dim), int(cfg.num_kv_heads)
    out = {
      "query_proj": 2 * emb * heads * hd,
      "key_proj": 2 * emb * kv * hd,
      "value_proj": 2 * emb * kv * hd,
      "out_proj": 2 * heads * hd * emb,
      "context": 4 * seq * heads * hd / 2,
    }
  out |= {"moe_mlpwi_0": 2 * emb * ffn * k, "moe_mlpwi_1": 2 * emb * ffn * k, "moe_mlpwo": 2 * ffn * emb * k}
  out |= {"mlpwi_0": 2 * emb * ffn * shared, "mlpwi_1": 2 * emb * ffn * shared, "mlpwo": 2 * ffn * emb * shared}
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
  names = [n for n in _REMAT_NAMES if value_of(getattr(cfg, n, "device")) == "remat"]
  out = {"dense": 0.0, "grouped": 0.0, "attention": 0.0}
  for n in names:
    cls = "grouped" if n.startswith("moe_") else "attention" if n == "context" else "dense"
    out[cls] += per_token.get(n, 0) * tokens * (moe_layers if n.startswith(("moe_", "mlp")) else layers) / 1e12
  return out, "remat_policy custom: recomputes " + (", ".join(names) or "nothing")


QUANT_BYTES = {"fp8": 5, "mxfp8": 4, "bf16": 0}  # per element quantized: amax read + read + write; MX: read + 2 writes


def memory_bytes_per_token(cfg: Any, rows_per_token: float, fmts: dict[str, str]) -> tuple[float, float]:
  """(MoE layer, dense layer) forward bytes per token read and written by memory-bound ops (the module
  docstring), plus the quantization of every FP8/MXFP8 GEMM's input (`QUANT_BYTES` per element)."""
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
  moe = common + 2 * int(cfg.num_experts) + 4 * rows_per_token * emb + 3 * k * ffn + 3 * shared * ffn
  dense_q, grouped_q = QUANT_BYTES[fmts.get("dense", "bf16")], QUANT_BYTES[fmts.get("grouped", "bf16")]
  moe_quant = dense_q * (gemm_inputs + shared * (emb + ffn)) + grouped_q * k * (emb + ffn)
  dense_quant = dense_q * (gemm_inputs + emb + int(cfg.mlp_dim))
  return moe * act_b + moe_quant, (common + 3 * int(cfg.mlp_dim)) * act_b + dense_quant
