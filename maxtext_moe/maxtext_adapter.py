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
- `maxtext.layers.moe.RoutedMoE.sparse_matmul`: replaced by our dropless block when moe_impl=dropless.
  Routing (`get_topk`), the load-balance loss and the aux-loss-free bias update stay MaxText's own.
- `maxtext.trainers.pre_train.train.loss_fn`: wrapped to send the block's per-step stats to the host.
- `maxtext.trainers.pre_train.train.warmup_programs`: wrapped so its warm-up steps' stats are discarded.
- `maxtext.models.models.transformer_as_linen` + `maxtext.utils.maxtext_utils.get_abstract_param`: the
  model's parameter tree (paths, shapes, logical axes) that checkpoint conversion fills.
- `maxtext.utils.maxtext_utils.calculate_tflops_training_per_device`: MaxText's own FLOPs count (planner).
- `maxtext.trainers.pre_train.train_compile` (+ `sharding` helpers, `get_functional_train_with_signature`,
  `train.train_step`): compiles the train step ahead of time, as `train_compile.py` does, so the planner's
  estimates can be checked against XLA's `memory_analysis()`.
- `maxtext.common.checkpointing.load_params_from_path`: loads a converted checkpoint exactly as
  `load_parameters_path` does in training (conversion tests and the logits check).
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

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import omegaconf  # noqa: E402
import pydantic  # noqa: E402
from flax import nnx  # noqa: E402
from maxtext.common import metric_logger  # noqa: E402
from maxtext.configs import pyconfig, types  # noqa: E402
from maxtext.layers import moe as mt_moe  # noqa: E402
from maxtext.utils import globals as mt_globals  # noqa: E402
from maxtext.utils import max_utils, maxtext_utils  # noqa: E402
from pydantic import model_validator  # noqa: E402

from maxtext_moe.config import checks, offload  # noqa: E402
from maxtext_moe.config.keys import MoEImpl, PluginKeys  # noqa: E402
from maxtext_moe.errors import UserError  # noqa: E402
from maxtext_moe.launch import moe_stats  # noqa: E402
from maxtext_moe.moe.block import MoESettings, moe_block  # noqa: E402

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
  ("maxtext.trainers.pre_train.train", "loss_fn", ("model", "config", "data", "dropout_rng", "params", "is_train")),
  ("maxtext.trainers.pre_train.train", "warmup_programs", ("programs", "state")),
  ("maxtext.models.models", "transformer_as_linen", ("config", "mesh", "quant", "model_mode")),
  ("maxtext.utils.maxtext_utils", "get_abstract_param", ("model", "config")),
  (
    "maxtext.common.checkpointing",
    "load_params_from_path",
    ("load_parameters_from_path", "abstract_unboxed_params", "checkpoint_storage_concurrent_gb"),
  ),
  (
    "maxtext.layers.moe",
    "RoutedMoE.sparse_matmul",
    (
      "self",
      "inputs",
      "gate_logits",
      "pre_bias_logits",
      "w0_kernel",
      "w1_kernel",
      "wo_kernel",
      "w0_bias",
      "w1_bias",
      "wo_bias",
      "input_ids",
      "forced_routed_experts",
    ),
  ),
  (
    "maxtext.layers.moe",
    "RoutedMoE.get_topk",
    ("self", "gate_logits", "pre_bias_logits", "rngs", "input_ids", "forced_routed_experts"),
  ),
  ("maxtext.layers.moe", "RoutedMoE.load_balance_loss", ("self", "top_k_indices", "logits")),
  ("maxtext.layers.moe", "RoutedMoE.should_update_load_balance", ("self",)),
  ("maxtext.layers.moe", "calculate_load_balance_updates", ("top_k_indices", "num_experts", "rate")),
  ("maxtext.layers.moe", "calculate_expert_counts", ("top_k_indices", "num_experts")),
  ("maxtext.layers.moe", "uses_megatron_seq_aux_loss", ("config",)),
  ("maxtext.utils.maxtext_utils", "collect_intermediates_by_suffix", ("intermediate_outputs",)),
  ("maxtext.utils.globals", "MAXTEXT_PKG_DIR", ()),
  ("maxtext.utils.maxtext_utils", "calculate_tflops_training_per_device", ("config", "log")),
  ("maxtext.utils.maxtext_utils", "get_mesh_from_config", ("config",)),
  ("maxtext.trainers.pre_train.train_compile", "get_shaped_inputs", ("topology_mesh", "config")),
  (
    "maxtext.trainers.pre_train.train_compile",
    "jit_and_compile",
    (
      "func",
      "func_input_args",
      "func_input_kwargs",
      "mesh",
      "in_shardings",
      "out_shardings",
      "static_argnums",
      "donate_argnums",
      "config",
      "logical_axis_rules",
    ),
  ),
  ("maxtext.utils.sharding", "maybe_update_params_sharding_with_opt", ("config", "state_mesh_shardings")),
  (
    "maxtext.utils.sharding",
    "build_zero1_input_state_mesh_shardings",
    ("config", "state_mesh_shardings", "params_shardings"),
  ),
  ("maxtext.utils.sharding", "get_input_data_sharding", ("config", "mesh")),
  (
    "maxtext.utils.maxtext_utils",
    "get_functional_train_with_signature",
    ("train_step", "data_sharding", "state_mesh_shardings", "model", "config", "params_shardings"),
  ),
  ("maxtext.trainers.pre_train.train", "train_step", ()),
)

# A one-device layout, for work that only traces shapes (checkpoint conversion, the planner's parameter tree).
ONE_DEVICE_OVERRIDES = [
  *(f"ici_{a}_parallelism=1" for a in ("fsdp", "expert", "tensor", "sequence", "pipeline", "context")),
  "ici_data_parallelism=-1",
  *(f"dcn_{a}_parallelism=1" for a in ("data", "fsdp", "expert", "pipeline")),
  "num_slices=1",
  "recipe_num_devices=-1",
  "hardware=cpu",
]

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
  ctx = contextlib.nullcontext() if join_cluster else _no_distributed_init()
  try:
    with ctx:
      cfg = pyconfig._initialize_pydantic(["", str(config_path), *overrides], config_class=MoEMaxTextConfig)  # pylint: disable=protected-access
      preset = offload.preset_overrides(cfg.offload)
      if preset and not set(preset) <= set(overrides):  # a preset sets MaxText's keys; the user's still win
        argv = ["", str(config_path), *preset, *overrides]
        cfg = pyconfig._initialize_pydantic(argv, config_class=MoEMaxTextConfig)  # pylint: disable=protected-access
      return cfg
  except UserError:
    raise
  except (pydantic.ValidationError, ValueError, TypeError, KeyError, omegaconf.errors.OmegaConfBaseException) as e:
    raise UserError(_one_line(e)) from e


def resolved(config_path: str, overrides: list[str]) -> Any:
  """MaxText's HyperParameters for a recipe + overrides (what the trainer sees)."""
  return pyconfig.HyperParameters(resolve(config_path, overrides))


def maxtext_base_defaults() -> dict[str, Any]:
  """MaxText's own base.yml, resolved with no plugin layers (for `maxtext-moe config` diffs)."""
  with _no_distributed_init():
    cfg = pyconfig._initialize_pydantic(  # pylint: disable=protected-access
      ["", str(MAXTEXT_CONFIGS_DIR / "base.yml"), "log_config=false", "base_output_directory=/maxtext_output"],
      config_class=types.MaxTextConfig,
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
      scalars = {k: float(v) for k, v in metrics["scalar"].items()}
      scalars.update(moe_stats.pop_step(self.config))
      self._moe_sink(int(step), scalars)

  cls.__init__ = __init__
  cls.write_metrics = write_metrics


def run_trainer(config_path: str, overrides: list[str], *, on_start: StartHook) -> None:
  """Runs MaxText's pre-training loop in this process with the plugin installed."""
  from absl import flags  # pylint: disable=import-outside-toplevel
  from maxtext.trainers.pre_train import train  # pylint: disable=import-outside-toplevel

  _install_config_class()
  _install_metric_hook(on_start)
  install_moe_patch()
  _install_stats_hooks()
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


# --- the dropless MoE block at the sparse_matmul seam -------------------------------------------


def _routing_aux(layer: Any, gate_logits: jax.Array, pre_bias_logits: jax.Array, top_k_indices: jax.Array):
  """Load-balance loss and aux-loss-free bias update, computed as MaxText's dense_matmul does."""
  cfg = layer.config
  lb_loss = None
  if cfg.model_call_mode != "inference" and not layer.is_hash_routing and cfg.load_balance_loss_weight > 0.0:
    if mt_moe.uses_megatron_seq_aux_loss(cfg):
      lb_loss = layer.megatron_seq_aux_loss(pre_bias_logits if pre_bias_logits is not None else gate_logits)
    else:
      probs = jax.nn.softmax(gate_logits.astype(jnp.float32), axis=-1).astype(layer.dtype)
      lb_loss = layer.load_balance_loss(top_k_indices, probs)
  bias_updates = None
  if layer.should_update_load_balance():
    if getattr(cfg, "gradient_accumulation_steps", 1) > 1:
      bias_updates = mt_moe.calculate_expert_counts(top_k_indices, cfg.num_experts, axis_names=None)
    else:
      bias_updates = mt_moe.calculate_load_balance_updates(
        top_k_indices, cfg.num_experts, cfg.routed_bias_update_rate, axis_names=None
      )
  return lb_loss, bias_updates


def settings_from_config(cfg: Any) -> MoESettings:
  return MoESettings(
    dispatch=cfg.moe_dispatch,
    gemm=cfg.moe_gemm_backend,
    capacity_factor=float(cfg.moe_capacity_factor),
    activation=cfg.mlp_activations[0],
  )


def _dropless_sparse_matmul(
  self,
  inputs,
  gate_logits,
  pre_bias_logits,
  w0_kernel,
  w1_kernel,
  wo_kernel,
  w0_bias,
  w1_bias,
  wo_bias,
  input_ids=None,
  forced_routed_experts=None,
):
  """Drop-in for RoutedMoE.sparse_matmul: MaxText routing, then our dispatch -> grouped GEMM -> combine."""
  cfg = self.config
  if str(getattr(cfg, "moe_impl", MoEImpl.MAXTEXT)) != MoEImpl.DROPLESS:
    return mt_moe.RoutedMoE._moe_orig_sparse_matmul(  # pylint: disable=protected-access
      self,
      inputs,
      gate_logits,
      pre_bias_logits,
      w0_kernel,
      w1_kernel,
      wo_kernel,
      w0_bias,
      w1_bias,
      wo_bias,
      input_ids=input_ids,
      forced_routed_experts=forced_routed_experts,
    )
  if any(b is not None for b in (w0_bias, w1_bias, wo_bias)):
    raise ValueError("moe_impl=dropless does not support MLP biases; set moe_impl=maxtext")
  weights, ids = self.get_topk(
    gate_logits, pre_bias_logits, self.rngs, input_ids=input_ids, forced_routed_experts=forced_routed_experts
  )
  lb_loss, bias_updates = _routing_aux(self, gate_logits, pre_bias_logits, ids)
  b, s, d = inputs.shape
  k = ids.shape[-1]
  ep = self.mesh.shape.get("expert", 1)
  y, stats = moe_block(
    inputs.reshape(b * s, d),
    ids.reshape(b * s, k).astype(jnp.int32),
    weights.reshape(b * s, k).astype(inputs.dtype),
    w0_kernel.astype(inputs.dtype),
    w1_kernel.astype(inputs.dtype),
    wo_kernel.astype(inputs.dtype),
    mesh=self.mesh,
    expert_axis="expert" if ep > 1 else None,
    settings=settings_from_config(cfg),
  )
  self.sow(nnx.Intermediate, moe_stats.INTERMEDIATE, moe_stats.pack(stats, itemsize=inputs.dtype.itemsize, dim=d))
  return y.reshape(b, s, d), lb_loss, bias_updates


def install_moe_patch() -> None:
  """Replaces RoutedMoE.sparse_matmul (idempotent). Non-dropless configs still reach MaxText's original."""
  cls = mt_moe.RoutedMoE
  if not hasattr(cls, "_moe_orig_sparse_matmul"):
    cls._moe_orig_sparse_matmul = cls.sparse_matmul
  cls.sparse_matmul = _dropless_sparse_matmul


def _install_stats_hooks() -> None:
  """loss_fn sends the block's per-step stats to the host; warm-up steps' stats are dropped."""
  from maxtext.trainers.pre_train import train  # pylint: disable=import-outside-toplevel

  loss_fn, warmup = getattr(train, "_moe_orig", (train.loss_fn, train.warmup_programs))
  train._moe_orig = (loss_fn, warmup)

  def wrapped_loss_fn(model, config, data, dropout_rng, params, sparsity_state=None, is_train=True):
    loss, aux = loss_fn(model, config, data, dropout_rng, params, sparsity_state=sparsity_state, is_train=is_train)
    if is_train:
      found = maxtext_utils.collect_intermediates_by_suffix(aux["intermediate_outputs"], moe_stats.INTERMEDIATE)
      if found:
        jax.debug.callback(moe_stats.push, moe_stats.reduce_layers(found))
    return loss, aux

  def wrapped_warmup(*args, **kwargs):
    out = warmup(*args, **kwargs)
    moe_stats.clear()
    return out

  train.loss_fn = wrapped_loss_fn
  train.warmup_programs = wrapped_warmup


# --- a standalone MaxText MoE layer, for benchmarks ------------------------------------------------


def routed_moe_loss_and_grad(config_path: str, overrides: list[str]):
  """Builds MaxText's RoutedMoE from a resolved config; returns (fwd, fwd_bwd, params, x, run_ctx).

  `fwd(params, x)` returns the layer output; `fwd_bwd(params, x)` returns grads of sum(y^2) for the layer's
  parameters and x (both jitted). Both must be called inside `run_ctx()` (MaxText's mesh and logical axis rules).
  """
  from flax.core.spmd import logical_axis_rules  # pylint: disable=import-outside-toplevel
  from maxtext.layers import initializers  # pylint: disable=import-outside-toplevel

  install_moe_patch()
  cfg = resolved(config_path, overrides)
  mesh = maxtext_utils.get_mesh_from_config(cfg)

  def run_ctx():
    stack = contextlib.ExitStack()
    stack.enter_context(jax.set_mesh(mesh))
    stack.enter_context(logical_axis_rules(cfg.logical_axis_rules))
    return stack

  with run_ctx():
    layer = mt_moe.RoutedMoE(
      config=cfg,
      num_experts=cfg.num_experts,
      num_experts_per_tok=cfg.num_experts_per_tok,
      mesh=mesh,
      kernel_init=initializers.nd_dense_init(1.0, "fan_in", "truncated_normal"),
      kernel_axes=("embed", None),
      intermediate_dim=cfg.moe_mlp_dim,
      dtype=cfg.dtype,
      weight_dtype=cfg.weight_dtype,
      rngs=nnx.Rngs(0),
    )
  graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
  batch = int(cfg.per_device_batch_size) * jax.device_count()
  x = jax.random.normal(jax.random.PRNGKey(1), (batch, cfg.max_target_length, cfg.emb_dim), cfg.dtype)

  def apply(params, x):
    return nnx.merge(graphdef, params, rest)(x)[0]

  def loss(state, x):
    return jnp.sum(apply(state, x).astype(jnp.float32) ** 2)

  return jax.jit(apply), jax.jit(jax.grad(loss, argnums=(0, 1))), params, x, run_ctx


# --- the model's parameter tree, for checkpoint conversion ------------------------------------------


def _linen_model(cfg: Any):
  from maxtext.models import models  # pylint: disable=import-outside-toplevel

  mesh = maxtext_utils.get_mesh_from_config(cfg)
  return models.transformer_as_linen(cfg, mesh, quant=None, model_mode="train"), mesh


def abstract_params(config_path: str, overrides: list[str]) -> tuple[Any, list[tuple[tuple[str, ...], tuple, tuple]]]:
  """(config, [(collection-qualified path, shape, logical axis names)]) of the model's parameters, from
  `jax.eval_shape` of MaxText's own init: nothing is allocated."""
  cfg = resolved(config_path, overrides)
  return cfg, param_leaves(cfg)


def param_leaves(cfg: Any) -> list[tuple[tuple[str, ...], tuple, tuple]]:
  """[(collection-qualified path, shape, logical axis names)] of a resolved config's model parameters."""
  import flax.linen as nn  # pylint: disable=import-outside-toplevel

  model, _ = _linen_model(cfg)
  tree = maxtext_utils.get_abstract_param(model, cfg)
  leaves = []
  flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))[0]
  for path, leaf in flat:
    value = leaf.value if isinstance(leaf, nn.LogicallyPartitioned) else leaf
    names = tuple(leaf.names) if isinstance(leaf, nn.LogicallyPartitioned) else (None,) * len(value.shape)
    leaves.append((tuple(str(getattr(k, "key", k)) for k in path), tuple(value.shape), names))
  return leaves


def load_and_forward(config_path: str, overrides: list[str], params_path: str, tokens: Any) -> Any:
  """Loads `params_path` with MaxText's `load_params_from_path` (what `load_parameters_path` runs) and
  returns the model's logits for `tokens` [B, S] (positions 0..S-1), with our MoE patch installed."""
  import flax.linen as nn  # pylint: disable=import-outside-toplevel
  from flax.core.spmd import logical_axis_rules  # pylint: disable=import-outside-toplevel
  from maxtext.common import checkpointing  # pylint: disable=import-outside-toplevel

  install_moe_patch()
  cfg = resolved(config_path, overrides)
  model, mesh = _linen_model(cfg)
  replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  abstract = jax.tree.map(
    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated),
    nn.unbox(maxtext_utils.get_abstract_param(model, cfg)),
  )
  params = checkpointing.load_params_from_path(params_path, abstract, cfg.checkpoint_storage_concurrent_gb)
  tokens = jnp.asarray(tokens, jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
  with jax.set_mesh(mesh), logical_axis_rules(cfg.logical_axis_rules):
    out = model.apply(
      params, tokens, positions, decoder_segment_ids=jnp.ones_like(tokens), enable_dropout=False, mutable=True
    )
  return out[0] if isinstance(out, tuple) else out


# --- the memory planner: FLOPs from MaxText, and XLA's own memory figures to check it against ---------------


def train_tflops_per_device(cfg: Any) -> tuple[float, float, float]:
  """(total, learnable-weight, attention) TFLOPs of one training step per device, MaxText's own count."""
  total, weights, attention = maxtext_utils.calculate_tflops_training_per_device(cfg, log=False)
  return float(total), float(weights), float(attention)


def compiled_train_memory(config_path: str, overrides: list[str]) -> dict[str, int]:
  """Compiles MaxText's train step for the visible devices, as `train_compile.py` does for a topology, and
  returns XLA's `memory_analysis()` per device: argument/output/alias/temp bytes, on device and host."""
  from flax.linen import partitioning as nn_partitioning  # pylint: disable=import-outside-toplevel
  from maxtext.trainers.pre_train import train, train_compile  # pylint: disable=import-outside-toplevel
  from maxtext.utils import sharding  # pylint: disable=import-outside-toplevel

  install_moe_patch()
  cfg = resolved(config_path, overrides)
  mesh = maxtext_utils.get_mesh_from_config(cfg)
  args, kwargs, state_shardings, _, model = train_compile.get_shaped_inputs(mesh, cfg)
  params_shardings, state_shardings = sharding.maybe_update_params_sharding_with_opt(cfg, state_shardings)
  input_shardings = sharding.build_zero1_input_state_mesh_shardings(cfg, state_shardings, params_shardings)
  data_sharding = sharding.get_input_data_sharding(cfg, mesh)
  func, in_sh, out_sh, static, donate = maxtext_utils.get_functional_train_with_signature(
    train.train_step, data_sharding, input_shardings, model, cfg, params_shardings
  )
  rules = nn_partitioning.axis_rules(cfg.logical_axis_rules)
  compiled = train_compile.jit_and_compile(func, args, kwargs, mesh, in_sh, out_sh, static, donate, cfg, rules)
  mem = compiled.memory_analysis()
  names = ("argument", "output", "alias", "temp")
  out = {f"{n}_bytes": int(getattr(mem, f"{n}_size_in_bytes")) for n in names}
  out.update({f"host_{n}_bytes": int(getattr(mem, f"host_{n}_size_in_bytes")) for n in names})
  return out
