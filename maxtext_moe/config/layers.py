"""The chain of YAML layers a recipe names through `base_config`, checked before MaxText loads it; key=value
overrides merged on top of the layers (`on_top`), and one key read off them (`layer_value`).

MaxText's loader (`pyconfig._load_config`) follows `base_config` recursively and merges each file into the
next. A file that is a YAML list, not a mapping, makes that merge raise a TypeError; a chain that comes back
to a file recurses until Python's limit; a base that exists nowhere is an OSError from deep inside. Walked
here first, each is one line naming the file. A base is looked for as MaxText looks: next to the file that
names it, then in MaxText's configs directory.
"""

from pathlib import Path
from typing import Any

import omegaconf
import yaml

from maxtext_moe.errors import UserError


def check_chain(config_path: Path, maxtext_configs: Path) -> list[Path]:
  """The layers from `config_path` down to the last base, or UserError (one line) for a bad one. Read as
  MaxText reads them (OmegaConf, so `base_config: ${maxtext_configs:base.yml}` resolves, given the
  resolvers are installed)."""
  chain: list[Path] = []
  path = Path(config_path).resolve()
  while True:
    if path in chain:
      loop = " -> ".join(p.name for p in [*chain, path])
      raise UserError(f"{chain[-1]}: base_config comes back to {path.name} ({loop}); end the chain at a base")
    chain.append(path)
    try:
      data = omegaconf.OmegaConf.load(path)
      base = data.get("base_config") if isinstance(data, omegaconf.DictConfig) else None
    except (yaml.YAMLError, omegaconf.errors.OmegaConfBaseException):
      return chain  # MaxText's loader reports where (a one-line error above this)
    if not isinstance(data, omegaconf.DictConfig):
      raise UserError(f"{path}: a config file is a mapping of key: value lines, not a list")
    if not base:
      return chain
    path = _find(str(base), path, maxtext_configs)


def _find(base: str, named_in: Path, maxtext_configs: Path) -> Path:
  if Path(base).is_absolute():
    candidates = [Path(base)]
  else:
    candidates = [named_in.parent / base, maxtext_configs / base]
  for candidate in candidates:
    if candidate.is_file():
      return candidate.resolve()
  where = " or ".join(str(c) for c in candidates)
  raise UserError(f"{named_in}: base_config {base} not found (looked for {where})")


def require_base(chain: list[Path], ours: Path) -> None:
  """A config is layered on our base (`configs/base.yml`), as every shipped recipe is: a file that does not
  reach it (an empty file, a MaxText config, a file with no base_config) would train MaxText's own default
  model without our keys, with no word. One line saying how to start the file instead."""
  if ours.resolve() in chain:
    return
  try:
    yaml.safe_load(chain[-1].read_text(encoding="utf-8"))
  except yaml.YAMLError:
    return  # the walk stopped at a file that does not parse: MaxText's loader says where (one line)
  first = chain[0]
  copy = next((p.parent for p in chain if p.name == "base.yml" and (p.parent / "recipes").is_dir()), None)
  if copy is not None:  # a file based on a recipe of another copy of configs/ (a second clone's)
    raise UserError(
      f"{first} is layered on another copy of configs/ ({copy}); this maxtext-moe reads {ours.parent}: set "
      "MAXTEXT_MOE_CONFIGS to that copy to use it, or base the file on ${moe_configs:recipes/HW/MODEL.yml}"
    )
  what = "is empty" if not first.read_text(encoding="utf-8").strip() else "is not layered on maxtext-moe's base"
  raise UserError(
    f"{first} {what}: a recipe file starts with base_config: ${{moe_configs:base.yml}} (our defaults) or "
    "${moe_configs:recipes/HW/MODEL.yml} (a shipped recipe to change), then the keys it sets"
  )


def plain(value: Any) -> Any:
  """A value of the layers as plain Python: a mapping or list node, interpolations resolved, as dict/list."""
  if isinstance(value, omegaconf.DictConfig | omegaconf.ListConfig):
    return omegaconf.OmegaConf.to_container(value, resolve=True)
  return value


def layer_value(cfg: omegaconf.DictConfig, key: str) -> Any:
  """One key of the merged layers, interpolations resolved, as MaxText reads it ("none" is None)."""
  value = plain(cfg.get(key))
  return None if isinstance(value, str) and value.lower() == "none" else value


def on_top(layers: omegaconf.DictConfig, *overrides: omegaconf.DictConfig) -> omegaconf.DictConfig:
  """`overrides` (each `OmegaConf.from_cli`'s) merged over `layers`, later ones winning. A mapping given
  for a key the layers hold as a list, or the reverse, is one line naming the key (OmegaConf's merge says
  only "Cannot merge incompatible container types")."""
  try:
    return omegaconf.OmegaConf.merge(layers, *overrides)
  except TypeError as e:
    kinds = {omegaconf.DictConfig: "a mapping, as KEY={a: 1}", omegaconf.ListConfig: "a list, as KEY=[a,b]"}
    for over in overrides:
      for key in over:
        have, got = layers.get(key), over.get(key)
        if type(have) in kinds and type(got) in kinds and type(have) is not type(got):
          want = kinds[type(have)].replace("KEY", str(key))
          raise UserError(f"{key} takes {want} (got {layer_value(over, key)!r})") from e
    raise
