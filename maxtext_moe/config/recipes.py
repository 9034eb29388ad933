"""Where recipes live and how a name on the command line becomes a YAML path.

A recipe is `configs/recipes/<hardware>/<model>.yml`, named so that a benchmark can be reproduced from
its name alone. `configs/recipes/models` links to `configs/models`, the folder MaxText searches for
`models/<model_name>.yml` next to the config's parent, so our model files shadow MaxText's.
"""

import difflib
import os
from pathlib import Path

from maxtext_moe.errors import UserError

DEFAULT_RECIPE = "cpu/deepseek3-tiny"


def configs_dir() -> Path:
  """The configs folder: $MAXTEXT_MOE_CONFIGS, else the one beside the package (editable install, image)."""
  env = os.environ.get("MAXTEXT_MOE_CONFIGS")
  path = Path(env) if env else Path(__file__).resolve().parents[2] / "configs"
  if not (path / "base.yml").is_file():
    raise UserError(f"maxtext-moe configs not found at {path}; set MAXTEXT_MOE_CONFIGS to the repo's configs/ folder")
  return path


def list_recipes() -> list[str]:
  """All shipped recipe names, e.g. ['b200x8/deepseek3-proxy-16b', ..., 'cpu/deepseek3-tiny']."""
  root = configs_dir() / "recipes"
  return sorted(str(p.relative_to(root).with_suffix("")) for p in root.glob("*/*.yml") if p.parent.name != "models")


def recipe_path(name: str) -> Path:
  """Resolves a recipe name (`cpu/deepseek3-tiny`, with or without `.yml`) or a path to a `.yml` file.

  Raises:
    UserError: the name matches no recipe; the message suggests the closest one.
  """
  as_path = Path(name)
  if as_path.suffix in (".yml", ".yaml") and as_path.is_file():
    if as_path.suffix != ".yml":
      raise UserError(f"config files must end in .yml (MaxText's rule): rename {name}")
    return as_path.resolve()
  key = name.removesuffix(".yml")
  known = list_recipes()
  if key in known:
    return configs_dir() / "recipes" / f"{key}.yml"
  near = difflib.get_close_matches(key, known, n=1, cutoff=0.5)
  hint = f"did you mean '{near[0]}'?" if near else "run 'maxtext-moe recipes' to list them"
  raise UserError(f"unknown recipe '{name}'; {hint}")


def portable_text(recipe: str) -> str:
  """A recipe file's text, for a job that runs it elsewhere (a Kubernetes ConfigMap), or "" for a shipped
  recipe (the image has it). Its base_config must name a file the image has too: `${moe_configs:...}`
  (ours) or `${maxtext_configs:...}`."""
  import yaml  # pylint: disable=import-outside-toplevel

  if recipe.removesuffix(".yml") in list_recipes():
    return ""
  text = Path(recipe).read_text(encoding="utf-8")
  base = str((yaml.safe_load(text) or {}).get("base_config", ""))
  if not base.startswith(("${moe_configs:", "${maxtext_configs:")):
    raise UserError(
      f"{recipe}: base_config {base or '(none)'} is a file of this machine, not of the image; name a shipped "
      "recipe or base as ${moe_configs:recipes/HW/MODEL.yml} (the pods get this file in a ConfigMap)"
    )
  return text
