"""XLA/NCCL flag profiles: compose them for a config, validate every XLA flag against the installed
jaxlib, and render them as shell `export` lines.

Profiles live in configs/flags/profiles.yml (data an operator can read), one per `recipe_hardware`.
XLA aborts the process on an unknown flag and reads XLA_FLAGS once, when the backend starts, so:
- `probe` runs a child Python with the flags and starts the CPU backend (XLA registers its GPU flags
  on every platform, so a CPU machine validates them too); a failure is pinned to one flag by probing
  each alone, and reported with the jaxlib version. Good results are cached per jaxlib version.
- the launcher applies the environment to its own process before the XLA backend starts
  (`launch.environment.apply`).
"""

import hashlib
import json
import os
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from maxtext_moe.config.recipes import configs_dir
from maxtext_moe.errors import UserError


@dataclass
class FlagSet:
  """Environment variables and XLA flags for one run; XLA_FLAGS is derived from `xla_flags`."""

  env: dict[str, str] = field(default_factory=dict)
  xla_flags: list[str] = field(default_factory=list)

  def add_flags(self, flags: list[str]) -> None:
    """Appends flags; one with the same name as an earlier one replaces it (later wins)."""
    for flag in flags:
      name = flag.split("=", 1)[0]
      self.xla_flags = [f for f in self.xla_flags if f.split("=", 1)[0] != name] + [flag]

  def full_env(self) -> dict[str, str]:
    return self.env | ({"XLA_FLAGS": " ".join(self.xla_flags)} if self.xla_flags else {})

  def export_lines(self) -> str:
    lines = [f"export {k}={shlex.quote(v)}" for k, v in self.full_env().items()]
    return "\n".join(lines) if lines else "# this flag profile sets nothing"


def flag_value(xla_flags: list[str], name: str) -> str | None:
  """The value the last `name=value` of `xla_flags` sets (XLA takes the last), None where none does."""
  found = [f.split("=", 1)[1] for f in xla_flags if f.split("=", 1)[0] == name and "=" in f]
  return found[-1] if found else None


def _profiles() -> dict[str, Any]:
  return yaml.safe_load((configs_dir() / "flags" / "profiles.yml").read_text())


def profile(name: str) -> FlagSet:
  """The flags of profile `name` (h100, h200, b200, b300, gb200, gb300, cpu)."""
  data = _profiles()
  if name not in data["profiles"]:
    raise UserError(f"unknown flag profile '{name}'; known: {', '.join(data['profiles'])}")
  entry = data["profiles"][name]
  out = FlagSet()
  for layer in [*(data[layer] for layer in entry.get("layers", [])), entry]:
    out.env |= {k: str(v) for k, v in (layer.get("env") or {}).items()}
    out.add_flags(list(layer.get("xla_flags") or []))
  return out


def for_config(cfg: Any, *, keep_process_flags: bool = True) -> FlagSet:
  """The profile chosen by `flag_profile` (auto: the recipe's hardware), then XLA flags already in this
  process's XLA_FLAGS (the user's; not with keep_process_flags=False, for another machine's environment),
  then `xla_flags_extra` / `env_extra`; a later flag of the same name wins. `cfg` is anything with those
  four keys: a resolved config, or the launch keys read before resolving."""
  name = str(cfg.flag_profile)
  flags = FlagSet() if name == "disabled" else profile(str(cfg.recipe_hardware) if name == "auto" else name)
  if keep_process_flags:  # keep what the user set (e.g. --xla_force_host_platform_device_count); probed too
    flags.add_flags(os.environ.get("XLA_FLAGS", "").split())
  for item in cfg.env_extra:
    key, sep, value = str(item).partition("=")
    if not sep or not key:
      raise UserError(f"env_extra entry {item!r} is not KEY=VALUE")
    flags.env[key] = value
  extra = [str(f) for f in cfg.xla_flags_extra]
  for f in extra:
    if not f.startswith("--xla_") or "=" not in f:
      raise UserError(f"xla_flags_extra entry {f!r} is not of the form --xla_name=value")
  flags.add_flags(extra)
  return flags


def _jaxlib_version() -> str:
  from importlib.metadata import version  # pylint: disable=import-outside-toplevel

  return version("jaxlib")


def _run_probe(flags: list[str]) -> subprocess.CompletedProcess:
  env = dict(os.environ, XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu", TF_CPP_MIN_LOG_LEVEL="0")
  code = "import jax; jax.devices('cpu')"
  return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120, check=False)


def _cache_path() -> Path:
  return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "maxtext_moe" / "xla_flag_probe.json"


def probe(flags: list[str]) -> None:
  """Raises UserError naming the first XLA flag the installed jaxlib rejects (unknown name or bad value)."""
  if not flags:
    return
  version = _jaxlib_version()
  key = hashlib.sha256(json.dumps([version, flags]).encode()).hexdigest()
  cache = _cache_path()
  try:
    known = json.loads(cache.read_text())
  except (OSError, ValueError):
    known = {}
  if known.get(key) == "ok":
    return
  if _run_probe(flags).returncode != 0:
    for flag in flags:
      proc = _run_probe([flag])
      if proc.returncode != 0:
        unknown = "Unknown flag" in proc.stderr
        why = "is not a flag of" if unknown else "has a value rejected by"
        raise UserError(
          f"XLA flag {flag} {why} the installed jaxlib {version}; fix or drop it (XLA_FLAGS, xla_flags_extra)"
        )
    raise UserError(f"the installed jaxlib {version} rejects this combination of XLA flags: {' '.join(flags)}")
  known[key] = "ok"
  try:
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(known))
  except OSError:
    pass  # a read-only home only costs the probe next time
