"""Config resolution through MaxText: our keys in its pydantic class, resolved once per process.

Two reads, in this order:
1. `layer_keys`: the YAML layers and key=value overrides through MaxText's own loader (OmegaConf only: no
   pydantic, no JAX backend), for what must be decided before the backend starts (the flag environment)
   or before MaxText sees the overrides (the offload preset's keys, the run directory).
2. `resolve`: the one MaxText resolution (`pyconfig._initialize_pydantic` with `MoEMaxTextConfig`), with
   the preset expanded in front of the user's overrides (which therefore win). MaxText's validation starts
   the JAX backend, so everything in step 1 must be applied first.
The trainer is then handed the resolved object itself (`upstream.trainer`), so MaxText never parses again.
"""

import difflib
import re
import typing
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

import omegaconf
import pydantic
import yaml
from maxtext.configs import pyconfig, types
from maxtext.utils import globals as mt_globals
from maxtext.utils import max_utils

from maxtext_moe.config import checks, layers, model_file, nodes, offload, stage_checks
from maxtext_moe.config.keys import PluginKeys
from maxtext_moe.config.recipes import configs_dir
from maxtext_moe.data import arithmetic, corpus
from maxtext_moe.errors import UserError
from maxtext_moe.moe.layout import expert_parallelism
from maxtext_moe.upstream import model_yaml
from maxtext_moe.upstream.derived import layer_value, node_layout, refuse_derived, vocab_from_tokenizer
from maxtext_moe.upstream.patches import Patch, installed


def plugin_model_names() -> tuple[str, ...]:
  """The model files in configs/models/ that MaxText's closed `model_name` Literal lacks (the rest shadow
  MaxText's own files of the same name). A new model is its YAML file; its name should start with the
  family MaxText keys behaviour on (e.g. "deepseek3": sigmoid + bias, group-limited top-k routing)."""
  known = set(typing.get_args(types.ModelName))
  return tuple(sorted(p.stem for p in (configs_dir() / "models").glob("*.yml") if p.stem not in known))


PLUGIN_MODEL_NAMES = plugin_model_names()


class MoEMaxTextConfig(PluginKeys, types.MaxTextConfig):
  """MaxText's config plus the plugin's keys and cross-field checks. Unknown keys stay errors."""

  model_name: types.ModelName | Literal[PLUGIN_MODEL_NAMES] = pydantic.Field(  # type: ignore[valid-type]
    "default", description="The name of the model configuration to use."
  )

  @pydantic.model_validator(mode="after")
  def set_derived_and_validate_values(self) -> "MoEMaxTextConfig":
    """MaxText's derivations (this name replaces its validator); where it asserts, pipeline stages that do not
    divide the pipelined layers are one line naming what to set (`stage_checks.check_pipeline_divides_layers`)."""
    try:
      return types.MaxTextConfig.set_derived_and_validate_values(self)
    except AssertionError:
      stage_checks.check_pipeline_divides_layers(self)
      raise

  @pydantic.model_validator(mode="after")
  def _plugin_checks(self) -> "MoEMaxTextConfig":
    for check in checks.ALL_CHECKS:
      check(self)
    return self


def maxtext_configs_dir() -> Path:
  return Path(mt_globals.MAXTEXT_CONFIGS_DIR)


def maxtext_assets_dir() -> Path:
  """maxtext 0.2.5's MAXTEXT_ASSETS_ROOT points at <pkg>/src/maxtext/assets for a pip install, which does
  not exist; the assets really sit next to the package's modules."""
  return Path(mt_globals.MAXTEXT_PKG_DIR) / "assets"


def _asset_path(rel: str) -> str:
  path = maxtext_assets_dir() / rel
  if not path.exists():
    raise UserError(f"maxtext asset '{rel}' not found under {maxtext_assets_dir()}")
  return str(path)


_RESOLVERS = {
  "maxtext_configs": lambda rel: str(maxtext_configs_dir() / rel),
  "moe_configs": lambda rel: str(configs_dir() / rel),
  "maxtext_assets": _asset_path,
  "moe_corpus": lambda name: str(corpus.corpus_path(name)),
  "moe_sft_example": lambda part: arithmetic.example_path(part),
}


def install_resolvers() -> None:
  """YAML-side helpers (idempotent): `${maxtext_configs:base.yml}` (in the installed maxtext's configs),
  `${moe_configs:base.yml}` (in ours), `${maxtext_assets:tokenizers/tokenizer.llama2}` (in its assets),
  `${moe_corpus:python_stdlib}` (an offline corpus parquet) and `${moe_sft_example:train|eval|tokenizer}`
  (the SFT example's files), both built and cached on first use."""
  for name, fn in _RESOLVERS.items():
    if not omegaconf.OmegaConf.has_resolver(name):
      omegaconf.OmegaConf.register_resolver(name, fn, use_cache=True)


@dataclass(frozen=True)
class LayerKeys:
  """What the launcher needs before MaxText resolves the config: the plugin keys (validated, the rest at
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


_LAYER_PLUGIN_KEYS = (
  "recipe_hardware",
  "recipe_num_devices",
  "nodes",
  "gpus_per_node",
  "vocab_from_tokenizer",
  "flag_profile",
  "xla_flags_extra",
  "env_extra",
  "offload",
  "moe_dispatch",
  "moe_gemm_backend",
  "moe_gemm_quantization",
)
# MaxText's keys the launcher reads from the layers (MaxText's defaults where they are unset).
MAXTEXT_LAYER_KEYS = {"num_slices": 1, "attention": "autoselected", "ici_expert_parallelism": 1}
MAXTEXT_LAYER_KEYS |= {"te_moe_block": False, "quantization": ""}  # what compile substitutes (and, below, stages)
MAXTEXT_LAYER_KEYS |= {"dcn_expert_parallelism": 1, "ici_pipeline_parallelism": 1, "dcn_pipeline_parallelism": 1}


def _merged(config_path: str | Path, overrides: list[str]) -> omegaconf.DictConfig:
  chain = layers.check_chain(Path(config_path), maxtext_configs_dir())
  layers.require_base(chain, configs_dir() / "base.yml")
  return omegaconf.OmegaConf.merge(
    pyconfig._load_config(str(config_path)),  # pylint: disable=protected-access
    omegaconf.OmegaConf.from_cli(list(overrides)),
  )


def layer_keys(config_path: str | Path, overrides: list[str]) -> LayerKeys:
  """Reads the launcher's keys from the YAML layers and overrides, without MaxText's validation (no JAX).
  A `model_file` file's keys join the overrides, before the user's own.

  Raises:
    UserError: one line for a bad value of one of these keys, a derived key set, a bad model YAML, or an
      unreadable YAML layer.
  """
  install_resolvers()
  refuse_derived(overrides)
  try:
    merged = _merged(config_path, overrides)
    model_path = layer_value(merged, "model_file")
    model_overrides = model_file.as_overrides(model_file.read(model_path)) if model_path else []
    if model_overrides:
      merged = _merged(config_path, [*model_overrides, *overrides])
    raw = {k: layer_value(merged, k) for k in (*_LAYER_PLUGIN_KEYS, "run_name", "base_output_directory")}
    raw |= {
      k: layer_value(merged, k) for k in ("model_name", "dump_hlo", "dump_hlo_local_dir", "dump_hlo_local_module_name")
    }
    plugin = PluginKeys.model_validate({k: raw[k] for k in _LAYER_PLUGIN_KEYS if raw[k] is not None})
    recipe_over_model = model_yaml.recipe_over_model(
      config_path, str(raw["model_name"] or "default"), overrides, maxtext_configs_dir()
    ) + vocab_from_tokenizer(merged, plugin, overrides)
    values = {k: layer_value(merged, k) for k in MAXTEXT_LAYER_KEYS}
    values = {k: default if values[k] is None else values[k] for k, default in MAXTEXT_LAYER_KEYS.items()}
    layout = node_layout(merged, plugin)
    plugin = plugin.model_copy(update={"nodes": layout.nodes, "recipe_num_devices": layout.devices})
    values["num_slices"] = layout.slices
  except (pydantic.ValidationError, ValueError, yaml.YAMLError, omegaconf.errors.OmegaConfBaseException) as e:
    raise UserError(one_line(e)) from e
  return LayerKeys(
    plugin=plugin,
    model_overrides=model_overrides,
    recipe_over_model=recipe_over_model,
    run_name=str(raw["run_name"] or ""),
    run_name_set=bool(raw["run_name"]),
    base_output_directory=str(raw["base_output_directory"] or ""),
    model_name=str(raw["model_name"] or "default"),
    dump_hlo=bool(raw["dump_hlo"]),
    dump_hlo_flags=_dump_flags(raw) if raw["dump_hlo"] else [],
    maxtext=values,
    layout=layout,
  )


def _dump_flags(raw: dict[str, Any]) -> list[str]:
  """MaxText's own dump_hlo flags (validate_and_set_hlo_dump_defaults), which it sets only when XLA_FLAGS
  is empty: with a flag profile (every GPU recipe) dump_hlo=true would silently dump nothing."""
  flags = [f"--xla_dump_to={raw['dump_hlo_local_dir'] or '/tmp/xla_dump/'}", "--xla_dump_large_constants"]
  module = raw.get("dump_hlo_local_module_name")
  return flags + ([f"--xla_dump_hlo_module_re={module}"] if module else [])


def maxtext_argv(config_path: str | Path, overrides: list[str], keys: LayerKeys) -> list[str]:
  """The argv MaxText resolves: the offload preset's keys, the recipe's over its model file's, a model_file's,
  then the user's overrides (so theirs win)."""
  ours = keys.recipe_over_model + (["override_model_config=true"] if keys.recipe_over_model else [])
  preset = offload.preset_overrides(keys.plugin.offload)
  return ["", str(config_path), *preset, *ours, *keys.model_overrides, *overrides, *keys.layout.overrides()]


_UNKNOWN_KEY = re.compile(r"^'([^']+)' not in ")


def one_line(err: Exception) -> str:
  """Turns MaxText's and pydantic's multi-line config errors into one actionable line."""
  if isinstance(err, yaml.MarkedYAMLError) and err.problem_mark is not None:
    mark = err.problem_mark
    return f"{mark.name}: invalid YAML at line {mark.line + 1}, column {mark.column + 1}: {err.problem}"
  if isinstance(err, pydantic.ValidationError):
    e = err.errors()[0]
    loc = ".".join(str(p) for p in e["loc"]) or "config"
    msg = e["msg"].removeprefix("Value error, ")
    if e["type"] in ("value_error", "assertion_error"):
      return msg
    if e["type"] == "list_type":
      return f"'{loc}' takes a list, as {loc}=[a,b] on the command line (got {e.get('input')!r})"
    return f"bad value for '{loc}': {msg} (got {e.get('input')!r})"
  text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
  m = _UNKNOWN_KEY.match(text)
  if m:
    near = difflib.get_close_matches(m.group(1), MoEMaxTextConfig.model_fields, n=1)
    hint = f"; did you mean '{near[0]}'?" if near else "; run 'maxtext-moe config --keys' for the plugin's keys"
    return f"unknown config key '{m.group(1)}'{hint}"
  return text


def _no_distributed_init(raw_keys: Any) -> None:
  """Resolving a config must not try to join a cluster (MaxText does so inside config parsing): the
  launcher joins one itself, before resolving."""
  del raw_keys


_RESOLVING = [Patch(max_utils, "maybe_initialize_jax_distributed_system", _no_distributed_init)]


def _initialize(argv: list[str], config_class: type) -> Any:
  """MaxText's resolution without its exit-on-error wrapper; errors become one-line UserErrors."""
  install_resolvers()
  try:
    with installed(_RESOLVING):
      return pyconfig._initialize_pydantic(argv, config_class=config_class)  # pylint: disable=protected-access
  except UserError:
    raise
  except AssertionError as e:  # MaxText validates some keys with assert
    raise UserError(f"MaxText refuses this config: {str(e).strip() or 'an assertion failed'}") from None
  except (pydantic.ValidationError, ValueError, TypeError, KeyError, omegaconf.errors.OmegaConfBaseException) as e:
    raise UserError(one_line(e)) from e


def resolve(config_path: str | Path, overrides: list[str], *, keys: LayerKeys | None = None) -> MoEMaxTextConfig:
  """Resolves `config_path` + `key=value` overrides the MaxText way, with our keys and checks: one MaxText
  resolution. `keys`: the layer keys already read for these overrides (read here when None).

  Raises:
    UserError: one line describing a bad key, value or layout.
  """
  keys = keys or layer_keys(config_path, overrides)
  return _initialize(maxtext_argv(config_path, overrides, keys), MoEMaxTextConfig)


def hyperparameters(cfg: MoEMaxTextConfig) -> Any:
  """MaxText's read-only `HyperParameters` view of a resolved config (what its trainer and layers take)."""
  return pyconfig.HyperParameters(cfg)


def resolved(config_path: str | Path, overrides: list[str]) -> Any:
  """`hyperparameters(resolve(...))`: a recipe + overrides as MaxText's code sees it."""
  return hyperparameters(resolve(config_path, overrides))


def maxtext_base_defaults() -> dict[str, Any]:
  """MaxText's own base.yml, resolved with no plugin layers, as JSON-able values (for `maxtext-moe config`)."""
  argv = ["", str(maxtext_configs_dir() / "base.yml"), "log_config=false", "base_output_directory=/maxtext_output"]
  return _initialize(argv, types.MaxTextConfig).model_dump(mode="json")
