"""A recipe and its overrides, read in one place: the YAML layers, the model file, the overrides and the
flag profile, before anything starts the JAX backend; then the one MaxText resolution.

    recipe = read("h200x8/deepseek3-proxy-16b", ["steps=10"])   # no JAX backend yet
    environment.apply(recipe.flags)                              # the launcher, before the backend starts
    cfg = recipe.resolve()                                       # the one resolved config of this process
"""

import datetime
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from maxtext_moe.config import flags as flag_profiles
from maxtext_moe.config import recipes
from maxtext_moe.config.flags import FlagSet
from maxtext_moe.errors import UserError
from maxtext_moe.upstream import config as upstream_config


def _check_overrides(overrides: list[str]) -> None:
  for item in overrides:
    key, sep, _ = item.partition("=")
    if not sep or not key:
      raise UserError(f"expected key=value, got '{item}'")


def derived_overrides(keys: upstream_config.LayerKeys, now: datetime.datetime | None = None) -> list[str]:
  """key=value pairs the launcher adds: the output directory made absolute (it is taken from the current
  directory), and a run name to the second when none is set (MaxText's own is to the minute, so two runs
  started in the same minute would silently share checkpoints)."""
  extra = []
  out = keys.base_output_directory
  if out and not os.path.isabs(out) and "://" not in out:
    extra.append(f"base_output_directory={Path(out).resolve()}")
  if not keys.run_name_set:
    stamp = (now or datetime.datetime.now()).strftime("%Y%m%d-%H%M%S")
    extra.append(f"run_name={keys.model_name}-{keys.plugin.recipe_hardware}-{stamp}")
  return extra


@dataclass(frozen=True)
class Recipe:
  """A recipe read from its YAML layers, with the user's overrides, not yet resolved by MaxText."""

  name: str | None  # as given on the command line (None: the default recipe)
  path: Path
  user_overrides: tuple[str, ...]
  overrides: list[str]  # the user's, then the derived ones
  keys: upstream_config.LayerKeys
  flags: FlagSet  # the flag profile's environment and XLA flags, dump_hlo's included

  def shared_by_all_processes(self) -> "Recipe":
    """In a multi-process job every process must write to one run directory: all take process 0's clock
    for the derived run name (their own may be a second apart).

    On CPU it also turns JAX's persistent compilation cache off unless the user set jax_cache_dir: JAX
    writes it from process 0 only, so on a rerun process 0 loads the train step in seconds while the
    others compile it, and the first collective after it (gloo, whose rendezvous waits 30 s) fails."""
    extra = []
    if str(self.keys.plugin.recipe_hardware) == "cpu" and not any(
      o.startswith("jax_cache_dir=") for o in self.user_overrides
    ):
      extra = ["jax_cache_dir="]
    if self.keys.run_name_set:
      return replace(self, overrides=[*self.overrides, *extra])
    import numpy as np  # pylint: disable=import-outside-toplevel
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

    now = datetime.datetime.now()
    day, second = (int(now.strftime(f)) for f in ("%Y%m%d", "%H%M%S"))
    day, second = (int(v) for v in multihost_utils.broadcast_one_to_all(np.array([day, second], np.int32)))
    shared = datetime.datetime.strptime(f"{day:08d}{second:06d}", "%Y%m%d%H%M%S")
    return replace(self, overrides=[*self.user_overrides, *derived_overrides(self.keys, shared), *extra])

  def resolve(self) -> Any:
    """The one MaxText resolution of this recipe. It starts the JAX backend first, unless dump_hlo is on:
    MaxText's validation fills an unset XLA_FLAGS with HLO-dump flags (`validate_and_set_hlo_dump_defaults`,
    31 MB in /tmp/xla_dump per compile of the tiny model) before it starts the backend itself. Its write
    to XLA_FLAGS is undone, so child processes do not inherit it either."""
    import jax  # pylint: disable=import-outside-toplevel

    if self.keys.dump_hlo:
      return upstream_config.resolve(self.path, self.overrides, keys=self.keys)
    saved = os.environ.get("XLA_FLAGS")
    jax.devices()
    try:
      return upstream_config.resolve(self.path, self.overrides, keys=self.keys)
    finally:
      if saved is None:
        os.environ.pop("XLA_FLAGS", None)
      else:
        os.environ["XLA_FLAGS"] = saved


def read(name: str | None, overrides: list[str], *, keep_process_flags: bool = True) -> Recipe:
  """Finds the recipe and reads everything decided before MaxText resolves it (no JAX backend starts).
  `keep_process_flags=False`: the flag environment for another machine (`flags`, `k8s`), without this
  process's own XLA_FLAGS."""
  _check_overrides(overrides)
  path = recipes.recipe_path(name or recipes.DEFAULT_RECIPE)
  keys = upstream_config.layer_keys(path, overrides)
  run_flags = flag_profiles.for_config(keys.plugin, keep_process_flags=keep_process_flags)
  run_flags.add_flags(keys.dump_hlo_flags)
  return Recipe(name, path, tuple(overrides), [*overrides, *derived_overrides(keys)], keys, run_flags)
