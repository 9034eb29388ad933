"""Qwen3MoeForCausalLM (Qwen3-30B-A3B, Qwen3-235B-A22B, ...) <-> MaxText's qwen3_moe decoder.

Computation, as transformers 5.24 and MaxText 0.2.5 have it: GQA with a per-head RMSNorm on queries and keys
before RoPE (`q_norm`/`k_norm` <-> `query_norm`/`key_norm`), softmax scale 1/sqrt(head_dim) applied in the
model (MaxText's `query_pre_attn_scalar`), every layer MoE with softmax routing over all experts, top-k,
and the top-k weights renormalised (`norm_topk_prob`; MaxText's softmax over the top-k logits is the same
thing, so a checkpoint with norm_topk_prob false cannot be represented), no shared expert.

Not in MaxText's model: dense layers among the MoE ones (`mlp_only_layers`, `decoder_sparse_step` > 1), so
`intermediate_size` (their width) shapes nothing here: the export keeps the source's value. Sliding-window
attention and RoPE scaling are refused.
"""

from typing import Any

from maxtext_moe.checkpoint.families import gqa
from maxtext_moe.checkpoint.families.base import Family, Field, write_plain_rope

FROM_HF = "qwen3-moe-from-hf"
STRUCTURE = {
  "decoder_block": "qwen3_moe",
  "use_qk_norm": True,
  "norm_topk_prob": True,
  "mlp_activations": ["silu", "linear"],
  "logits_via_embedding": False,
}
REQUIRED = {
  "hidden_act": "silu",
  "attention_bias": False,
  "tie_word_embeddings": False,
  "norm_topk_prob": True,
  "decoder_sparse_step": 1,
  "mlp_only_layers": [],
  "use_sliding_window": False,
}
EXTRA = [("num_experts", "num_experts"), ("base_moe_mlp_dim", "moe_intermediate_size")]
LAYER = {
  **gqa.ATTENTION,
  ("self_attention", "query_norm", "scale"): ("self_attn.q_norm.weight", False, 0),
  ("self_attention", "key_norm", "scale"): ("self_attn.k_norm.weight", False, 0),
  ("moe_block", "gate", "kernel"): ("mlp.gate.weight", True, 1),
  ("moe_block", "wi_0"): ("mlp.experts.{e}.gate_proj.weight", True, 1),
  ("moe_block", "wi_1"): ("mlp.experts.{e}.up_proj.weight", True, 1),
  ("moe_block", "wo"): ("mlp.experts.{e}.down_proj.weight", True, 1),
}


def _fields(raw: dict) -> list[Field]:
  out = gqa.fields(raw, FAMILY, required=REQUIRED, extra=EXTRA)
  moe_dim = next(f for f in out if f.ours == "base_moe_mlp_dim")
  # MaxText's fully-MoE model wants base_mlp_dim = base_moe_mlp_dim; config.json's intermediate_size is
  # the width of dense layers this model does not have.
  return [*out, Field("base_mlp_dim", moe_dim.value, "moe_intermediate_size", moe_dim.hf_value)]


def _to_hf(cfg: Any, out: dict, source: dict | None) -> dict:
  gqa.to_hf(cfg, out, (*gqa.SIZES, *EXTRA))
  out["moe_intermediate_size"] = int(cfg.moe_mlp_dim)
  out.setdefault("intermediate_size", int(cfg.moe_mlp_dim))  # unused by an all-MoE model; the source's kept
  out |= REQUIRED | {"sliding_window": None}
  write_plain_rope(out, cfg, source)
  return out


FAMILY = Family(
  architecture="Qwen3MoeForCausalLM",
  model_type="qwen3_moe",
  config_class="Qwen3MoeConfig",
  model_name=FROM_HF,
  decoder_block="qwen3_moe",
  structure=STRUCTURE,
  fields=_fields,
  to_hf=_to_hf,
  global_table=gqa.GLOBAL,
  layer_table=LAYER,
  stacks=gqa.one_stack,
)
