"""The only module that touches MaxText internals.

Everything maxtext-moe needs from MaxText goes through here, so an upstream change breaks in one
place. `UPSTREAM_SYMBOLS` lists each symbol we call or patch with the parameters we rely on;
`tests/test_upstream_contract.py` fails when one of them moves or changes its signature.

What we touch (maxtext 0.2.5):
- `maxtext.configs.types.MaxTextConfig`: subclassed to add our keys (`config.keys.PluginKeys`).
- `maxtext.configs.pyconfig.initialize`: the trainer calls it without a `config_class`, so we wrap it.
- `maxtext.configs.pyconfig._initialize_pydantic`: resolves a config without MaxText's exit-on-error.
- `maxtext.utils.max_utils.maybe_initialize_jax_distributed_system`: skipped while only printing a config.
- `maxtext.common.metric_logger.MetricLogger`: `__init__` and `write_metrics` feed our per-step sink.
- `maxtext.trainers.pre_train.train.main`: the trainer entry point.
"""

import contextlib
import functools
import inspect
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

os.environ.setdefault("DECOUPLE_GCLOUD", "TRUE")  # MaxText: no Google Cloud dependencies.

import omegaconf  # noqa: E402
import pydantic  # noqa: E402
from maxtext.common import metric_logger  # noqa: E402
from maxtext.configs import pyconfig, types  # noqa: E402
from maxtext.utils import globals as mt_globals  # noqa: E402
from maxtext.utils import max_utils  # noqa: E402
from pydantic import model_validator  # noqa: E402

from maxtext_moe.config import checks  # noqa: E402
from maxtext_moe.config.keys import PluginKeys  # noqa: E402
from maxtext_moe.errors import UserError  # noqa: E402

# Model names we add to MaxText's closed `model_name` Literal. They start with "deepseek3" because
# MaxText keys DeepSeek-V3 routing (sigmoid + bias, group-limited top-k) on that prefix.
PLUGIN_MODEL_NAMES = ("deepseek3-proxy-16b",)

# (module, attribute, parameters we pass or rely on). Checked by tests/test_upstream_contract.py.
UPSTREAM_SYMBOLS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("maxtext.configs.pyconfig", "initialize", ("argv", "config_class")),
    ("maxtext.configs.pyconfig", "_initialize_pydantic", ("argv", "config_class")),
    ("maxtext.configs.pyconfig", "HyperParameters", ("pydantic_config",)),
    ("maxtext.configs.types", "MaxTextConfig", ()),
    ("maxtext.utils.max_utils", "maybe_initialize_jax_distributed_system", ("raw_keys",)),
    ("maxtext.common.metric_logger", "MetricLogger.__init__", ("self", "config", "learning_rate_schedule", "start_step")),
    ("maxtext.common.metric_logger", "MetricLogger.write_metrics", ("self", "metrics", "step", "metric_type")),
    ("maxtext.trainers.pre_train.train", "main", ("argv",)),
    ("maxtext.utils.globals", "MAXTEXT_PKG_DIR", ()),
)

MAXTEXT_CONFIGS_DIR = Path(mt_globals.MAXTEXT_CONFIGS_DIR)
# maxtext 0.2.5's MAXTEXT_ASSETS_ROOT points at <pkg>/src/maxtext/assets for a pip install, which does
# not exist; the assets really sit next to the package's modules.
MAXTEXT_ASSETS_DIR = Path(mt_globals.MAXTEXT_PKG_DIR) / "assets"


def _asset_path(rel: str) -> str:
  path = MAXTEXT_ASSETS_DIR / rel
  if not path.exists():
    raise UserError(f"maxtext asset '{rel}' not found under {MAXTEXT_ASSETS_DIR}")
  return str(path)


def _configs_path(rel: str) -> str:
  return str(MAXTEXT_CONFIGS_DIR / rel)


def _corpus_path(name: str) -> str:
  from maxtext_moe.data import corpus  # pylint: disable=import-outside-toplevel

  return str(corpus.corpus_path(name))


def _register_resolvers() -> None:
  """YAML-side helpers, resolved when MaxText loads a config:

  - `${maxtext_configs:base.yml}`: a file in the installed maxtext's configs folder;
  - `${maxtext_assets:tokenizers/tokenizer.llama2}`: a file in its assets;
  - `${moe_corpus:python_stdlib}`: an offline corpus parquet, built and cached on first use.
  """
  for name, fn in (("maxtext_configs", _configs_path), ("maxtext_assets", _asset_path), ("moe_corpus", _corpus_path)):
    if not omegaconf.OmegaConf.has_resolver(name):
      omegaconf.OmegaConf.register_resolver(name, fn, use_cache=True)


_register_resolvers()


class MoEMaxTextConfig(PluginKeys, types.MaxTextConfig):
  """MaxText's config plus the plugin's keys and cross-field checks. Unknown keys stay errors."""

  model_name: types.ModelName | Literal[PLUGIN_MODEL_NAMES] = pydantic.Field(  # type: ignore[valid-type]
      "default", description="The name of the model configuration to use."
  )

  @model_validator(mode="after")
  def _plugin_checks(self) -> "MoEMaxTextConfig":
    for check in checks.ALL_CHECKS:
      check(self)
    return self


# --- config resolution -------------------------------------------------------------------------

_UNKNOWN_KEY = re.compile(r"^'([^']+)' not in ")


def _one_line(err: Exception) -> str:
  """Turns MaxText's and pydantic's multi-line config errors into one actionable line."""
  if isinstance(err, pydantic.ValidationError):
    e = err.errors()[0]
    loc = ".".join(str(p) for p in e["loc"]) or "config"
    msg = e["msg"].removeprefix("Value error, ")
    if e["type"] in ("value_error", "assertion_error"):
      return msg
    return f"bad value for '{loc}': {msg} (got {e.get('input')!r})"
  text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
  m = _UNKNOWN_KEY.match(text)
  if m:
    import difflib  # pylint: disable=import-outside-toplevel

    near = difflib.get_close_matches(m.group(1), MoEMaxTextConfig.model_fields, n=1)
    hint = f"; did you mean '{near[0]}'?" if near else "; run 'maxtext-moe config --keys' for the plugin's keys"
    return f"unknown config key '{m.group(1)}'{hint}"
  return text


@contextlib.contextmanager
def _no_distributed_init() -> Iterator[None]:
  """Resolving a config must not try to join a cluster (MaxText does so inside config parsing)."""
  saved = max_utils.maybe_initialize_jax_distributed_system
  max_utils.maybe_initialize_jax_distributed_system = lambda raw_keys: None
  try:
    yield
  finally:
    max_utils.maybe_initialize_jax_distributed_system = saved


def resolve(config_path: str, overrides: list[str], *, join_cluster: bool = False) -> MoEMaxTextConfig:
  """Resolves `config_path` + `key=value` overrides the MaxText way, with our keys and checks.

  Raises:
    UserError: one line describing a bad key, value or layout.
  """
  argv = ["", str(config_path), *overrides]
  ctx = contextlib.nullcontext() if join_cluster else _no_distributed_init()
  try:
    with ctx:
      return pyconfig._initialize_pydantic(argv, config_class=MoEMaxTextConfig)  # pylint: disable=protected-access
  except UserError:
    raise
  except (pydantic.ValidationError, ValueError, TypeError, KeyError, omegaconf.errors.OmegaConfBaseException) as e:
    raise UserError(_one_line(e)) from e


def maxtext_base_defaults() -> dict[str, Any]:
  """MaxText's own base.yml, resolved with no plugin layers (for `maxtext-moe config` diffs)."""
  with _no_distributed_init():
    cfg = pyconfig._initialize_pydantic(  # pylint: disable=protected-access
        ["", str(MAXTEXT_CONFIGS_DIR / "base.yml"), "log_config=false", "base_output_directory=/maxtext_output"], config_class=types.MaxTextConfig
    )
  return cfg.model_dump()


# --- launching ---------------------------------------------------------------------------------

StepSink = Callable[[int, dict[str, float]], None]
StartHook = Callable[[Any, int], StepSink]


def _install_config_class() -> None:
  if getattr(pyconfig.initialize, "_maxtext_moe", False):
    return
  original = pyconfig.initialize

  @functools.wraps(original)
  def initialize(argv=None, config_class=MoEMaxTextConfig, **kwargs):
    return original(argv, config_class=config_class, **kwargs)

  initialize._maxtext_moe = True  # type: ignore[attr-defined]
  pyconfig.initialize = initialize


def _install_metric_hook(on_start: StartHook) -> None:
  """Routes each training step's scalar metrics to the sink that `on_start(config, start_step)` returns."""
  cls = metric_logger.MetricLogger
  init, write = getattr(cls, "_moe_orig", (cls.__init__, cls.write_metrics))
  cls._moe_orig = (init, write)

  def __init__(self, config, learning_rate_schedule, start_step=0):
    init(self, config, learning_rate_schedule, start_step)
    self._moe_sink = on_start(config, start_step)

  def write_metrics(self, metrics, step, metric_type="train"):
    write(self, metrics, step, metric_type)
    if metric_type == "train" and metrics and getattr(self, "_moe_sink", None):
      self._moe_sink(int(step), {k: float(v) for k, v in metrics["scalar"].items()})

  cls.__init__ = __init__
  cls.write_metrics = write_metrics


def run_trainer(config_path: str, overrides: list[str], *, on_start: StartHook) -> None:
  """Runs MaxText's pre-training loop in this process with the plugin installed."""
  from absl import flags  # pylint: disable=import-outside-toplevel
  from maxtext.trainers.pre_train import train  # pylint: disable=import-outside-toplevel

  _install_config_class()
  _install_metric_hook(on_start)
  if not flags.FLAGS.is_parsed():
    flags.FLAGS.mark_as_parsed()
  train.main(["", str(config_path), *overrides])


def upstream_signature(module: str, attr: str) -> inspect.Signature | None:
  """Signature of an upstream symbol (None for non-callables). Used by the contract test."""
  import importlib  # pylint: disable=import-outside-toplevel

  obj: Any = importlib.import_module(module)
  for part in attr.split("."):
    obj = getattr(obj, part)
  return inspect.signature(obj) if callable(obj) else None
