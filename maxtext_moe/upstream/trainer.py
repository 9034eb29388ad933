"""The trainer hook: run MaxText's own pre-training loop on a config we resolved, and see its steps.

For one run, `run_trainer` installs (and afterwards removes):
- `pyconfig.initialize` -> the run's resolved config, so MaxText's trainer does not parse it again;
- `RoutedMoE.sparse_matmul` -> our dropless block (`upstream.moe_layer`);
- `train.loss_fn` -> also sends the block's per-step stats to the run's `StatsChannel` (jax.debug.callback);
- `train.warmup_programs` -> also discards the stats of its warm-up steps;
- `MetricLogger.__init__` / `write_metrics` -> `hooks.start(config, start_step)` once the checkpoint (if
  any) is restored, then `hooks.step(step, scalars)` with MaxText's scalars and the step's `moe/*` ones.
"""

from dataclasses import dataclass, field
from typing import Any, Protocol

import jax
from absl import flags as absl_flags
from maxtext.common import metric_logger
from maxtext.configs import pyconfig
from maxtext.trainers.pre_train import train
from maxtext.utils import maxtext_utils

from maxtext_moe.moe import stats as moe_stats
from maxtext_moe.upstream import moe_layer, te
from maxtext_moe.upstream.config import MoEMaxTextConfig, hyperparameters
from maxtext_moe.upstream.model import model_patches
from maxtext_moe.upstream.patches import Patch, installed, original


class RunHooks(Protocol):
  """What the launcher's recorder implements."""

  def start(self, config: Any, start_step: int) -> None: ...

  def step(self, step: int, scalars: dict[str, float]) -> None: ...


@dataclass
class _Run:
  """One run's state, owned by `run_trainer` and reached by its patches."""

  config: Any  # MaxText's HyperParameters of the resolved config
  hooks: RunHooks
  channel: moe_stats.StatsChannel = field(default_factory=moe_stats.StatsChannel)

  def moe_metrics(self) -> dict[str, float]:
    cfg = self.config
    entries = self.channel.pop_step(max(int(cfg.gradient_accumulation_steps), 1))
    row_bytes = int(cfg.emb_dim) * cfg.dtype.itemsize
    return moe_stats.step_metrics(
      entries,
      row_bytes=row_bytes,
      capacity_factor=float(cfg.moe_capacity_factor),
      allow_drops=bool(cfg.moe_allow_drops),
    )


def _collect_stats(aux: dict) -> dict[str, jax.Array] | None:
  """The MoE layers' stats from the loss's intermediates, by name ({} when no layer ran our block)."""
  found = {
    name: maxtext_utils.collect_intermediates_by_suffix(
      aux["intermediate_outputs"], moe_stats.INTERMEDIATE_PREFIX + name, ravel=False
    )
    for name in moe_stats.NAMES
  }
  return moe_stats.reduce_layers(found) if all(found.values()) else None


def _patches(run: _Run) -> list[Patch]:
  loss_fn = original(train, "loss_fn")
  warmup = original(train, "warmup_programs")
  logger_init = original(metric_logger.MetricLogger, "__init__")
  write = original(metric_logger.MetricLogger, "write_metrics")

  def initialize(argv=None, config_class=None, **kwargs):
    del argv, config_class, kwargs  # resolved once, by the launcher
    return run.config

  def wrapped_loss_fn(model, config, data, dropout_rng, params, sparsity_state=None, is_train=True):
    loss, aux = loss_fn(model, config, data, dropout_rng, params, sparsity_state=sparsity_state, is_train=is_train)
    stats = _collect_stats(aux) if is_train else None
    if stats is not None:
      jax.debug.callback(run.channel.push, stats)
    return loss, aux

  def wrapped_warmup(*args, **kwargs):
    out = warmup(*args, **kwargs)
    run.channel.clear()
    return out

  def logger_start(self, config, learning_rate_schedule, start_step=0):
    logger_init(self, config, learning_rate_schedule, start_step)
    run.hooks.start(config, start_step)

  def write_metrics(self, metrics, step, metric_type="train"):
    write(self, metrics, step, metric_type)
    if metric_type == "train" and metrics:
      scalars = {k: float(v) for k, v in metrics["scalar"].items()}
      run.hooks.step(int(step), scalars | run.moe_metrics())

  return [
    *model_patches(),
    Patch(pyconfig, "initialize", initialize),
    Patch(train, "loss_fn", wrapped_loss_fn),
    Patch(train, "warmup_programs", wrapped_warmup),
    Patch(metric_logger.MetricLogger, "__init__", logger_start),
    Patch(metric_logger.MetricLogger, "write_metrics", write_metrics),
  ]


def run_trainer(cfg: MoEMaxTextConfig, hooks: RunHooks) -> None:
  """Runs MaxText's pre-training loop in this process on `cfg`, with our block and hooks installed."""
  run = _Run(hyperparameters(cfg), hooks)
  moe_layer.prepare_te_ep(run.config)
  if not absl_flags.FLAGS.is_parsed():
    absl_flags.FLAGS.mark_as_parsed()
  with installed(_patches(run)), te.shard_guard():
    train.main(["", "<config resolved by maxtext-moe>"])
