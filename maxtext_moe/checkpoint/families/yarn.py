"""DeepSeek-V3's RoPE in MaxText's keys, both ways.

RoPE. MaxText's YaRN module reproduces transformers' YaRN for DeepSeek's MLA: frequencies from `factor`,
`original_max_position_embeddings`, `beta_fast`/`beta_slow`, `truncate`; cos/sin scaled by transformers'
`attention_factor` when MaxText's `rope_attention_scaling` is on (0.1 ln(factor) + 1) and by 1 when off;
and the softmax scale multiplied by (0.1 mscale ln(factor) + 1)^2 with MaxText's `mscale` = transformers'
`mscale_all_dim`, which MaxText applies when `max_position_embeddings > original_max_position_embeddings`.
Plain RoPE (no scaling) is YaRN with factor 1, which changes no frequency and no scale: MaxText's own
`default` RoPE cannot be used, as it ignores `rope_interleave` (DeepSeek-V3 checkpoints interleave).
"""

import math
from typing import Any

from maxtext_moe.checkpoint.families.base import Field, integral


def rope_fields(rope: dict, max_pos: int, problems: list[str]) -> list[Field]:
  """MaxText's RoPE keys for transformers' rope_parameters (see the module docstring)."""
  kind, theta = rope.get("rope_type", "default"), rope.get("rope_theta", 10000.0)
  fields = [Field("rope_type", "yarn", "rope_parameters.rope_type", kind)]
  fields.append(Field("rope_max_timescale", integral(theta, "rope_theta", problems), "rope_theta", theta))
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
    Field("rope_factor", integral(factor, "rope_parameters.factor", problems), "rope_parameters.factor", factor),
    Field("original_max_position_embeddings", original, "rope_parameters.original_max_position_embeddings", original),
    Field(
      "beta_fast", integral(beta_fast, "rope_parameters.beta_fast", problems), "rope_parameters.beta_fast", beta_fast
    ),
    Field(
      "beta_slow", integral(beta_slow, "rope_parameters.beta_slow", problems), "rope_parameters.beta_slow", beta_slow
    ),
    Field("mscale", float(mscale_all_dim), "rope_parameters.mscale_all_dim", mscale_all_dim),
    Field("rope_truncate", bool(rope.get("truncate", True)), "rope_parameters.truncate", rope.get("truncate", True)),
    Field("rope_attention_scaling", scaling, "rope_parameters.attention_factor", attention),
  ]


def _mscale(factor: float, mscale: float = 1.0) -> float:
  return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_for_hf(cfg: Any) -> dict[str, Any]:
  """transformers' rope_parameters for MaxText's RoPE keys (the inverse of `rope_fields`)."""
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


def write_rope(out: dict, cfg: Any, source: dict | None) -> None:
  """RoPE in the style of the source: transformers' `rope_parameters`, or the legacy `rope_theta` +
  `rope_scaling` (with its `type` key) that DeepSeek's own config.json uses."""
  rope = rope_for_hf(cfg)
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
