"""`maxtext-moe config`: the resolved config as YAML, and what our layers changed relative to MaxText.

The output parses as YAML: `plugin_keys`, then `changed_vs_maxtext` (each key's value, MaxText's own
base.yml value in a comment) or, with --all, `maxtext_keys`."""

from typing import Any

import yaml
from pydantic.fields import FieldInfo

from maxtext_moe.config.keys import PLUGIN_KEY_NAMES, PluginKeys

_SKIP = {"base_config"}  # a loader meta-key, always differs


def config_diff(cfg: dict[str, Any], base: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
  """{key: (maxtext_default, ours)} for every MaxText key whose resolved value differs."""
  return {k: (base[k], v) for k, v in cfg.items() if k in base and k not in _SKIP and base[k] != v}


def _flow(value: Any) -> str:
  """One line of YAML for any value (flow style: JSON-like collections)."""
  text = yaml.safe_dump(value, default_flow_style=True, width=10**9)
  return text.strip().removesuffix("...").strip()


def _yaml_entry(key: str, value: Any, comment: str = "") -> str:
  return f"  {key}: {_flow(value)}" + (f"  # {comment}" if comment else "")


def show_config(recipe: str, overrides: list[str], *, show_all: bool = False) -> str:
  """YAML report: plugin keys, then changed (or all) MaxText keys, sorted."""
  from maxtext_moe.upstream import resolution
  from maxtext_moe.upstream.resolution import maxtext_base_defaults

  read = resolution.read(recipe, overrides)
  job = read.as_its_job()  # a GPU recipe away from its GPUs: the batch keys as its job counts devices
  ours = job.resolve().model_dump(mode="json")
  base = maxtext_base_defaults()
  lines = [f"# recipe: {read.path}", f"# overrides: {' '.join(read.overrides) or '(none)'}"]
  if job is not read:
    lines.append(
      f"# devices: the job's {read.keys.layout.devices} GPUs (internal_compile_num_devices), not this machine's"
    )
  lines.append("plugin_keys:")
  lines += [_yaml_entry(key, ours[key]) for key in PLUGIN_KEY_NAMES]
  if show_all:
    lines.append("maxtext_keys:")
    lines += [_yaml_entry(k, v) for k, v in sorted(ours.items()) if k not in PLUGIN_KEY_NAMES]
    return "\n".join(lines)
  diff = config_diff(ours, base)
  lines.append(f"changed_vs_maxtext:  # {len(diff)} keys; MaxText's base.yml value in the comment")
  lines += [_yaml_entry(key, new, f"maxtext: {_flow(old)}") for key, (old, new) in sorted(diff.items())]
  return "\n".join(lines)


def default_text(field: FieldInfo) -> str:
  """A key's default as a user writes it in key=value (YAML): a list key's `[]` (its default_factory's value;
  `field.default` printed PydanticUndefined), `unset` where None leaves the decision to MaxText's own keys
  (offload), `required` where there is none."""
  if field.is_required():
    return "required"
  value = field.get_default(call_default_factory=True)
  return "unset" if value is None else _flow(getattr(value, "value", value))


def show_keys() -> str:
  """The plugin's keys with their defaults and descriptions."""
  return "\n".join(
    f"{name} (default {default_text(f)}): {f.description}" for name, f in PluginKeys.model_fields.items()
  )
