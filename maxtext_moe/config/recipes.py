"""Where recipes live and how a name on the command line becomes a YAML path.

A recipe is `configs/recipes/<hardware>/<model>.yml`, named so that a benchmark can be reproduced from
its name alone. `configs/recipes/models` links to `configs/models`, the folder MaxText searches for
`models/<model_name>.yml` next to the config's parent, so our model files shadow MaxText's.

A recipe given by its path in another copy of configs/ (a second clone's, run with this package) is this
package's recipe of the same path where every file it is read from there is the same here; else one line
says which configs/ this package reads and how to run that copy (MAXTEXT_MOE_CONFIGS).
"""

import difflib
import os
import re
from pathlib import Path

from maxtext_moe.errors import UserError

DEFAULT_RECIPE = "cpu/deepseek3-tiny"
# The step time a recipe's checkpoint_period was chosen from, as shipped recipes note it on the key's line
# ("about 25 minutes of steps at the step-time model's 6.27 s a step") and `plan --search --write` in its
# header ("checkpoint_period: about 30 minutes of steps at the model's 6.27 s a step").
_RECORDED_STEP_S = re.compile(r"^#? ?checkpoint_period:.*at the (?:step-time )?model's ([\d.]+) s a step", re.M)
_SETS_PERIOD = re.compile(r"^checkpoint_period:", re.M)


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
    return _from_another_copy(as_path.resolve())
  key = name.removesuffix(".yml")
  known = list_recipes()
  if key in known:
    return configs_dir() / "recipes" / f"{key}.yml"
  near = difflib.get_close_matches(key, known, n=1, cutoff=0.5)
  hint = f"did you mean '{near[0]}'?" if near else "run 'maxtext-moe recipes' to list them"
  raise UserError(f"unknown recipe '{name}'; {hint}")


def recorded_step_s(path: Path) -> float | None:
  """The step-time model's seconds a step that a recipe's checkpoint_period was chosen from, as its file or
  the first of its base_config chain that sets the period notes it; None where that file sets its own period
  without a note (a fine-tune's, whose layout may differ). For what a failure costs in minutes where the
  step-time model is not at hand (`k8s`, which does not import it)."""
  for layer in _chain_in_copy(path.resolve(), configs_dir().resolve()) or [path]:
    text = layer.read_text(encoding="utf-8")
    if found := _RECORDED_STEP_S.search(text):
      return float(found.group(1))
    if _SETS_PERIOD.search(text):
      return None
  return None


def _copy_root(path: Path) -> Path | None:
  """The copy of configs/ that `path` lies in: the nearest folder above it with base.yml, recipes/ and
  models/, or None."""
  for folder in path.parents:
    if (folder / "base.yml").is_file() and (folder / "recipes").is_dir() and (folder / "models").is_dir():
      return folder
  return None


def _chain_in_copy(path: Path, root: Path) -> list[Path]:
  """The files of the copy `root` a recipe there is layered from: its base_config chain while that stays
  in `root` (`${moe_configs:...}` names this package's configs)."""
  import yaml  # pylint: disable=import-outside-toplevel

  chain: list[Path] = []
  while path.is_relative_to(root) and path.is_file() and path not in chain:
    chain.append(path)
    try:
      base = (yaml.safe_load(path.read_text(encoding="utf-8")) or {}).get("base_config")
    except (yaml.YAMLError, AttributeError):
      break  # not a mapping, or no YAML: the checks of the chain say so
    if not isinstance(base, str) or not base or "${" in base:
      break
    path = (path.parent / base).resolve()
  return chain


def _from_another_copy(path: Path) -> Path:
  """`path`, or where it lies in another copy of configs/ and is layered on that copy's base.yml, the same
  file of this package's configs: the recipe, its chain and the model files (MaxText looks a model up
  next to the recipe) all the same here. Else one line: which configs/ this is and how to run that copy."""
  ours, root = configs_dir().resolve(), _copy_root(path)
  if root is None or root == ours:
    return path
  chain = _chain_in_copy(path, root)
  if root / "base.yml" not in chain:
    return path  # layered on this package's configs (${moe_configs:...}) or on none: the checks judge it
  for file in [*chain, *sorted((root / "models").glob("*.yml"))]:
    here = ours / file.relative_to(root)
    if here.is_file() and here.read_bytes() == file.read_bytes():
      continue
    name = path.relative_to(root / "recipes").with_suffix("") if path.is_relative_to(root / "recipes") else None
    other = f", or give it as {name} to use this one's" if str(name) in list_recipes() else ""
    raise UserError(
      f"{path} is in another copy of configs/ ({root}); this maxtext-moe reads {ours}, where "
      f"{file.relative_to(root)} {'differs' if here.is_file() else 'is missing'}: set "
      f"MAXTEXT_MOE_CONFIGS={root} to use that copy{other}"
    )
  return ours / path.relative_to(root)


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
