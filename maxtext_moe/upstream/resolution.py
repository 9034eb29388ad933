"""A recipe resolved, top to bottom, in one place: every step takes the step before's value, and MaxText's
pieces (`upstream/maxtext/config.py`) and ours (`config/`) are leaves that call back into no step.

    recipe = read("h200x8/deepseek3-proxy-16b", ["steps=10"])   # steps 1-6: no JAX backend yet
    environment.apply(recipe.flags)                              # the launcher, before the backend starts
    cfg = recipe.resolve()                                       # step 7: the one resolved config

1. recipe file    a name (or a path) -> the recipe's file (`config/recipes.py`)
2. YAML layers    the file's `base_config` chain, checked (`config/layers.py`) and merged by MaxText's
                  loader
3. model file     a `model_file`'s keys (`config/model_file.py`) on the layers, the user's overrides on top
4. overrides      the plugin's keys validated; the recipe's keys that its model YAML also sets, and a
                  vocabulary sized from the tokenizer (`config/model_yaml.py`, `config/derived.py`)
5. derived keys   `nodes` -> devices, NVLink domains and the cross-node axis (`config/derived.py`,
                  `config/nodes.py`); the run directory made absolute and a run name to the second
6. flag profile   the environment and XLA flags (`config/flags.py`), dump_hlo's included
7. MaxText        the argv MaxText resolves (offload preset, recipe over model, model file, the user's,
                  the node layout) into `MoEMaxTextConfig`: MaxText's config with our keys and checks

No other module under `upstream/` imports `config/` (tests/test_code_shape.py). The trainer is handed the
resolved object itself (`upstream/maxtext/trainer.py`), so MaxText never parses again.
"""

import datetime
import os
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

import omegaconf
import pydantic
import yaml

from maxtext_moe.config import checks, derived, layers, model_file, model_yaml, nodes, offload, recipes, stage_checks
from maxtext_moe.config import flags as flag_profiles
from maxtext_moe.config.flags import FlagSet
from maxtext_moe.config.keys import PluginKeys
from maxtext_moe.errors import UserError
from maxtext_moe.moe.layout import expert_parallelism
from maxtext_moe.upstream.maxtext import config as mt
from maxtext_moe.upstream.maxtext.config import hyperparameters  # noqa: F401  # MaxText's view of step 7's value

# The model files in configs/models/ that MaxText's closed `model_name` Literal lacks (the rest shadow its
# files of the same name). A new model is its YAML file, named after the family MaxText keys behaviour on.
PLUGIN_MODEL_NAMES = mt.names_beyond((recipes.configs_dir() / "models").glob("*.yml"))


class MoEMaxTextConfig(PluginKeys, mt.MaxTextConfig):
  """MaxText's config plus the plugin's keys and cross-field checks. Unknown keys stay errors."""

  model_name: mt.ModelName | Literal[PLUGIN_MODEL_NAMES] = pydantic.Field(  # type: ignore[valid-type]
    "default", description="The name of the model configuration to use."
  )

  @pydantic.model_validator(mode="after")
  def set_derived_and_validate_values(self) -> "MoEMaxTextConfig":
    """MaxText's derivations under its validator's name: `check_vocab_tiling` first, stage errors as one line."""
    checks.check_vocab_tiling(self)
    try:
      return mt.MaxTextConfig.set_derived_and_validate_values(self)
    except AssertionError:
      stage_checks.check_pipeline_divides_layers(self)
      raise

  @pydantic.model_validator(mode="after")
  def _plugin_checks(self) -> "MoEMaxTextConfig":
    for check in checks.ALL_CHECKS:
      check(self)
    return self


def read(name: str | None, overrides: list[str], *, keep_process_flags: bool = True) -> "Recipe":
  """Steps 1-6: finds the recipe and reads everything decided before MaxText resolves it (no JAX backend
  starts). `keep_process_flags=False`: the flag environment for another machine (`flags`, `k8s`), without
  this process's own XLA_FLAGS."""
  _check_overrides(overrides)
  path = recipes.recipe_path(name or recipes.DEFAULT_RECIPE)  # 1
  keys = layer_keys(path, overrides)  # 2-5
  run_flags = flag_profiles.for_config(keys.plugin, keep_process_flags=keep_process_flags)  # 6
  run_flags.add_flags(keys.dump_hlo_flags)
  return Recipe(name, path, tuple(overrides), [*overrides, *derived_overrides(keys)], keys, run_flags)


def _check_overrides(overrides: list[str]) -> None:
  for item in overrides:
    key, sep, _ = item.partition("=")
    if not sep or not key:
      raise UserError(f"expected key=value, got '{item}'")


@dataclass(frozen=True)
class LayerKeys:
  """What steps 2-5 decide before MaxText resolves the config: the plugin keys (validated, the rest at
  their defaults) and a few of MaxText's, as the layers and overrides set them."""

  plugin: PluginKeys
  model_overrides: list[str]  # the model YAML's keys (plugin key model_file), as key=value
  recipe_over_model: list[str]  # the recipe's keys that models/<model_name>.yml also sets (`model_yaml`)
  run_name: str
  run_name_set: bool  # by a YAML layer or an override, not left to MaxText's default
  base_output_directory: str
  model_name: str
  dump_hlo: bool
  dump_hlo_flags: list[str]  # the XLA flags that make dump_hlo dump (MaxText adds them only without XLA_FLAGS)
  maxtext: dict[str, Any]  # MaxText's keys of `MAXTEXT_LAYER_KEYS`, as the layers and overrides set them
  layout: nodes.NodeLayout  # the job on `nodes` nodes: devices, NVLink domains, the cross-node axis

  @property
  def expert_parallelism(self) -> int:
    return expert_parallelism(SimpleNamespace(**self.maxtext))


_LAYER_PLUGIN_KEYS = ("recipe_hardware", "recipe_num_devices", "nodes", "gpus_per_node", "vocab_from_tokenizer")
_LAYER_PLUGIN_KEYS += ("flag_profile", "xla_flags_extra", "env_extra", "offload", "finetune")
_LAYER_PLUGIN_KEYS += ("moe_dispatch", "moe_gemm_backend", "moe_gemm_quantization")
_LAYER_OTHER_KEYS = ("run_name", "base_output_directory", "model_name", "dump_hlo", "dump_hlo_local_dir")
_LAYER_OTHER_KEYS += ("dump_hlo_local_module_name",)
# MaxText's keys the launcher reads from the layers (MaxText's defaults where they are unset).
MAXTEXT_LAYER_KEYS = {"num_slices": 1, "attention": "autoselected", "ici_expert_parallelism": 1}
MAXTEXT_LAYER_KEYS |= {"te_moe_block": False, "quantization": ""}  # what compile substitutes (and, below, stages)
MAXTEXT_LAYER_KEYS |= {"dcn_expert_parallelism": 1, "ici_pipeline_parallelism": 1, "dcn_pipeline_parallelism": 1}
MAXTEXT_LAYER_KEYS |= {"load_parameters_path": "", "load_full_state_path": ""}  # a launcher checks (model_check.py)
_LAYER_ERRORS = (pydantic.ValidationError, ValueError, yaml.YAMLError, omegaconf.errors.OmegaConfBaseException)


def layer_keys(config_path: str | Path, overrides: list[str]) -> LayerKeys:
  """Steps 2-5 on a recipe file: the YAML layers, the model file, the overrides and the derived keys,
  without MaxText's validation (no JAX).

  Raises:
    UserError: one line for a bad value of one of these keys, a derived key set, a bad model YAML, or an
      unreadable YAML layer.
  """
  mt.install_resolvers(recipes.configs_dir())
  mt.refuse_derived(overrides)
  try:
    chain, files = yaml_layers(config_path)  # 2
    model_overrides, merged = with_model_file(files, overrides)  # 3
    raw = {k: layers.layer_value(merged, k) for k in (*_LAYER_PLUGIN_KEYS, *_LAYER_OTHER_KEYS)}
    plugin = PluginKeys.model_validate({k: raw[k] for k in _LAYER_PLUGIN_KEYS if raw[k] is not None})  # 4
    model_name = str(raw["model_name"] or "default")
    mt_configs = mt.maxtext_configs_dir()
    over_model = model_yaml.recipe_over_model(config_path, chain, model_name, overrides, mt_configs)
    over_model += derived.vocab_from_tokenizer(merged, plugin, overrides)
    values = {k: layers.layer_value(merged, k) for k in MAXTEXT_LAYER_KEYS}
    values = {k: default if values[k] is None else values[k] for k, default in MAXTEXT_LAYER_KEYS.items()}
    layout = derived.node_layout(merged, plugin)  # 5
  except _LAYER_ERRORS as e:
    raise UserError(mt.one_line(e, MoEMaxTextConfig.model_fields)) from e
  return LayerKeys(
    plugin=plugin.model_copy(update={"nodes": layout.nodes, "recipe_num_devices": layout.devices}),
    model_overrides=model_overrides,
    recipe_over_model=over_model,
    run_name=str(raw["run_name"] or ""),
    run_name_set=bool(raw["run_name"]),
    base_output_directory=str(raw["base_output_directory"] or ""),
    model_name=model_name,
    dump_hlo=bool(raw["dump_hlo"]),
    dump_hlo_flags=mt.dump_flags(raw) if raw["dump_hlo"] else [],
    maxtext=values | {"num_slices": layout.slices},
    layout=layout,
  )


def yaml_layers(config_path: str | Path) -> tuple[list[Path], omegaconf.DictConfig]:
  """Step 2: the file's chain of layers, checked (one line for a bad one, or one not on our base), and the
  layers merged by MaxText's loader."""
  chain = layers.check_chain(Path(config_path), mt.maxtext_configs_dir())
  layers.require_base(chain, recipes.configs_dir() / "base.yml")
  return chain, mt.load_layers(config_path)


def with_model_file(files: omegaconf.DictConfig, overrides: list[str]) -> tuple[list[str], omegaconf.DictConfig]:
  """Step 3: the keys of the `model_file` the layers or overrides name (a converted checkpoint's model
  YAML) as key=value, and the layers with those keys, then the user's overrides, on top."""
  user = omegaconf.OmegaConf.from_cli(list(overrides))
  merged = layers.on_top(files, user)
  model_path = layers.layer_value(merged, "model_file")
  if not model_path:
    return [], merged
  model_overrides = model_file.as_overrides(model_file.read(model_path))
  return model_overrides, layers.on_top(files, omegaconf.OmegaConf.from_cli(model_overrides), user)


def derived_overrides(keys: LayerKeys, now: datetime.datetime | None = None) -> list[str]:
  """Step 5's key=value pairs: the output directory made absolute (it is taken from the current
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


def maxtext_argv(config_path: str | Path, overrides: list[str], keys: LayerKeys) -> list[str]:
  """Step 7's argv: the offload preset's keys, the recipe's over its model file's, a model_file's, then the
  user's overrides (so theirs win), then the node layout."""
  ours = keys.recipe_over_model + (["override_model_config=true"] if keys.recipe_over_model else [])
  preset = offload.preset_overrides(keys.plugin.offload)
  return ["", str(config_path), *preset, *ours, *keys.model_overrides, *overrides, *keys.layout.overrides()]


def resolve(config_path: str | Path, overrides: list[str], *, keys: LayerKeys | None = None) -> MoEMaxTextConfig:
  """Step 7: `config_path` + `key=value` overrides resolved the MaxText way, with our keys and checks: one
  MaxText resolution. `keys`: steps 2-5 already read for these overrides (read here when None).

  Raises:
    UserError: one line describing a bad key, value or layout.
  """
  keys = keys or layer_keys(config_path, overrides)
  mt.install_resolvers(recipes.configs_dir())
  return mt.initialize(maxtext_argv(config_path, overrides, keys), MoEMaxTextConfig, MoEMaxTextConfig.model_fields)


def resolved(config_path: str | Path, overrides: list[str]) -> Any:
  """`hyperparameters(resolve(...))`: a recipe + overrides as MaxText's code sees it."""
  return mt.hyperparameters(resolve(config_path, overrides))


def job_devices(n: int) -> list[str]:
  """MaxText counts `n` devices, not this machine's (batch keys, microbatch check): plan, compile, checks."""
  return ["internal_compile=true", f"internal_compile_num_devices={n}"]


def maxtext_base_defaults() -> dict[str, Any]:
  """MaxText's own base.yml, resolved with no plugin layers, as JSON-able values (for `maxtext-moe config`)."""
  mt.install_resolvers(recipes.configs_dir())
  return mt.maxtext_base_defaults(MoEMaxTextConfig.model_fields)


@dataclass(frozen=True)
class Recipe:
  """A recipe read from its YAML layers, with the user's overrides, not yet resolved by MaxText."""

  name: str | None  # as given on the command line (None: the default recipe)
  path: Path
  user_overrides: tuple[str, ...]
  overrides: list[str]  # the user's, then the derived ones
  keys: LayerKeys
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

  def away_from_its_gpus(self) -> bool:
    """A GPU recipe where its GPUs are not (a login node, a CPU machine): no GPU backend, or not its count."""
    import jax  # pylint: disable=import-outside-toplevel

    want, gpu = self.keys.layout.devices, str(self.keys.plugin.recipe_hardware) != "cpu"
    return gpu and (jax.default_backend() != "gpu" or (want > 0 and jax.device_count() != want))

  def as_its_job(self) -> "Recipe":
    """Away from its GPUs, this recipe with MaxText counting the job's devices (`job_devices`), as `plan` and
    `compile` resolve it: its batch keys and a pipeline's microbatch check are the job's. Else unchanged."""
    away = self.keys.layout.devices > 0 and self.away_from_its_gpus()
    return replace(self, overrides=[*self.overrides, *job_devices(self.keys.layout.devices)]) if away else self

  def resolve(self) -> MoEMaxTextConfig:
    """Step 7, the one MaxText resolution of this recipe. It starts the JAX backend first, unless dump_hlo is on:
    MaxText's validation fills an unset XLA_FLAGS with HLO-dump flags (`validate_and_set_hlo_dump_defaults`,
    31 MB in /tmp/xla_dump per compile of the tiny model) before it starts the backend itself. Its write
    to XLA_FLAGS is undone, so child processes do not inherit it either."""
    import jax  # pylint: disable=import-outside-toplevel

    if self.keys.dump_hlo:
      return resolve(self.path, self.overrides, keys=self.keys)
    saved = os.environ.get("XLA_FLAGS")
    jax.devices()
    try:
      return resolve(self.path, self.overrides, keys=self.keys)
    finally:
      if saved is None:
        os.environ.pop("XLA_FLAGS", None)
      else:
        os.environ["XLA_FLAGS"] = saved
