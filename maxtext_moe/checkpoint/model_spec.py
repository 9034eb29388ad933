"""Which model a conversion builds, from `--model` (a recipe or a model YAML) or from the checkpoint itself.

A conversion needs the model only, never a layout, so a model YAML (written by hf-to-maxtext from a
config.json) is resolved on top of the plugin's own base.yml, and a recipe's layout is replaced by one
device (`upstream.maxtext.model.ONE_DEVICE_OVERRIDES`). Next to its Orbax items, hf-to-maxtext writes:

  OUT/model.yml       the model's MaxText keys (train/plan/convert take it as model_file=OUT/model.yml)
  OUT/hf_config.json  the source config.json, verbatim: the export starts from it, so what MaxText does
                      not model (token ids, auto_map, ...) survives a round trip
"""

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from maxtext_moe.config import model_file, recipes
from maxtext_moe.errors import UserError

MODEL_YAML = "model.yml"
SOURCE_CONFIG = "hf_config.json"


@dataclass(frozen=True)
class ModelSpec:
  """A recipe (its layout ignored) plus overrides that describe one model; `label` names it in messages."""

  recipe: Path
  overrides: list[str]
  label: str
  model_yaml: Path | None = None
  source_config: dict[str, Any] | None = field(default=None, compare=False)

  @property
  def pinned(self) -> str:
    """What a model-key override needs on this model: a recipe's model YAML (MaxText's `model_name` file)
    refuses one without override_model_config=true; a model.yml's and config.json's keys are overrides."""
    return " override_model_config=true" if self.recipe != _base() else ""


def _base() -> Path:
  return recipes.configs_dir() / "base.yml"


def _is_model_yaml(path: Path) -> bool:
  data = model_file.load_yaml(path)
  return isinstance(data, dict) and "base_config" not in data


def from_model_yaml(path: Path, overrides: list[str]) -> ModelSpec:
  path = path.absolute()
  source = path.parent / SOURCE_CONFIG
  config = json.loads(source.read_text()) if source.is_file() else None
  return ModelSpec(_base(), [f"model_file={path}", *overrides], str(path), path, config)


def from_argument(model: str, overrides: list[str]) -> ModelSpec:
  """`--model`: a recipe name, a recipe .yml, or a model YAML written by a conversion."""
  path = Path(model)
  if path.suffix in (".yml", ".yaml") and path.is_file() and _is_model_yaml(path):
    return from_model_yaml(path, overrides)
  return ModelSpec(recipes.recipe_path(model), list(overrides), model)


def from_hf_config(keys: dict[str, Any], overrides: list[str], hf_dir: str) -> ModelSpec:
  """The model a config.json describes (`checkpoint.families.model_keys`), the user's overrides last."""
  return ModelSpec(_base(), [*model_file.as_overrides(keys), *overrides], f"the config.json of {hf_dir}")


def for_export(model: str | None, items: Path, overrides: list[str]) -> ModelSpec:
  """`--model` if given, else the model.yml a conversion wrote next to the checkpoint (OUT/items -> OUT)."""
  if model is not None:
    return from_argument(model, overrides)
  for directory in (items, *items.parents[:3]):
    if (directory / MODEL_YAML).is_file():
      return from_model_yaml(directory / MODEL_YAML, overrides)
  raise UserError(
    f"no {MODEL_YAML} next to {items}: pass --model, a recipe or the {MODEL_YAML} that "
    "'maxtext-moe convert hf-to-maxtext' wrote for the checkpoint this one was trained from"
  )
