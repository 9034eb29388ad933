"""A recipe's keys that its model YAML also sets: MaxText would take the model's, silently.

MaxText 0.2.5 (`pyconfig._initialize_pydantic`) merges the config file (our recipe and its base_config
chain), then `models/<model_name>.yml` over it, then the command line. So a recipe that sets, say,
`n_routing_groups: -1` for a model whose YAML says 8 trains with 8 and says nothing. Here the recipe's
value wins: such keys are passed as overrides ahead of the user's, with `override_model_config=true`,
and because that also switches off MaxText's refusal of a command-line key the model YAML sets, the same
refusal is made here for the user's own overrides.
"""

from pathlib import Path

import omegaconf

from maxtext_moe.config import model_file
from maxtext_moe.config.layers import plain
from maxtext_moe.config.recipes import configs_dir
from maxtext_moe.errors import UserError


def maxtext_finds(config_path: str | Path, model_name: str, maxtext_configs: Path) -> Path | None:
  """Where MaxText finds the model YAML: next to the config, one directory up, then in its package's
  configs directory (`maxtext_configs`)."""
  if model_name in ("", "default"):
    return None
  model_name = model_name.replace("-Instruct", "")
  config_dir = Path(config_path).parent
  for directory in (config_dir, config_dir.parent, maxtext_configs):
    candidate = directory / "models" / f"{model_name}.yml"
    if candidate.is_file():
      return candidate
  return None


def path(config_path: str | Path, model_name: str, maxtext_configs: Path) -> Path | None:
  """The model YAML a config means: what MaxText finds next to it, else ours (configs/models) before
  MaxText's package's own. A recipe file outside configs/ (one `plan --search --write` wrote, or a user's
  with `base_config: ${moe_configs:...}`) so trains our deepseek3-proxy-16b, which MaxText has no file for,
  and our qwen3-30b-a3b, not MaxText's file of that name."""
  found = maxtext_finds(config_path, model_name, maxtext_configs)
  ours = configs_dir() / "models" / f"{model_name.replace('-Instruct', '')}.yml"
  if model_name not in ("", "default") and ours.is_file():
    if found is None or found.resolve().is_relative_to(maxtext_configs.resolve()):
      return ours
  return found


def _recipe_wins(model: omegaconf.DictConfig, layers: omegaconf.DictConfig) -> list[str]:
  """key=value for each key the recipe's layers set to another value than the model YAML does."""
  differ = {k: plain(layers[k]) for k in model if k in layers and plain(layers[k]) != plain(model[k])}
  return model_file.as_overrides(differ) if differ else []


def _refuse_user_overrides(model: omegaconf.DictConfig, overrides: list[str]) -> None:
  """MaxText's refusal of a command-line key that the model YAML sets to another value (unless
  override_model_config=true), made here because `recipe_over_model` turns MaxText's off."""
  cli = omegaconf.OmegaConf.from_cli(list(overrides))
  if cli.get("override_model_config"):
    return
  twice = [k for k in cli if k in model and plain(cli[k]) != plain(model[k])]
  if twice:
    raise UserError(
      f"Keys {twice} are overridden by both model config and CLI/kwargs with different values. This is not "
      "allowed, unless setting `override_model_config=True`."
    )


def recipe_over_model(
  config_path: str | Path, chain: list[Path], model_name: str, overrides: list[str], maxtext_configs: Path
) -> list[str]:
  """The model YAML's keys where MaxText would not read it (`path`: ours), then the recipe's own keys (the
  files of `chain`, its checked `base_config` chain, not MaxText's base.yml or ours) that the model YAML
  sets otherwise, as key=value: the recipe's value wins; the user's overrides then get MaxText's refusal
  from here."""
  found = path(config_path, model_name, maxtext_configs)
  if found is None:
    return []
  defaults = (maxtext_configs.resolve(), (configs_dir() / "base.yml").resolve())
  own = [c for c in chain if c != defaults[1] and not c.is_relative_to(defaults[0])]
  files = [omegaconf.OmegaConf.load(c) for c in reversed(own)]
  merged = omegaconf.OmegaConf.merge({}, *({k: v for k, v in f.items() if k != "base_config"} for f in files))
  model = omegaconf.OmegaConf.load(found)
  wins = _recipe_wins(model, merged)
  seen = found == maxtext_finds(config_path, model_name, maxtext_configs)
  hidden = [] if seen else model_file.as_overrides(omegaconf.OmegaConf.to_container(model, resolve=True))
  if wins or hidden:
    _refuse_user_overrides(model, overrides)
  return [*hidden, *wins]
