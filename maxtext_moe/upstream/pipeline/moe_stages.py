"""MaxText's pipeline parallelism with MoE layers: the routing bias carried as a stage's weights, and each
layer's expert loads folded from the pipeline's iterations back into layers.

MaxText's NNX pipeline (`layers/pipeline.py`) splits each stage's state into "static params"
(`pipeline_utils.is_static_param`: `nnx.Param` and FP8's `_overwrite_with_gradient`), intermediates, and a
catch-all it carries through the scan over iterations and asserts holds only RNG state. DeepSeek-V3's
routing bias (`moe.MoEBiasVar`, not a Param) lands in the catch-all and stops the first compile. It is a
per-layer weight the forward pass only reads (the train step adds the step's update afterwards), so we
count it with the static params: the pipeline then hands each stage its slice as it does the kernels.

The pipeline runs `microbatches x repeats + delay x (stages - 1)` iterations, each a vmap over the stages
(`spmd_axis_name="stage"`), and stacks what the layers record per iteration: [T, S, ...] (with repeats,
through `stage_records`, which keeps those records out of MaxText's write-back by repeat). Stage s at
iteration t works on item t - delay*s of its stream (microbatch (t - delay*s) mod M of repeat
(t - delay*s) div M) when 0 <= t - delay*s < M*R; otherwise it runs on the bubble's filler, whose loads
must not count. `fold` sums (or takes the largest of) the real iterations per (repeat, stage): the
pipelined layers' values for the whole step, in layer order. The bias update is then taken once from
the step's counts, as without stages, for the pipelined layers and those outside the pipeline together
(`fold_aux`, `find_gate_bias`: MaxText's train step updates one bias variable, the one it finds first).
The pipeline's outputs are put back in microbatch order by a rotation, not MaxText's gather
(`realigned_output`).
"""

import re
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import linen as nn
from flax import nnx
from maxtext.layers import moe as mt_moe
from maxtext.layers import multi_token_prediction as mt_mtp
from maxtext.layers import pipeline as mt_pipeline
from maxtext.trainers.pre_train import train
from maxtext.utils import pipeline_utils, sharding

from maxtext_moe.moe.stats import BIAS, INTERMEDIATE_PREFIX, MAX_STATS
from maxtext_moe.upstream.patches import Patch, original
from maxtext_moe.upstream.pipeline import records as stage_records
from maxtext_moe.upstream.pipeline import remat as stage_remat

STAGE = "stage"  # MaxText's pipeline mesh axis, its stages' vmap `spmd_axis_name`
MODULE = "pipeline_module"  # the decoder's attribute holding the pipelined layers
BIAS_UPDATES = "moe_bias_updates"  # what MaxText's MoE layers sow for the bias update


def is_static_param(path: Any, v: Any) -> bool:
  """MaxText's predicate, plus the routing bias."""
  return isinstance(v, mt_moe.MoEBiasVar) or original(pipeline_utils, "is_static_param")(path, v)


def vmapped_axes(cfg: Any) -> tuple[str, ...]:
  """Mesh axes a surrounding vmap maps while a layer runs: the pipeline's stage axis inside the pipeline.
  MaxText runs the layers outside it (DeepSeek's dense layers and any MoE layers not pipelined) under
  axis rules that put `stage` beside `data` in the activations' batch (`logical_axis_rules_pp_act_as_dp`);
  there the stage axis splits tokens like data. Inside, the batch is not split over `stage`."""
  if not getattr(cfg, "using_pipeline_parallelism", False):
    return ()
  rules = dict(sharding.get_logical_axis_rules() or ())
  batch = rules.get("activation_batch", ())
  batch = (batch,) if isinstance(batch, str) else tuple(batch or ())
  return () if STAGE in batch else (STAGE,)


@dataclass(frozen=True)
class Schedule:
  """A pipeline's iterations: S stages, M microbatches, R repeats (circular), activation delay 1 or 2."""

  stages: int
  microbatches: int
  repeats: int
  delay: int

  @classmethod
  def of(cls, cfg: Any) -> "Schedule | None":
    if not getattr(cfg, "using_pipeline_parallelism", False):
      return None
    return cls(
      stages=int(cfg.ici_pipeline_parallelism) * int(cfg.dcn_pipeline_parallelism),
      microbatches=int(cfg.num_pipeline_microbatches),
      repeats=int(cfg.num_pipeline_repeats),
      delay=2 if cfg.pipeline_delay_activation_forwarding else 1,
    )

  @property
  def iterations(self) -> int:
    return self.microbatches * self.repeats + self.delay * (self.stages - 1)

  def slots(self) -> np.ndarray:
    """[T, S] int: the (repeat, stage) slot r*S + s each stage works for at each iteration; the bubble's
    iterations get R*S, one past the last."""
    t = np.arange(self.iterations)[:, None]
    s = np.arange(self.stages)[None, :]
    item = t - self.delay * s
    real = (item >= 0) & (item < self.microbatches * self.repeats)
    slot = (item // self.microbatches) * self.stages + s
    return np.where(real, slot, self.repeats * self.stages).astype(np.int32)


def fold(leaf: jax.Array, schedule: Schedule, *, largest: bool = False) -> jax.Array:
  """[T, S, ...] recorded per iteration -> [R*S, ...] per (repeat, stage), the real iterations summed
  (or their largest with `largest`); the bubble's dropped."""
  t, s = schedule.iterations, schedule.stages
  if leaf.shape[:2] != (t, s):
    raise ValueError(f"pipeline: expected a [{t}, {s}, ...] record per iteration and stage, got {leaf.shape}")
  rows = leaf.reshape(t * s, *leaf.shape[2:])
  slots, n = jnp.asarray(schedule.slots().reshape(-1)), schedule.repeats * schedule.stages + 1
  reduce = jax.ops.segment_max if largest else jax.ops.segment_sum
  return reduce(rows, slots, num_segments=n)[:-1]


def _names(path: tuple[Any, ...]) -> list[str]:
  """A pytree path's keys (dict keys, attribute names, indices) as text."""
  return [str(getattr(k, "key", getattr(k, "name", k))) for k in path]


def _layer_key(path: tuple[Any, ...]) -> tuple[int, tuple[int, ...]]:
  """Order of a decoder path's layers: those outside the pipeline (a DeepSeek decoder runs them first),
  then the pipeline's; numbered names by number. The biases (`BiasView`) and their update (`_bias_signal`)
  are put in this one order, which is all the update needs."""
  names = _names(path)
  return (int(MODULE in names), tuple(int(n) for name in names for n in re.findall(r"\d+", name)))


def _fold_leaf(path: tuple[Any, ...], leaf: Any, schedule: Schedule) -> Any:
  names = _names(path)
  if MODULE not in names or not hasattr(leaf, "shape"):
    return leaf
  name = next((n for n in reversed(names) if n.startswith(INTERMEDIATE_PREFIX) or n == BIAS_UPDATES), None)
  if name is None:
    return leaf
  folded = fold(leaf, schedule, largest=name.removeprefix(INTERMEDIATE_PREFIX) in MAX_STATS)
  if name == INTERMEDIATE_PREFIX + BIAS:  # the same |bias| at every microbatch: their mean
    folded = folded / schedule.microbatches
  return folded


def _bias_signal(intermediates: Any, cfg: Any) -> jax.Array | None:
  """The decoder's bias update for the step, [layers, E] in `_layer_key` order: the pipelined layers'
  folded counts turned into one sign update (or kept as counts for gradient accumulation to sum), beside
  what the layers outside the pipeline emitted as without stages."""
  found = [
    (path, leaf)
    for path, leaf in jax.tree_util.tree_leaves_with_path(intermediates)
    if {BIAS_UPDATES, "decoder"} <= set(_names(path))
  ]
  if not found:
    return None
  rows = []
  for path, leaf in sorted(found, key=lambda pl: _layer_key(pl[0])):
    leaf = leaf.reshape(-1, int(cfg.num_experts))
    if MODULE in _names(path) and int(cfg.gradient_accumulation_steps) <= 1:
      leaf = mt_moe.load_balance_updates_from_counts(leaf, int(cfg.num_experts), float(cfg.routed_bias_update_rate))
    rows.append(leaf.astype(jnp.float32) if int(cfg.gradient_accumulation_steps) <= 1 else leaf)
  return jnp.concatenate(rows)


def fold_aux(aux: dict, cfg: Any) -> dict:
  """MaxText's loss aux with the pipelined layers' records folded into layers (`fold`) and the decoder's
  bias update rebuilt for all its MoE layers (`_bias_signal`); unchanged without pipeline stages."""
  schedule = Schedule.of(cfg)
  if schedule is None or "intermediate_outputs" not in aux:
    return aux
  folded = jax.tree_util.tree_map_with_path(lambda p, x: _fold_leaf(p, x, schedule), aux["intermediate_outputs"])
  out = dict(aux, intermediate_outputs=folded)
  if cfg.routed_bias and float(cfg.routed_bias_update_rate) > 0.0:
    signal = _bias_signal(folded, cfg)
    out["moe_bias_updates"] = None if signal is None else (signal,)
  return out


class BiasView:
  """The routing biases of all a pipelined decoder's MoE layers as one [layers, E] `value`, in
  `_layer_key` order: what MaxText's train step reads and writes as one layer stack's bias."""

  def __init__(self, variables: list[nnx.Variable]):
    self.variables = variables

  @property
  def value(self) -> jax.Array:
    return jnp.concatenate([v.get_value().reshape(-1, v.get_value().shape[-1]) for v in self.variables])

  @value.setter
  def value(self, new: jax.Array) -> None:
    start = 0
    for v in self.variables:
      old = v.get_value()
      rows = int(np.prod(old.shape[:-1]))
      v.set_value(new[start : start + rows].reshape(old.shape).astype(old.dtype))
      start += rows


def find_gate_bias(module: Any) -> Any:
  """MaxText's `_find_gate_bias`, and for a decoder with pipeline stages every MoE layer's bias as one."""
  if module is None or not hasattr(module, MODULE):
    return original(train, "_find_gate_bias")(module)
  found = [
    (path, node.bias)
    for path, node in nnx.iter_graph(module)
    if type(node).__name__ == "GateLogit" and getattr(node, "bias", None) is not None
  ]
  return BiasView([b for _, b in sorted(found, key=lambda pb: _layer_key(pb[0]))]) if found else None


def mtp_call(module: Any, *args: Any, **kwargs: Any) -> Any:
  """MaxText's `MultiTokenPredictionBlock.__call__`, with pipeline stages under the axis rules MaxText gives
  the layers it runs outside the pipeline (`logical_axis_rules_pp_act_as_dp`: `stage` splits tokens like
  `data`). The block runs after the decoder, outside the pipeline; under the plain rules its activations
  were split over every batch axis but `stage`, so every stage ran the whole step's tokens through the MTP
  layer and its output head (the 671B on 256 H100s: 1,974 GiB per GPU, the batch's logits gathered)."""
  call = original(mt_mtp.MultiTokenPredictionBlock, "__call__")
  cfg = module.config
  if not getattr(cfg, "using_pipeline_parallelism", False):
    return call(module, *args, **kwargs)
  with nn.partitioning.axis_rules(sharding.logical_axis_rules_pp_act_as_dp(cfg.logical_axis_rules)):
    return call(module, *args, **kwargs)


def realigned_output(pipeline, output):
  """The pipeline's outputs back in microbatch order by a rotation (MaxText's `realign_output_microbatches`,
  which its circular pipeline uses), in place of `NNXPipeline`'s gather by a permutation: the permutation is
  that rotation, so the values are the same. The gather's backward is a scatter-add, which XLA:GPU ran on the
  whole [stages, microbatches per stage, batch, length, embed] buffer unsplit over the batch and then summed
  over the stages: DeepSeek-V3 at Megatron's layout (8 stages of 64 microbatches on 1,024 H100s) held it at
  its memory peak, 14 GiB per GPU, and all-reduced it across 8 nodes every step. A rotation's backward is
  the rotation back, on each device's own part."""
  return pipeline.realign_output_microbatches(output)


def patches() -> list[Patch]:
  """Where the model is built: the routing bias among a stage's weights; the multi-token prediction block
  outside the pipeline split over the stages like data; a stage's layers rematerialized one by one; the
  outputs put back in order by a rotation."""
  return [
    Patch(pipeline_utils, "is_static_param", is_static_param),
    Patch(mt_mtp.MultiTokenPredictionBlock, "__call__", mtp_call),
    Patch(mt_pipeline.PipelineBase, "permute_output_micro_per_stage_dim", realigned_output),
    *stage_remat.patches(),
    *stage_records.patches(),
  ]


def trainer_patches() -> list[Patch]:
  """In MaxText's train step: all the MoE layers' biases updated as one (`find_gate_bias`)."""
  return [Patch(train, "_find_gate_bias", find_gate_bias)]


def folded_loss_fn(model, config, *args, **kwargs):
  """MaxText's loss with its aux folded (`fold_aux`): what our trainer's loss does, less the stats."""
  loss, aux = original(train, "loss_fn")(model, config, *args, **kwargs)
  return loss, fold_aux(aux, config)


def step_patches() -> list[Patch]:
  """For MaxText's train step built outside our trainer (`compile`): the same step as `train` runs."""
  return [Patch(train, "loss_fn", folded_loss_fn), *trainer_patches()]
