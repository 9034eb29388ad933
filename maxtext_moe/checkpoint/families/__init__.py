"""The Hugging Face model families `convert` reads and writes, picked by config.json's `architectures`
(hf-to-maxtext) or by the model's `decoder_block` (maxtext-to-hf). Adding one: docs/contributing.md.

Reading: transformers' own config class interprets config.json (its defaults for absent fields, its RoPE
standardisation), then every field that shapes the computation is mapped to the MaxText key a user sets
(`base_emb_dim`, not the derived `emb_dim`), or named as one MaxText cannot represent, all at once.
"""

from typing import Any

from maxtext_moe.checkpoint.families import deepseek3, mixtral, qwen3_moe
from maxtext_moe.checkpoint.families.base import Family, Field, same, value_of
from maxtext_moe.errors import UserError

FAMILIES: dict[str, Family] = {f.architecture: f for f in (deepseek3.FAMILY, qwen3_moe.FAMILY, mixtral.FAMILY)}


def supported() -> str:
  return ", ".join(FAMILIES)


def for_config_json(raw: dict) -> Family:
  """The family of a config.json, by `architectures` (or `model_type` where that is absent)."""
  names = raw.get("architectures") or []
  if not isinstance(names, list):
    names = [names]
  found = [FAMILIES[n] for n in names if n in FAMILIES]
  found += [f for f in FAMILIES.values() if not names and raw.get("model_type") == f.model_type]
  if not found:
    what = names or raw.get("model_type") or "no architectures"
    raise UserError(f"config.json is a {what} model; the converter reads {supported()}")
  return found[0]


def for_model(cfg: Any) -> Family:
  """The family of a resolved MaxText config, by its decoder block."""
  block = str(value_of(cfg.decoder_block))
  for family in FAMILIES.values():
    if family.decoder_block == block:
      return family
  raise UserError(f"a model with decoder_block={block} has no Hugging Face mapping; the converter writes {supported()}")


def model_fields(raw: dict) -> list[Field]:
  """The MaxText model keys of a config.json, or one UserError listing every field MaxText cannot represent."""
  return for_config_json(raw).fields(raw)


def model_keys(raw: dict) -> dict[str, Any]:
  """{MaxText key: value} of a config.json (see `model_fields`)."""
  return {f.ours: f.value for f in model_fields(raw)}


def mismatches(raw: dict, cfg: Any) -> list[str]:
  """`hf_field=value vs our_key=value (set our_key=...)` for each key where a resolved config differs from
  a config.json; fewer MTP layers than the checkpoint's are not a difference (left out, reported)."""
  family = for_config_json(raw)
  out = []
  for f in family.fields(raw):
    if f.ours in ("model_name", "mtp_num_layers"):
      continue
    ours = family.our_value(cfg, f.ours)
    if not same(ours, f.value):
      out.append(f"{f.hf}={f.hf_value} vs {f.ours}={value_of(ours)} (set {f.ours}={f.value})")
  for key, want in family.structure.items():
    ours = value_of(getattr(cfg, key))
    if not same(ours, want):
      out.append(f"a {family.architecture} checkpoint needs {key}={want}, not {ours}")
  return out


def hf_config_for(cfg: Any, *, dtype: str = "bfloat16", source: dict | None = None) -> dict:
  """The config.json of the model a resolved MaxText config describes. Starting from `source` (the
  config.json a checkpoint was converted from) keeps what MaxText does not model (token ids, auto_map,
  ...); every field that shapes the computation is written from `cfg`, RoPE in the style the source used.
  What the tensors are is written as they are: `dtype` (transformers 5's name) and `torch_dtype` (4's) say
  `dtype`, and no `quantization_config` (an FP8 source's would make transformers load BF16 tensors as FP8)."""
  family = for_model(cfg)
  out = dict(source or {"architectures": [family.architecture], "model_type": family.model_type})
  family.to_hf(cfg, out, source)
  out.pop("quantization_config", None)
  out["dtype"] = out["torch_dtype"] = dtype
  return out
