"""`maxtext-moe config`: the resolved config, and what our layers changed relative to MaxText."""

from typing import Any

from maxtext_moe.config.keys import PLUGIN_KEY_NAMES, PluginKeys

_SKIP = {"base_config"}  # a loader meta-key, always differs


def _fmt(v: Any) -> str:
  return repr(getattr(v, "value", v))  # enums print as their value


def config_diff(cfg: dict[str, Any], base: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
  """{key: (maxtext_default, ours)} for every MaxText key whose resolved value differs."""
  return {k: (base[k], v) for k, v in cfg.items() if k in base and k not in _SKIP and base[k] != v}


def show_config(recipe: str, overrides: list[str], *, show_all: bool = False) -> str:
  """Text report: plugin keys, then changed (or all) MaxText keys, sorted."""
  from maxtext_moe import maxtext_adapter
  from maxtext_moe.launch.train import prepare

  path, full, cfg = prepare(recipe, overrides)
  ours = cfg.model_dump()
  base = maxtext_adapter.maxtext_base_defaults()
  lines = [f"# {path}", f"# overrides: {' '.join(full) or '(none)'}", "", "plugin keys:"]
  lines += [f"  {k}: {_fmt(ours[k])}" for k in PLUGIN_KEY_NAMES]
  if show_all:
    lines += ["", "all MaxText keys:"]
    lines += [f"  {k}: {_fmt(v)}" for k, v in sorted(ours.items()) if k not in PLUGIN_KEY_NAMES]
  else:
    diff = config_diff(ours, base)
    lines += ["", f"changed vs MaxText base.yml ({len(diff)} keys): key: ours  (maxtext default)"]
    lines += [f"  {k}: {_fmt(new)}  ({_fmt(old)})" for k, (old, new) in sorted(diff.items())]
  return "\n".join(lines)


def show_keys() -> str:
  """The plugin's keys with their defaults and descriptions."""
  lines = []
  for name, f in PluginKeys.model_fields.items():
    lines.append(f"{name} (default {_fmt(f.default)}): {f.description}")
  return "\n".join(lines)
