"""A DeepseekV3ForCausalLM config.json <-> the MaxText keys of the same model, field by field.

Reading: transformers' own `DeepseekV3Config` interprets config.json (its defaults for absent fields, its
standardisation of the legacy `rope_scaling` + `rope_theta` into `rope_parameters`), then every field that
shapes the computation is mapped to the MaxText key a user sets (`base_emb_dim`, not the derived
`emb_dim`), or named as one MaxText cannot represent. All problems are reported at once.

RoPE. MaxText's YaRN module reproduces transformers' YaRN for DeepSeek's MLA: frequencies from `factor`,
`original_max_position_embeddings`, `beta_fast`/`beta_slow`, `truncate`; cos/sin scaled by transformers'
`attention_factor` when MaxText's `rope_attention_scaling` is on (0.1 ln(factor) + 1) and by 1 when off;
and the softmax scale multiplied by (0.1 mscale ln(factor) + 1)^2 with MaxText's `mscale` = transformers'
`mscale_all_dim`, which MaxText applies when `max_position_embeddings > original_max_position_embeddings`.
Plain RoPE (no scaling) is YaRN with factor 1, which changes no frequency and no scale: MaxText's own
`default` RoPE cannot be used, as it ignores `rope_interleave` (DeepSeek-V3 checkpoints interleave).

Routing. transformers' DeepseekV3 always scores with a sigmoid, selects with the correction bias, limits
to `topk_group` of `n_group` groups, and scales by `routed_scaling_factor`; MaxText's DeepSeek routing does
the same and always renormalises sigmoid weights, so `norm_topk_prob` must be true.
"""

import copy
import math
from dataclasses import dataclass
from typing import Any

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


@dataclass(frozen=True)
class Field:
  """One MaxText key of a model, with the config.json field (dotted for rope parameters) it came from."""

  ours: str
  value: Any
  hf: str
  hf_value: Any


def _hf_config(raw: dict) -> Any:
  from transformers import DeepseekV3Config  # pylint: disable=import-outside-toplevel

  if "DeepseekV3ForCausalLM" not in (raw.get("architectures") or ["DeepseekV3ForCausalLM"]):
    raise UserError(f"config.json is a {raw.get('architectures')} model; the converter reads DeepseekV3ForCausalLM")
  try:
    return DeepseekV3Config.from_dict(copy.deepcopy(raw))  # it edits nested dicts (rope_scaling) in place
  except (TypeError, ValueError, KeyError) as e:
    raise UserError(f"config.json is not a valid DeepseekV3 config: {str(e).splitlines()[0]}") from None


def _integral(value: Any, name: str, problems: list[str]) -> int:
  """MaxText keeps these RoPE numbers as integers."""
  if float(value) != int(float(value)):
    problems.append(f"{name}={value} (MaxText keeps it as an integer)")
  return int(float(value))


def _rope_fields(rope: dict, max_pos: int, problems: list[str]) -> list[Field]:
  """MaxText's RoPE keys for transformers' rope_parameters (see the module docstring)."""
  kind, theta = rope.get("rope_type", "default"), rope.get("rope_theta", 10000.0)
  fields = [Field("rope_type", "yarn", "rope_parameters.rope_type", kind)]
  fields.append(Field("rope_max_timescale", _integral(theta, "rope_theta", problems), "rope_theta", theta))
  if rope.get("partial_rotary_factor", 1.0) != 1.0:
    problems.append(f"rope_parameters.partial_rotary_factor={rope['partial_rotary_factor']}")
  if kind == "default":
    return [
      *fields,
      Field("rope_factor", 1, "rope_parameters.factor", None),
      Field("original_max_position_embeddings", max_pos, "max_position_embeddings", max_pos),
      Field("rope_attention_scaling", False, "rope_parameters.attention_factor", None),
    ]
  if kind != "yarn":
    problems.append(
      f"rope_parameters.rope_type={kind} (MaxText has default, YaRN and llama3.1 RoPE for MLA only as YaRN)"
    )
    return fields
  original = int(rope["original_max_position_embeddings"])
  factor = rope.get("factor") or max_pos / original
  if factor < 1:
    problems.append(f"rope_parameters.factor={factor} (below 1)")
  mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim") or 0.0
  attention = rope.get("attention_factor")
  if attention is None:
    attention = (
      _mscale(factor, mscale) / _mscale(factor, mscale_all_dim) if mscale and mscale_all_dim else _mscale(factor)
    )
  scaling = not math.isclose(attention, 1.0)
  if scaling and not math.isclose(attention, _mscale(factor)):
    problems.append(
      f"rope_parameters attention factor {attention:.6g} (MaxText scales cos/sin by 1 or 0.1 ln(factor) + 1)"
    )
  if mscale_all_dim and factor > 1 and max_pos <= original:
    problems.append(
      f"max_position_embeddings={max_pos} <= original_max_position_embeddings={original} with mscale_all_dim set "
      "(MaxText scales the softmax only when it is larger)"
    )
  beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1
  return [
    *fields,
    Field("rope_factor", _integral(factor, "rope_parameters.factor", problems), "rope_parameters.factor", factor),
    Field("original_max_position_embeddings", original, "rope_parameters.original_max_position_embeddings", original),
    Field(
      "beta_fast", _integral(beta_fast, "rope_parameters.beta_fast", problems), "rope_parameters.beta_fast", beta_fast
    ),
    Field(
      "beta_slow", _integral(beta_slow, "rope_parameters.beta_slow", problems), "rope_parameters.beta_slow", beta_slow
    ),
    Field("mscale", float(mscale_all_dim), "rope_parameters.mscale_all_dim", mscale_all_dim),
    Field("rope_truncate", bool(rope.get("truncate", True)), "rope_parameters.truncate", rope.get("truncate", True)),
    Field("rope_attention_scaling", scaling, "rope_parameters.attention_factor", attention),
  ]


def _mscale(factor: float, mscale: float = 1.0) -> float:
  return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def model_fields(raw: dict) -> list[Field]:
  """The MaxText model keys of a config.json, or one UserError listing every field MaxText cannot represent."""
  cfg = _hf_config(raw)
  problems = []
  for key, want in REQUIRED.items():
    got = raw.get(key, want) if key in ("scoring_func", "topk_method", "moe_layer_freq") else getattr(cfg, key)
    if got != want:
      problems.append(f"{key}={got} (MaxText's DeepSeek model has {key}={want})")
  quant = (raw.get("quantization_config") or {}).get("quant_method")
  if quant not in (None, "fp8"):
    problems.append(f"quantization_config.quant_method={quant} (the converter reads BF16, F32 and FP8 e4m3 blocks)")
  fields = [Field("model_name", FROM_HF, "architectures", raw.get("architectures"))]
  fields += [Field(ours, getattr(cfg, hf), hf, getattr(cfg, hf)) for ours, hf in SIZES]
  q_lora = cfg.q_lora_rank
  fields.append(Field("q_lora_rank", q_lora or 0, "q_lora_rank", q_lora))
  fields += _rope_fields(dict(cfg.rope_parameters or {}), int(cfg.max_position_embeddings), problems)
  fields.append(Field("mla_norm_epsilon", MLA_NORM_EPS, "q_a_layernorm/kv_a_layernorm eps", MLA_NORM_EPS))
  if problems:
    raise UserError(f"config.json has fields MaxText cannot represent: {'; '.join(problems)}")
  return fields


def model_keys(raw: dict) -> dict[str, Any]:
  """{MaxText key: value} of a config.json (see `model_fields`)."""
  return {f.ours: f.value for f in model_fields(raw)}


def _same(a: Any, b: Any) -> bool:
  if isinstance(a, float | int) and isinstance(b, float | int) and not isinstance(a, bool):
    return math.isclose(float(a), float(b), rel_tol=1e-9)
  return getattr(a, "value", a) == getattr(b, "value", b)


def mismatches(raw: dict, cfg: Any) -> list[str]:
  """`hf_field=value vs our_key=value (set our_key=...)` for each key where a resolved config differs."""
  out = []
  for f in model_fields(raw):
    if f.ours in ("model_name", "mtp_num_layers"):  # fewer MTP layers than the checkpoint's: left out, reported
      continue
    ours = getattr(cfg, f.ours)
    if f.ours == "mla_norm_epsilon":  # 0 means the layer norms' epsilon
      ours = ours or cfg.normalization_layer_epsilon
    if not _same(ours, f.value):
      out.append(f"{f.hf}={f.hf_value} vs {f.ours}={getattr(ours, 'value', ours)} (set {f.ours}={f.value})")
  for key, want in STRUCTURE.items():
    ours = getattr(cfg, key)
    if not _same(list(ours) if isinstance(ours, tuple) else ours, want):
      out.append(f"a DeepseekV3 checkpoint needs {key}={want}, not {getattr(ours, 'value', ours)}")
  return out


def _rope_for_hf(cfg: Any) -> dict[str, Any]:
  """transformers' rope_parameters for MaxText's RoPE keys (the inverse of `_rope_fields`)."""
  theta = float(cfg.rope_max_timescale)
  if str(getattr(cfg.rope_type, "value", cfg.rope_type)) != "yarn":
    return {"rope_type": "default", "rope_theta": theta}  # MaxText's non-YaRN RoPE is the concatenated layout
  if int(cfg.rope_factor) == 1:
    return {"rope_type": "default", "rope_theta": theta}
  factor = float(cfg.rope_factor)
  rope = {
    "rope_type": "yarn",
    "rope_theta": theta,
    "factor": factor,
    "original_max_position_embeddings": int(cfg.original_max_position_embeddings),
    "beta_fast": float(cfg.beta_fast),
    "beta_slow": float(cfg.beta_slow),
    "mscale": float(cfg.mscale),
    "mscale_all_dim": float(cfg.mscale),
  }
  if not cfg.rope_truncate:
    rope["truncate"] = False
  if cfg.rope_attention_scaling:
    rope["attention_factor"] = _mscale(factor)
  return rope


def _write_rope(out: dict, cfg: Any, source: dict | None) -> None:
  """RoPE in the style of the source: transformers' `rope_parameters`, or the legacy `rope_theta` +
  `rope_scaling` (with its `type` key) that DeepSeek's own config.json uses."""
  rope = _rope_for_hf(cfg)
  legacy = (
    source is not None and "rope_parameters" not in source and ("rope_theta" in source or "rope_scaling" in source)
  )
  if not legacy:
    out["rope_parameters"] = rope
    return
  out["rope_theta"] = rope.pop("rope_theta")
  kind = rope.pop("rope_type")
  if kind != "default":
    type_key = "type" if "type" in (source.get("rope_scaling") or {}) else "rope_type"
    out["rope_scaling"] = {type_key: kind, **rope}
  elif "rope_scaling" in out:
    out["rope_scaling"] = None


def hf_config_for(cfg: Any, *, dtype: str = "bfloat16", source: dict | None = None) -> dict:
  """The config.json of the model a resolved MaxText config describes. Starting from `source` (the
  config.json a checkpoint was converted from) keeps what MaxText does not model (token ids,
  auto_map, ...); every field that shapes the computation is written from `cfg`, RoPE in the style the
  source used."""
  out = dict(source or {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"})
  is_yarn = str(getattr(cfg.rope_type, "value", cfg.rope_type)) == "yarn"
  out |= {hf: getattr(cfg, ours) for ours, hf in SIZES if not ours.startswith("base_")}
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
  _write_rope(out, cfg, source)
  out["torch_dtype" if "torch_dtype" in out else "dtype"] = dtype
  return out
