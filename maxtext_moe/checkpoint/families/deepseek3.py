"""DeepseekV3ForCausalLM (DeepSeek-V3/R1/V3.1, Moonlight, Kimi-K2, ...) <-> MaxText's deepseek decoder.

Config: transformers' own `DeepseekV3Config` interprets config.json (its defaults for absent fields, its
standardisation of the legacy `rope_scaling` + `rope_theta` into `rope_parameters`), then every field that
shapes the computation is mapped to the MaxText key a user sets (`base_emb_dim`, not the derived
`emb_dim`), or named as one MaxText cannot represent. All problems are reported at once.

RoPE: `yarn.py`.

Routing. transformers' DeepseekV3 always scores with a sigmoid, selects with the correction bias, limits
to `topk_group` of `n_group` groups, and scales by `routed_scaling_factor`; MaxText's DeepSeek routing does
the same and always renormalises sigmoid weights, so `norm_topk_prob` must be true.
"""

import re
from typing import Any

from maxtext_moe.checkpoint.families import yarn
from maxtext_moe.checkpoint.families.base import (
  Family,
  Field,
  check_required,
  transformers_config,
  value_of,
)
from maxtext_moe.errors import UserError

# The model_name of every model read from a config.json: it starts with "deepseek3" (MaxText keys DeepSeek
# routing on that prefix) and its file configs/models/deepseek3-from-hf.yml holds the keys every
# DeepseekV3ForCausalLM shares (`STRUCTURE`); the checkpoint-specific keys come from the model YAML.
FROM_HF = "deepseek3-from-hf"
STRUCTURE = {
  "decoder_block": "deepseek",
  "attention_type": "mla",
  "mlp_activations": ["silu", "linear"],
  "routed_score_func": "sigmoid",
  "routed_bias": True,
  "logits_via_embedding": False,
}
# transformers' DeepseekV3 builds q_a_layernorm and kv_a_layernorm with this eps, whatever rms_norm_eps is.
MLA_NORM_EPS = 1e-6
# (MaxText key, config.json field it comes from), in the order a model YAML lists them.
SIZES = (
  ("base_emb_dim", "hidden_size"),
  ("base_mlp_dim", "intermediate_size"),
  ("base_moe_mlp_dim", "moe_intermediate_size"),
  ("base_num_decoder_layers", "num_hidden_layers"),
  ("first_num_dense_layers", "first_k_dense_replace"),
  ("base_num_query_heads", "num_attention_heads"),
  ("base_num_kv_heads", "num_attention_heads"),  # MLA has one key/value head per query head
  ("vocab_size", "vocab_size"),
  ("normalization_layer_epsilon", "rms_norm_eps"),
  ("num_experts", "n_routed_experts"),
  ("num_experts_per_tok", "num_experts_per_tok"),
  ("shared_experts", "n_shared_experts"),
  ("routed_scaling_factor", "routed_scaling_factor"),
  ("n_routing_groups", "n_group"),
  ("topk_routing_group", "topk_group"),
  ("kv_lora_rank", "kv_lora_rank"),
  ("qk_nope_head_dim", "qk_nope_head_dim"),
  ("qk_rope_head_dim", "qk_rope_head_dim"),
  ("v_head_dim", "v_head_dim"),
  ("rope_interleave", "rope_interleave"),
  ("max_position_embeddings", "max_position_embeddings"),
  ("mtp_num_layers", "num_nextn_predict_layers"),
)
# config.json fields that must have one value, because MaxText's DeepSeek model has no other.
REQUIRED = {
  "hidden_act": "silu",
  "attention_bias": False,
  "tie_word_embeddings": False,
  "norm_topk_prob": True,
  "scoring_func": "sigmoid",
  "topk_method": "noaux_tc",
  "moe_layer_freq": 1,
}


def _fields(raw: dict) -> list[Field]:
  """The MaxText model keys of a config.json, or one UserError listing every field MaxText cannot represent."""
  cfg = transformers_config(raw, FAMILY)
  problems = []
  check_required(raw, cfg, REQUIRED, FAMILY, problems)
  quant = (raw.get("quantization_config") or {}).get("quant_method")
  if quant not in (None, "fp8"):
    problems.append(f"quantization_config.quant_method={quant} (the converter reads BF16, F32 and FP8 e4m3 blocks)")
  fields = [Field("model_name", FROM_HF, "architectures", raw.get("architectures"))]
  fields += [Field(ours, getattr(cfg, hf), hf, getattr(cfg, hf)) for ours, hf in SIZES]
  q_lora = cfg.q_lora_rank
  fields.append(Field("q_lora_rank", q_lora or 0, "q_lora_rank", q_lora))
  fields += yarn.rope_fields(dict(cfg.rope_parameters or {}), int(cfg.max_position_embeddings), problems)
  fields.append(Field("mla_norm_epsilon", MLA_NORM_EPS, "q_a_layernorm/kv_a_layernorm eps", MLA_NORM_EPS))
  if problems:
    raise UserError(f"config.json has fields MaxText cannot represent: {'; '.join(problems)}")
  return fields


def _our_value(cfg: Any, key: str) -> Any:
  if key == "mla_norm_epsilon":  # 0 means the layer norms' epsilon
    return cfg.mla_norm_epsilon or cfg.normalization_layer_epsilon
  return getattr(cfg, key)


def _to_hf(cfg: Any, out: dict, source: dict | None) -> dict:
  """config.json's architecture fields from a resolved config, onto `out` (the source's copy)."""
  is_yarn = str(getattr(cfg.rope_type, "value", cfg.rope_type)) == "yarn"
  out |= {hf: value_of(getattr(cfg, ours)) for ours, hf in SIZES if not ours.startswith("base_")}
  out |= {
    "hidden_size": int(cfg.emb_dim),
    "intermediate_size": int(cfg.mlp_dim),
    "moe_intermediate_size": int(cfg.moe_mlp_dim),
    "num_hidden_layers": int(cfg.num_decoder_layers),
    "num_attention_heads": int(cfg.num_query_heads),
    "num_key_value_heads": int(cfg.num_query_heads),
    "n_group": max(int(cfg.n_routing_groups), 1),  # MaxText's -1 (no groups) is one group of all experts
    "topk_group": max(int(cfg.topk_routing_group), 1),
    "q_lora_rank": int(cfg.q_lora_rank) or None,
    "rope_interleave": bool(cfg.rope_interleave) and is_yarn,  # MaxText's other RoPE is the concatenated layout
    **REQUIRED,
  }
  yarn.write_rope(out, cfg, source)
  return out


# (MaxText path inside a layer, HF name inside `model.layers.{i}.`, transpose, leading in-dims)
# `in_dims`: how many leading dims of the MaxText slice form HF's input features (o_proj: heads x v).
LAYER = {
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
GLOBAL = {
  ("token_embedder", "embedding"): ("model.embed_tokens.weight", False, 0),
  ("decoder", "decoder_norm", "scale"): ("model.norm.weight", False, 0),
  ("decoder", "logits_dense", "kernel"): ("lm_head.weight", True, 1),
}
MTP = {
  ("mtp_1_embedding_norm", "scale"): ("enorm.weight", False, 0),
  ("mtp_1_hidden_state_norm", "scale"): ("hnorm.weight", False, 0),
  ("mtp_1_projection", "kernel"): ("eh_proj.weight", True, 1),
  ("mtp_1_final_norm", "scale"): ("shared_head.norm.weight", False, 0),
}
# HF tensors that MaxText does not store (copies of the main model's).
HF_SKIPPED = re.compile(r"model\.layers\.\d+\.(embed_tokens|shared_head\.head)\.weight$")


def _stacks(cfg: Any) -> dict[tuple[str, ...], int]:
  return {("decoder", "dense_layers"): 0, ("decoder", "moe_layers"): int(cfg.first_num_dense_layers)}


def _mtp(path: tuple[str, ...], cfg: Any) -> tuple[str, bool, int, int] | None:
  """The MTP module's leaves (mtp_block/mtp_layer_k/...): HF layer num_hidden_layers + k - 1."""
  if path[0] != "mtp_block" or not (m := re.fullmatch(r"mtp_layer_(\d+)", path[1])):
    return None
  layer, rest = int(cfg.num_decoder_layers) + int(m.group(1)) - 1, path[2:]
  if rest in MTP:
    return (*MTP[rest], layer)
  if rest[0] == "mtp_1_transformer_layer" and rest[1:] in LAYER:
    return (*LAYER[rest[1:]], layer)
  return None


def _ignored_hint(layer: int, cfg: Any) -> str:
  if layer >= cfg.num_decoder_layers:
    return f"; an MTP module: pass mtp_num_layers={layer - cfg.num_decoder_layers + 1} to keep it"
  return ""


def mtp_layers_present(tensor_names: set[str], num_hidden_layers: int) -> int:
  """How many MTP modules (HF layers num_hidden_layers, +1, ...) the checkpoint really holds."""
  n = 0
  while any(name.startswith(f"model.layers.{num_hidden_layers + n}.") for name in tensor_names):
    n += 1
  return n


FAMILY = Family(
  architecture="DeepseekV3ForCausalLM",
  model_type="deepseek_v3",
  config_class="DeepseekV3Config",
  model_name=FROM_HF,
  decoder_block="deepseek",
  structure=STRUCTURE,
  fields=_fields,
  to_hf=_to_hf,
  our_value=_our_value,
  global_table=GLOBAL,
  layer_table=LAYER,
  stacks=_stacks,
  extra=_mtp,
  skipped=HF_SKIPPED,
  float32_suffixes=("e_score_correction_bias",),
  ignored_hint=_ignored_hint,
)
