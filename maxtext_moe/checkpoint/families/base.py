"""What a Hugging Face model family is to the converter: how its config.json maps to MaxText keys, how its
tensors map to MaxText's parameter tree, and how a resolved MaxText config is written back as config.json.

A family module (deepseek3.py, qwen3_moe.py, mixtral.py) builds one `Family`; `families/__init__.py` picks
one by config.json's `architectures` (import) or by the model's `decoder_block` (export).
"""

import copy
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from maxtext_moe.errors import UserError

# (MaxText path inside a layer or at the top, HF name, transpose, leading in-dims). `in_dims`: how many
# leading dims of the MaxText slice form HF's input features (o_proj: heads x head_dim).
Table = dict[tuple[str, ...], tuple[str, bool, int]]


@dataclass(frozen=True)
class Field:
  """One MaxText key of a model, with the config.json field (dotted for rope parameters) it came from."""

  ours: str
  value: Any
  hf: str
  hf_value: Any


@dataclass(frozen=True)
class Family:
  """One Hugging Face architecture, both ways.

  - `fields(raw)`: every MaxText model key of a config.json, or one UserError naming every field MaxText
    cannot represent; `to_hf(cfg, source)`: the config.json of a resolved config, starting from `source`.
  - `global_table` / `layer_table`: parameter paths; `stacks(cfg)`: {MaxText stack path: HF index of its
    first layer}; `extra(path, cfg)`: a mapping for paths outside those (DeepSeek's MTP module).
  - `scales`: layer paths whose MaxText kernel is HF's times a factor of the config (Mixtral's query).
  - `float32_suffixes`: HF tensors kept in float32 whatever the output dtype (DeepSeek's correction bias).
  """

  architecture: str
  model_type: str
  config_class: str  # transformers' class that reads the config.json
  model_name: str  # configs/models/<model_name>.yml holds `structure`
  decoder_block: str
  structure: dict[str, Any]
  fields: Callable[[dict], list[Field]]
  to_hf: Callable[..., dict]
  global_table: Table
  layer_table: Table
  stacks: Callable[[Any], dict[tuple[str, ...], int]]
  our_value: Callable[[Any, str], Any] = getattr  # a key's value in a resolved config, for comparisons
  extra: Callable[[tuple[str, ...], Any], tuple[str, bool, int, int] | None] = lambda path, cfg: None
  scales: dict[tuple[str, ...], Callable[[Any], float]] = field(default_factory=dict)
  skipped: re.Pattern | None = None  # HF tensors MaxText does not store (copies of others)
  float32_suffixes: tuple[str, ...] = ()  # HF tensors kept in float32 whatever --dtype says
  ignored_hint: Callable[[int, Any], str] = lambda layer, cfg: ""


def transformers_config(raw: dict, family: Family) -> Any:
  """config.json read by transformers' own class for the family (its defaults, its RoPE standardisation)."""
  import transformers  # pylint: disable=import-outside-toplevel

  try:  # from_dict edits nested dicts (rope_scaling) in place: give it a copy
    return getattr(transformers, family.config_class).from_dict(copy.deepcopy(raw))
  except (TypeError, ValueError, KeyError) as e:
    raise UserError(f"config.json is not a valid {family.architecture} config: {str(e).splitlines()[0]}") from None


def check_required(raw: dict, cfg: Any, required: dict[str, Any], family: Family, problems: list[str]) -> None:
  """Fields MaxText's model of the family has one value for; `raw`'s own keys for what transformers drops."""
  for key, want in required.items():
    got = getattr(cfg, key) if hasattr(cfg, key) else raw.get(key, want)
    if got != want:
      problems.append(f"{key}={got} (MaxText's {family.decoder_block} model has {key}={want})")


def integral(value: Any, name: str, problems: list[str]) -> int:
  """MaxText keeps these numbers (RoPE's theta, factor, betas) as integers."""
  if float(value) != int(float(value)):
    problems.append(f"{name}={value} (MaxText keeps it as an integer)")
  return int(float(value))


def plain_rope(cfg: Any, family: Family, problems: list[str]) -> list[Field]:
  """MaxText's default RoPE (rotate-half, the layout of Llama-style HF checkpoints) from rope_parameters."""
  rope = dict(cfg.rope_parameters or {})
  kind, theta = rope.get("rope_type", "default"), rope.get("rope_theta", 10000.0)
  if kind != "default":
    problems.append(f"rope_parameters.rope_type={kind} (MaxText's {family.decoder_block} model has plain RoPE)")
  if rope.get("partial_rotary_factor", 1.0) != 1.0:
    problems.append(f"rope_parameters.partial_rotary_factor={rope['partial_rotary_factor']}")
  return [Field("rope_max_timescale", integral(theta, "rope_theta", problems), "rope_theta", theta)]


def write_plain_rope(out: dict, cfg: Any, source: dict | None) -> None:
  """rope_theta in the style of the source: transformers' `rope_parameters` or the legacy top-level key."""
  theta = float(cfg.rope_max_timescale)
  if source is not None and "rope_parameters" not in source:
    out["rope_theta"] = theta
    if "rope_scaling" in source:
      out["rope_scaling"] = None
    return
  out.pop("rope_theta", None)
  out["rope_parameters"] = {"rope_type": "default", "rope_theta": theta}


def same(a: Any, b: Any) -> bool:
  if isinstance(a, float | int) and isinstance(b, float | int) and not isinstance(a, bool):
    return math.isclose(float(a), float(b), rel_tol=1e-9)
  return getattr(a, "value", a) == getattr(b, "value", b)


def value_of(x: Any) -> Any:
  """An enum's value, a tuple as a list: what YAML and config.json hold."""
  x = getattr(x, "value", x)
  return list(x) if isinstance(x, tuple) else x
