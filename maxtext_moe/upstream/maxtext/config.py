"""MaxText's config machinery, as the resolution pipeline (`upstream/resolution.py`) calls it: leaves that
take plain values and call back into nothing of ours above them.

- `install_resolvers`: the `${...}` helpers our YAML files use, registered with OmegaConf.
- `load_layers`: a config file's `base_config` chain merged by MaxText's own loader (OmegaConf only: no
  pydantic, no JAX backend).
- `refuse_derived`, `dump_flags`: MaxText's derived keys refused as overrides; its HLO-dump flags.
- `initialize`: MaxText's one resolution into a pydantic config class, its errors as one line (`one_line`).
- `hyperparameters`, `maxtext_base_defaults`: MaxText's read-only view; its own base.yml resolved.
"""

import difflib
import logging
import re
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import omegaconf
import pydantic
import yaml
from maxtext.configs import pyconfig, types
from maxtext.utils import globals as mt_globals
from maxtext.utils import max_utils

from maxtext_moe.data import arithmetic, corpus
from maxtext_moe.errors import UserError
from maxtext_moe.upstream.patches import Patch, installed

MaxTextConfig = types.MaxTextConfig
ModelName = types.ModelName
# MaxText's derived keys that a user sets by mistake (MaxText overwrites them), with the key to set instead.
_BASE_OF = {k: f"base_{k}" for k in ("emb_dim", "mlp_dim", "moe_mlp_dim", "num_decoder_layers", "num_query_heads")}
_BASE_OF["num_kv_heads"] = "base_num_kv_heads"


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


def install_resolvers(ours: Path) -> None:
  """YAML-side helpers (idempotent): `${maxtext_configs:base.yml}` (in the installed maxtext's configs),
  `${moe_configs:base.yml}` (in ours, `ours`), `${maxtext_assets:tokenizers/tokenizer.llama2}` (in its
  assets), `${moe_corpus:python_stdlib}` (an offline corpus parquet) and `${moe_sft_example:train|eval|
  tokenizer}` (the SFT example's files), both built and cached on first use."""
  resolvers = {
    "maxtext_configs": lambda rel: str(maxtext_configs_dir() / rel),
    "moe_configs": lambda rel: str(ours / rel),
    "maxtext_assets": _asset_path,
    "moe_corpus": lambda name: str(corpus.corpus_path(name)),
    "moe_sft_example": lambda part: arithmetic.example_path(part),
  }
  for name, fn in resolvers.items():
    if not omegaconf.OmegaConf.has_resolver(name):
      omegaconf.OmegaConf.register_resolver(name, fn, use_cache=True)


def names_beyond(models: Iterable[Path]) -> tuple[str, ...]:
  """The model files' names that MaxText's closed `model_name` Literal lacks."""
  known = set(typing.get_args(types.ModelName))
  return tuple(sorted(p.stem for p in models if p.stem not in known))


def load_layers(config_path: str | Path) -> omegaconf.DictConfig:
  """The file's `base_config` chain merged by MaxText's loader."""
  return pyconfig._load_config(str(config_path))  # pylint: disable=protected-access


def refuse_derived(overrides: list[str]) -> None:
  """A key MaxText derives (emb_dim from base_emb_dim and global_parameter_scale, ...) would be silently
  overwritten: say which key to set instead."""
  derived = types.DerivedValues.model_fields
  for item in overrides:
    key = item.partition("=")[0]
    if key in derived:
      hint = f"set {_BASE_OF[key]} instead" if key in _BASE_OF else "it cannot be set"
      raise UserError(f"{key} is derived by MaxText from other keys and would be ignored; {hint}")


def dump_flags(raw: dict[str, Any]) -> list[str]:
  """MaxText's own dump_hlo flags (validate_and_set_hlo_dump_defaults), which it sets only when XLA_FLAGS
  is empty: with a flag profile (every GPU recipe) dump_hlo=true would silently dump nothing."""
  flags = [f"--xla_dump_to={raw['dump_hlo_local_dir'] or '/tmp/xla_dump/'}", "--xla_dump_large_constants"]
  module = raw.get("dump_hlo_local_module_name")
  return flags + ([f"--xla_dump_hlo_module_re={module}"] if module else [])


_UNKNOWN_KEY = re.compile(r"^'([^']+)' not in ")


def one_line(err: Exception, known: Iterable[str]) -> str:
  """Turns MaxText's and pydantic's multi-line config errors into one actionable line (`known`: the keys
  a misspelt one is matched against)."""
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
    near = difflib.get_close_matches(m.group(1), list(known), n=1)
    hint = f"; did you mean '{near[0]}'?" if near else "; run 'maxtext-moe config --keys' for the plugin's keys"
    return f"unknown config key '{m.group(1)}'{hint}"
  return text


def _no_distributed_init(raw_keys: Any) -> None:
  """Resolving a config must not try to join a cluster (MaxText does so inside config parsing): the
  launcher joins one itself, before resolving."""
  del raw_keys


_RESOLVING = [Patch(max_utils, "maybe_initialize_jax_distributed_system", _no_distributed_init)]


class _UnknownKeyNotice(logging.Filter):
  """Drops MaxText's WARNING for an unknown key (`pyconfig._prepare_for_pydantic` logs it, then raises the
  error `one_line` turns into ours), so a user sees our one line alone; its other records pass."""

  def filter(self, record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Ignoring invalid/unsupported field")


_PYCONFIG_LOG = logging.getLogger("maxtext.configs.pyconfig")  # its `logging.getLogger(__name__)`


def initialize(argv: list[str], config_class: type, known: Iterable[str]) -> Any:
  """MaxText's resolution of `argv` into `config_class`, without its exit-on-error wrapper; errors become
  one-line UserErrors (a misspelt key matched against `known`)."""
  notice = _UnknownKeyNotice()
  _PYCONFIG_LOG.addFilter(notice)
  try:
    with installed(_RESOLVING):
      return pyconfig._initialize_pydantic(argv, config_class=config_class)  # pylint: disable=protected-access
  except UserError:
    raise
  except AssertionError as e:  # MaxText validates some keys with assert
    raise UserError(f"MaxText refuses this config: {str(e).strip() or 'an assertion failed'}") from None
  except (pydantic.ValidationError, ValueError, TypeError, KeyError, omegaconf.errors.OmegaConfBaseException) as e:
    raise UserError(one_line(e, known)) from e
  finally:
    _PYCONFIG_LOG.removeFilter(notice)


def hyperparameters(cfg: Any) -> Any:
  """MaxText's read-only `HyperParameters` view of a resolved config (what its trainer and layers take)."""
  return pyconfig.HyperParameters(cfg)


def maxtext_base_defaults(known: Iterable[str]) -> dict[str, Any]:
  """MaxText's own base.yml, resolved with no plugin layers, as JSON-able values (for `maxtext-moe config`)."""
  argv = ["", str(maxtext_configs_dir() / "base.yml"), "log_config=false", "base_output_directory=/maxtext_output"]
  return initialize(argv, types.MaxTextConfig, known).model_dump(mode="json")
