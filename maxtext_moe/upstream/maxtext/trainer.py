"""The trainer hook: run MaxText's own pre-training loop on a config we resolved, and see its steps.

For one run, `run_trainer` installs (and afterwards removes):
- `pyconfig.initialize` -> the run's resolved config, so MaxText's trainer does not parse it again;
- `RoutedMoE.sparse_matmul` -> our dropless block (`upstream.maxtext.moe_layer`);
- `train.loss_fn` -> also sends the block's per-step stats to the run's `StatsChannel` (jax.debug.callback);
- `train.warmup_programs` -> also discards the stats of its warm-up steps;
- `MetricLogger.__init__` / `write_metrics` -> `hooks.start(config, start_step)` once the checkpoint (if
  any) is restored, then `hooks.step(step, scalars)` with MaxText's scalars and the step's `moe/*` ones
  (added to MaxText's own before it writes them, so TensorBoard has them too), `hooks.layers(step, load,
  bias)` with the step's [L, E] expert load and [L] routing-bias magnitude,
  and `hooks.eval(step, scalars)` with the held-out pass that followed train step `step` (eval_interval);
- `multihost_dataloading._terminate_iterator_workers` -> the same, without its AssertionError on grain
  iterators that have no parent;
- `max_utils.initialize_summary_writer` -> a tensorboardX writer on the run's tensorboard_dir;
- MaxText's checkpoint restore, preemption test and optimizer (`upstream.maxtext.recovery`);
- MaxText's Parquet reader, data loader and loop iteration, for a run its data ends (`upstream.maxtext.data_end`).
- its SFT pipeline's chat-template rendering -> the conversation rendered whole (`upstream.maxtext.sft_data`).
"""

import gc
from dataclasses import dataclass, field
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags as absl_flags
from jax.experimental import io_callback
from maxtext.common import metric_logger
from maxtext.configs import pyconfig
from maxtext.input_pipeline import multihost_dataloading
from maxtext.trainers.pre_train import train
from maxtext.utils import max_utils, maxtext_utils, train_utils

from maxtext_moe.errors import UserError
from maxtext_moe.moe import stats as moe_stats
from maxtext_moe.upstream.maxtext import data_end, moe_layer, recovery, sft_data
from maxtext_moe.upstream.maxtext.config import hyperparameters
from maxtext_moe.upstream.maxtext.model import model_patches
from maxtext_moe.upstream.patches import Method, Patch, installed, original
from maxtext_moe.upstream.pipeline import moe_stages as pipeline
from maxtext_moe.upstream.resolution import MoEMaxTextConfig


class RunHooks(Protocol):
  """What the launcher's recorder implements."""

  def start(self, config: Any, start_step: int) -> None: ...

  def step(self, step: int, scalars: dict[str, float], notes: dict[str, Any] | None = None) -> Any: ...

  def eval(self, step: int, scalars: dict[str, float]) -> None: ...

  def layers(self, step: int, load_LE: np.ndarray, bias_L: np.ndarray) -> None: ...


def _collect_stats(aux: dict) -> dict[str, jax.Array] | None:
  """The MoE layers' stats from the loss's intermediates, by name ({} when no layer ran our block)."""
  found = {
    name: maxtext_utils.collect_intermediates_by_suffix(
      aux["intermediate_outputs"], moe_stats.INTERMEDIATE_PREFIX + name, ravel=False
    )
    for name in moe_stats.NAMES
  }
  return moe_stats.reduce_layers(found) if all(found.values()) else None


@dataclass
class TrainerPatches:
  """One run's state and the MaxText attributes it replaces, as bound methods (`patches`)."""

  config: Any  # MaxText's HyperParameters of the resolved config
  hooks: RunHooks
  rec: recovery.Recovery = field(default_factory=recovery.Recovery)
  channel: moe_stats.StatsChannel = field(default_factory=moe_stats.StatsChannel)
  start_step: int = 0
  train_calls: int = 0  # host-side count of train-step loss evaluations (fault_nan_loss_steps)

  def patches(self) -> list[Patch]:
    return [
      Patch(pyconfig, "initialize", self.initialize),
      Patch(train, "loss_fn", self.loss_fn),
      *pipeline.trainer_patches(),
      Patch(train, "warmup_programs", self.warmup_programs),
      Patch(metric_logger.MetricLogger, "__init__", Method(self.logger_init)),
      Patch(metric_logger.MetricLogger, "write_metrics", Method(self.write_metrics)),
      Patch(multihost_dataloading, "_terminate_iterator_workers", terminate_iterator_workers),
      Patch(max_utils, "initialize_summary_writer", initialize_summary_writer),
    ]

  def poison(self) -> np.float32:
    """NaN for the steps fault_nan_loss_steps names, else 0 (added to the loss)."""
    step = self.start_step + self.train_calls
    self.train_calls += 1
    return np.float32(np.nan if step in self.config.fault_nan_loss_steps else 0.0)

  def moe_step(self) -> tuple[dict[str, float], tuple[np.ndarray, np.ndarray] | None]:
    """The oldest logged step's moe/* scalars and its per-layer picture (`moe_stats.step_layers`)."""
    cfg = self.config
    entries = self.channel.pop_step(max(int(cfg.gradient_accumulation_steps), 1))
    scalars = moe_stats.step_metrics(
      entries,
      row_bytes=int(cfg.emb_dim) * cfg.dtype.itemsize,
      capacity_factor=float(cfg.moe_capacity_factor),
      allow_drops=bool(cfg.moe_allow_drops),
    )
    return scalars, moe_stats.step_layers(entries)

  def initialize(self, argv=None, config_class=None, **kwargs):
    """`pyconfig.initialize`: the config resolved once, by the launcher."""
    del argv, config_class, kwargs
    return self.config

  def loss_fn(self, model, config, data, dropout_rng, params, sparsity_state=None, is_train=True):
    """MaxText's loss, which also sends the block's per-step stats to the run's channel."""
    loss, aux = pipeline.folded_loss_fn(
      model, config, data, dropout_rng, params, sparsity_state=sparsity_state, is_train=is_train
    )
    if is_train and self.config.fault_nan_loss_steps:
      poison = io_callback(self.poison, jax.ShapeDtypeStruct((), jnp.float32), ordered=False)
      loss = loss * (1 + poison.astype(loss.dtype))  # NaN in the loss and, through it, in every gradient
    stats = _collect_stats(aux) if is_train else None
    if stats is not None:
      jax.debug.callback(self.channel.push, stats)
    return loss, aux

  def warmup_programs(self, *args, **kwargs):
    """MaxText's warm-up, whose steps are not training steps: their stats are discarded."""
    out = original(train, "warmup_programs")(*args, **kwargs)
    self.channel.clear()
    self.train_calls = 0
    return out

  def logger_init(self, logger, config, learning_rate_schedule, start_step=0):
    """`MetricLogger.__init__`, then the recorder's start, once the checkpoint (if any) is restored."""
    original(metric_logger.MetricLogger, "__init__")(logger, config, learning_rate_schedule, start_step)
    self.start_step, self.train_calls = int(start_step), 0  # warm-up programs ran before: count from here
    self.hooks.start(config, start_step)

  def write_metrics(self, logger, metrics, step, metric_type="train"):
    """`MetricLogger.write_metrics`, with the step's moe/* scalars added (so TensorBoard has them too),
    the row handed to the recorder, and the non-finite policy applied once the row is written."""
    write = original(metric_logger.MetricLogger, "write_metrics")
    if not metrics or metric_type != "train":
      write(logger, metrics, step, metric_type)
      if metrics and metric_type == "eval":  # the whole held-out pass after train step `step`
        self.hooks.eval(int(step), {k: float(v) for k, v in metrics["scalar"].items()})
      return
    # Materialize the step's own scalars first: once they are ready, the step ran, and so did its stats
    # callback (popping before could take a step whose callback has not run yet).
    scalars = {k: float(v) for k, v in metrics["scalar"].items()}
    moe, layers = self.moe_step()
    metrics["scalar"].update(moe)
    write(logger, metrics, step, metric_type)
    notes, stop = self.rec.nonfinite.observe(int(step), scalars.get("learning/loss"))
    self.hooks.step(int(step), scalars | moe, notes)
    if layers is not None:
      self.hooks.layers(int(step), *layers)
    if stop is not None:
      raise stop


def initialize_summary_writer(tensorboard_dir, run_name, enable_tensorboard=True):
  """In decoupled mode (no Google Cloud: ours) maxtext 0.2.5 writes TensorBoard events under its own
  package directory (site-packages/local_tensorboard); the run's tensorboard_dir is RUN/tensorboard."""
  if jax.process_index() != 0 or not enable_tensorboard:
    return original(max_utils, "initialize_summary_writer")(tensorboard_dir, run_name, enable_tensorboard)
  from tensorboardX import SummaryWriter  # pylint: disable=import-outside-toplevel

  return SummaryWriter(tensorboard_dir)


def terminate_iterator_workers(obj):
  """maxtext 0.2.5 probes `hasattr(it, "_parent")`, and grain's DatasetIterator._parent asserts (not
  AttributeError) on an iterator with no parent: every SFT run printed an ignored AssertionError
  traceback when its iterators were collected. Such an iterator has no workers to terminate."""
  try:
    original(multihost_dataloading, "_terminate_iterator_workers")(obj)
  except AssertionError:
    pass


def validate(cfg: MoEMaxTextConfig) -> None:
  """MaxText's own checks of a training config (`train_utils.validate_train_config`, which its trainer
  asserts after the run has started), made before anything is written: one line, MaxText's words kept."""
  try:
    train_utils.validate_train_config(hyperparameters(cfg))
  except (AssertionError, ValueError) as e:
    raise UserError(f"MaxText refuses this config: {str(e).strip() or type(e).__name__}") from None


def run_trainer(
  cfg: MoEMaxTextConfig, hooks: RunHooks, rec: recovery.Recovery | None = None, end: data_end.DataEnd | None = None
) -> None:
  """Runs MaxText's pre-training loop in this process on `cfg`, with our block, hooks, recovery
  (`upstream.maxtext.recovery`) and the end of its data (`upstream.maxtext.data_end`: `end` says what ended
  the run when its data did) installed."""
  rec = rec or recovery.Recovery()
  run = TrainerPatches(hyperparameters(cfg), hooks, rec)
  moe_layer.prepare_te_ep(run.config)
  if not absl_flags.FLAGS.is_parsed():
    absl_flags.FLAGS.mark_as_parsed()
  ours = [*run.patches(), *recovery.patches(rec), *data_end.patches(end or data_end.DataEnd()), *sft_data.patches()]
  with installed([*model_patches(run.config), *ours]), moe_layer.te_guard():
    try:
      train.main(["", "<config resolved by maxtext-moe>"])
    finally:
      gc.collect()  # the data iterators (in reference cycles) are closed while the patches are in place
