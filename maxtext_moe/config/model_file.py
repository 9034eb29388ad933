"""Model YAML files: a model's MaxText keys, written by `convert hf-to-maxtext` from a config.json and
used by any recipe through the `model_file` key.

    maxtext-moe train h200x8/deepseek3-proxy-16b-finetune model_file=/ckpt/moonlight/model.yml ...

The file's keys become key=value overrides placed after the recipe's layers and before the user's own
(which still win): the model replaces the recipe's, the layout stays the recipe's. Only model keys are
allowed in it, so a model file cannot change a layout or a learning rate.
"""

from pathlib import Path
from typing import Any

import yaml

from maxtext_moe.errors import UserError

# Every MaxText key a model YAML may set (checkpoint/families/ write a subset of these).
MODEL_KEYS = (
  "model_name",
  "base_emb_dim",
  "base_mlp_dim",
  "base_moe_mlp_dim",
  "base_num_decoder_layers",
  "first_num_dense_layers",
  "base_num_query_heads",
  "base_num_kv_heads",
  "vocab_size",
  "normalization_layer_epsilon",
  "num_experts",
  "num_experts_per_tok",
  "shared_experts",
  "routed_scaling_factor",
  "n_routing_groups",
  "topk_routing_group",
  "q_lora_rank",
  "kv_lora_rank",
  "qk_nope_head_dim",
  "qk_rope_head_dim",
  "v_head_dim",
  "rope_interleave",
  "max_position_embeddings",
  "mtp_num_layers",
  "rope_type",
  "rope_max_timescale",
  "rope_factor",
  "original_max_position_embeddings",
  "beta_fast",
  "beta_slow",
  "mscale",
  "rope_truncate",
  "rope_attention_scaling",
  "mla_norm_epsilon",
  "head_dim",
)


def load_yaml(path: Path) -> Any:
  """A YAML file, or one line naming the file, line and column of what does not parse."""
  try:
    return yaml.safe_load(Path(path).read_text(encoding="utf-8"))
  except OSError as e:
    raise UserError(f"cannot read {path}: {e.strerror}") from None
  except yaml.YAMLError as e:
    mark = getattr(e, "problem_mark", None)
    where = f" line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    raise UserError(f"{path} is not valid YAML ({getattr(e, 'problem', None) or e}){where and ' at' + where}") from None


def read(path: str | Path) -> dict[str, Any]:
  """The keys of a model YAML, checked to be model keys only."""
  if not isinstance(path, str | Path):  # YAML or key=value read a number or a list (found by fuzzing)
    raise UserError(f"model_file={path!r} must be the path of a model YAML file")
  path = Path(path)
  if not path.is_file():
    raise UserError(f"model_file {path} does not exist (it is written by 'maxtext-moe convert hf-to-maxtext')")
  data = load_yaml(path)
  if not isinstance(data, dict) or not data:
    raise UserError(f"model_file {path} holds no model keys")
  other = sorted(set(data) - set(MODEL_KEYS))
  if other:
    raise UserError(f"model_file {path} sets {', '.join(other)}, which are not model keys; set them in the recipe")
  return data


def as_overrides(keys: dict[str, Any]) -> list[str]:
  """key=value strings in MaxText's grammar (values as one-line YAML, which MaxText's OmegaConf parses)."""
  return [
    f"{k}={yaml.safe_dump(v, default_flow_style=True, width=10**9).strip().removesuffix('...').strip()}"
    for k, v in keys.items()
  ]


def write(path: Path, keys: dict[str, Any], *, header: str) -> None:
  """Writes a model YAML (keys in their given order) with a comment header."""
  body = yaml.safe_dump(keys, sort_keys=False, default_flow_style=False, width=10**9)
  comment = "".join(f"# {line}\n" for line in header.splitlines())
  Path(path).write_text(comment + body, encoding="utf-8")
