"""Pipeline stages in the memory model (`estimate.py`) and the step-time model: MaxText's schedule and what
one device stores and keeps for the layers its stage runs.

Read in MaxText's code (the pinned version):
- configs/types.py (MaxTextConfig's derived keys): stages = ici_pipeline_parallelism x
  dcn_pipeline_parallelism; `pipeline_parallel_layers` -1 means every MoE layer of a DeepSeek decoder
  (num_decoder_layers - first_num_dense_layers), every layer otherwise; `num_pipeline_repeats` =
  pipelined layers / (stages x num_layers_per_pipeline_stage); `num_pipeline_microbatches` defaults to the
  stages (2 x with pipeline_delay_activation_forwarding), must divide by the stages and divide
  micro_batch_size_to_train_on (per_device_batch_size x devices).
- layers/nnx_decoders.py (`_init_pipeline_deepseek`, the pipeline branch of `NNXDecoder.__call__`): a
  DeepSeek decoder runs its dense layers and its first (MoE layers - pipeline_parallel_layers) MoE layers
  before the pipeline, scanned as `dense_layers` and `moe_layers` stacks (logical axes that no mesh axis
  takes: every stage stores them whole), under `logical_axis_rules_pp_act_as_dp`, which puts `stage` beside
  `data` in the activations' batch: there the stage axis splits tokens like data.
- layers/pipeline.py (`PipelineBase.__init__`): the pipelined layers' weights are [(repeats,) stages, ...]
  with the logical axes `circular_repeats` (no mesh axis) and `layers` (the `stage` mesh axis): a device
  stores pipelined layers / stages of them, each split over the other axes as without stages.
  `NNXPipeline.__call__` runs `microbatches x repeats + delay x (stages - 1)` iterations (delay 2 with
  pipeline_delay_activation_forwarding), each a vmap of one stage's layers over the stages on one
  microbatch of micro_batch_size_to_train_on / microbatches sequences, in a `jax.lax.scan` whose body is
  rematerialized (`set_remat_policy_on_pipeline_iterations`, on by default) with
  `get_pipeline_remat_policy`: under a custom policy the policy alone; under any other, the policy plus
  the names `iteration_input` (the stages' input) and `decoder_layer_input` (each layer's). The bubble's
  iterations run every stage on filler: they compute, exchange and gather like the real ones.
- layers/pipeline.py (`init_states`): the loop's buffers per device: `state_io` [stages, microbatches /
  stages, microbatch, length, embed] split over `stage` and the batch axes, `shift` one microbatch's
  activations, `prev_outputs` another with the delay, and with repeats > 1 and microbatches > stages x
  delay `circ_storage` [stages, microbatches, microbatch, ...] (every stage holds a whole batch) and its
  mover. `get_new_loop_state` moves one microbatch's activations between neighbouring stages per
  iteration with a collective permute (`ppermute` over `stage`) for `shift`, one for `state_io` and one
  for the circular storage when it is used.
- Weights: without `pipeline_fsdp_ag_once`, each iteration takes its stage's weights still split over FSDP
  (`get_current_stage_weights`) and the layer gathers them as it does without stages, so a device gathers
  one layer's weights per iteration and layer of its stage (the gradient's reduce-scatter likewise).
  `pipeline_fsdp_ag_once` and `pipeline_fsdp_ag_per_repeat` are not modelled (counted as the default).

Each iteration a stage runs num_layers_per_pipeline_stage layers (`NNXSequentialPipelineStage`), one remat
region with each layer checkpointed from its input (`upstream/pipeline/remat.py`); in a circular pipeline
(repeats > 1, which runs MoE layers too: `upstream/pipeline/records.py`) it visits each of its repeats'
layers once per microbatch, so a device stores repeats x layers per stage and the loop runs repeats x
microbatches real iterations. Qwen3-MoE and Mixtral decoders pipeline their `layers` stack (every layer);
those left out run after the pipeline, DeepSeek's before it.

Held to compiled programs (docs/planner.md): gh200x4/qwen3-30b-a3b (2 stages x 4 repeats, 8
microbatches) and the 671B on 2 stages of 29 layers, where the stage's weights re-laid out and one
iteration's weights (`relaid_bytes`, `iteration_bytes`) were found. The loop's buffers are counted one
copy each (the backward's cotangents of the loop state) and an iteration of several layers one layer's
backward at a time (each layer's recompute needs only its own saved input); neither was read apart in
those programs, where they are small beside the weights.
"""

import dataclasses
from typing import Any

from maxtext_moe.moe.layout import layer_counts
from maxtext_moe.planner import layer_phase
from maxtext_moe.planner.saved_activations import per_layer, value_of
from maxtext_moe.planner.shards import shard_elements

# The scanned stack (in the parameter tree traced without stages) the pipeline takes its layers from.
DEEPSEEK_STACK = "moe_layers"
STACK = "layers"


def stack_of(cfg: Any) -> tuple[str, int]:
  """(the logical name of the layer stack a decoder pipelines, in the tree traced without stages; its
  layers): a DeepSeek decoder's MoE layers (its dense layers run before the pipeline), any other's every
  layer."""
  if value_of(cfg.decoder_block).lower().rsplit(".", 1)[-1] == "deepseek":
    return DEEPSEEK_STACK, int(cfg.num_decoder_layers) - int(cfg.first_num_dense_layers or 0)
  return STACK, int(cfg.num_decoder_layers)


@dataclasses.dataclass(frozen=True)
class Stages:
  """A resolved config's pipeline: S stages, M microbatches, R repeats, activation delay 1 or 2."""

  stages: int
  microbatches: int
  repeats: int
  delay: int
  layers_per_stage: int
  pipelined: int  # pipeline_parallel_layers, as MaxText resolved it
  stack: str  # the stack's logical axis name in the tree traced without stages
  stack_layers: int  # layers in that stack: the pipelined ones and those run before the pipeline

  @classmethod
  def of(cls, cfg: Any) -> "Stages | None":
    if not getattr(cfg, "using_pipeline_parallelism", False):
      return None
    stack, stack_layers = stack_of(cfg)
    return cls(
      stages=int(cfg.ici_pipeline_parallelism) * int(cfg.dcn_pipeline_parallelism),
      microbatches=int(cfg.num_pipeline_microbatches),
      repeats=int(cfg.num_pipeline_repeats),
      delay=2 if cfg.pipeline_delay_activation_forwarding else 1,
      layers_per_stage=int(cfg.num_layers_per_pipeline_stage),
      pipelined=int(cfg.pipeline_parallel_layers),
      stack=stack,
      stack_layers=stack_layers,
    )

  @property
  def iterations(self) -> int:
    """`NNXPipeline.__call__`'s total_iterations: the real ones and the bubble's."""
    return self.microbatches * self.repeats + self.delay * (self.stages - 1)

  @property
  def bubble(self) -> float:
    """The bubble's share of the pipelined layers' time: delay x (S - 1) / (M x R + delay x (S - 1))."""
    return self.delay * (self.stages - 1) / self.iterations

  @property
  def per_stage(self) -> int:
    """Pipelined layers one device stores and runs: repeats x layers per stage."""
    return self.repeats * self.layers_per_stage

  @property
  def outside(self) -> int:
    """Layers of the stack run before the pipeline, on every stage (none but DeepSeek's here)."""
    return self.stack_layers - self.pipelined

  @property
  def circular_storage(self) -> bool:
    """`PipelineBase.need_circ_storage`."""
    return self.repeats > 1 and self.microbatches > self.stages * self.delay

  def microbatch_tokens(self, tokens: int, seq: int) -> int:
    """Tokens per device in one microbatch: the microbatch's sequences over the batch axes (which exclude
    `stage` inside the pipeline), rounded up to whole sequences. `tokens`: per device over the same axes
    for the whole micro batch (micro_batch_size_to_train_on)."""
    return -(-tokens // (self.microbatches * seq)) * seq

  def stored_layers(self) -> int:
    """Layers of the stack one device stores: its stage's and, whole, those outside the pipeline."""
    return self.outside + self.per_stage


def outside_layer_counts(cfg: Any, pipe: Stages | None) -> tuple[int, int]:
  """(dense, MoE) layers run outside the pipeline (each multi-token-prediction layer a MoE one: MaxText runs
  them after the decoder); all the model's without stages. The pipelined layers are MoE ones in a MoE model."""
  dense, moe = layer_counts(cfg)
  if pipe is None:
    return dense, moe
  return (dense, moe - pipe.pipelined) if moe else (dense - pipe.pipelined, 0)


def loop_buffer_elements(pipe: Stages, microbatch_tokens: int, emb: int) -> int:
  """Elements per device of the loop's buffers (`PipelineBase.init_states`), one copy of each: state_io
  (M / S microbatches), shift, prev_outputs with the delay, circ_storage (M microbatches) and its mover."""
  count = pipe.microbatches // pipe.stages + 1 + (pipe.delay > 1)
  if pipe.circular_storage:
    count += pipe.microbatches + 1
  return count * microbatch_tokens * emb


def saved_per_iteration(cfg: Any, layer_saved: int, microbatch_tokens: int, d_bytes: int) -> int:
  """Bytes one iteration of the pipeline's scan keeps for the backward (`get_pipeline_remat_policy`): each
  layer of the stage what its policy keeps (`layer_saved`, at the microbatch's tokens), and under a policy
  other than custom the stages' input (`iteration_input`) besides."""
  per_stage = int(cfg.num_layers_per_pipeline_stage) * layer_saved
  if value_of(cfg.remat_policy) == "custom":
    return per_stage
  return per_stage + microbatch_tokens * int(cfg.emb_dim) * d_bytes


def stored_elements(shape: tuple, names: tuple, rules: list, sizes: dict[str, int], pipe: Stages | None) -> int:
  """Elements of one device's shard of a leaf traced without stages: for the pipelined stack, one layer's
  shard (split over the other mesh axes as without stages) times the layers the device stores, its stage's
  and those outside the pipeline; any other leaf as `shards.shard_elements` splits it."""
  if pipe is None or pipe.stack not in names:
    return shard_elements(shape, names, rules, sizes)
  return shard_elements(shape, names, rules, sizes, skip=pipe.stack) * pipe.stored_layers()


def pipelined_elements(leaves: list, rules: list, sizes: dict[str, int], pipe: Stages) -> int:
  """Elements of the pipelined layers' weights one device stores (its stage's, every repeat) that it
  gathers to compute with (split over an FSDP-style axis): what the two terms below are counted in."""
  total = 0
  for path, shape, names in leaves:
    if path[0] != "params" or pipe.stack not in names:
      continue
    one = shard_elements(shape, names, rules, sizes, skip=pipe.stack)
    if one < shard_elements(shape, names, rules, sizes, skip=pipe.stack, gathered=True):
      total += one * pipe.per_stage
  return total


def relaid_bytes(cfg: Any, elements: int) -> int:
  """The stage's stored weights re-laid out once per step, in the weight dtype: each is stored [repeats,
  stages, <the layer's own dims>] and XLA:GPU moves the dimension it gathers over FSDP to the front before
  it slices a repeat out and gathers it (read in gh200x4/qwen3-30b-a3b's program: a float32 transpose of
  each of a stage's 18 expert kernels, 13.5 GiB, beside their gradients), as it does a scanned stack's
  (`estimate._state_bytes`'s scan copy)."""
  return elements * layer_phase.dtype_bytes(cfg.weight_dtype)


def iteration_bytes(cfg: Any, pipe: Stages, elements: int) -> int:
  """What one iteration of the pipeline holds of its stage's weights, for one repeat: the iteration's
  gradient in float32 before it is added to the stage's, the weights cast to the compute dtype and their
  gradient shards in it (reduce-scattered). gh200x4/qwen3-30b-a3b's program holds exactly these three at
  its peak (3.2, 1.7 and 1.6 GiB for a repeat of 6 layers); with one repeat the float32 one is a third
  whole copy of the stage's kernels (the 671B's staged program: gradients, the re-laid-out kernels, and
  these)."""
  narrow = layer_phase.dtype_bytes(cfg.dtype)
  return elements // pipe.repeats * (layer_phase.dtype_bytes(cfg.weight_dtype) + 2 * narrow)


@dataclasses.dataclass(frozen=True)
class PipelineMemory:
  """One device's bytes for the pipelined layers beyond their weights."""

  microbatch_tokens: int
  phase: layer_phase.LayerPhase  # one pipelined layer's backward, at a microbatch's tokens
  buffers: int  # the loop's buffers, live in that backward
  saved: int  # what the scan over iterations keeps for the backward, on the device
  saved_host: int  # and offloaded
  iteration: int = 0  # the iteration's stage weights (`iteration_bytes`), live in that backward


def memory(
  cfg: Any, pipe: Stages, one: Any, tokens: int, *, ep: int, dispatch: str, gathered: int = 0
) -> PipelineMemory:
  """The pipelined layers' activations (see the module docstring); `tokens` per device over the batch axes
  (no `stage`) for the whole micro batch, `one` a layer's weights as computed with (`layer_weights`),
  `gathered` the stage's stored weights it gathers (`pipelined_elements`)."""
  d_b = layer_phase.dtype_bytes(cfg.dtype)
  micro = pipe.microbatch_tokens(tokens, int(cfg.max_target_length))
  phase = layer_phase.of(cfg, one, micro, ep=ep, dispatch=dispatch)
  saved, saved_host = saved_bytes(cfg, pipe, micro, phase.rows, dispatch=dispatch)
  buffers = loop_buffer_elements(pipe, micro, int(cfg.emb_dim)) * d_b
  return PipelineMemory(micro, phase, buffers, saved, saved_host, iteration_bytes(cfg, pipe, gathered))


def saved_bytes(cfg: Any, pipe: Stages, micro: int, rows: int, *, dispatch: str) -> tuple[int, int]:
  """(device, host) bytes the pipeline's scan keeps over its iterations, at `micro` tokens and `rows` MoE
  rows per device and microbatch: each iteration what the policy keeps of its stage's layers
  (`saved_activations.per_layer`) and the stage input (`saved_per_iteration`)."""
  d_b = layer_phase.dtype_bytes(cfg.dtype)
  recomputed = layer_phase.experts_recomputed(cfg, dispatch)
  dense = layer_counts(cfg)[1] == 0
  device, host = per_layer(cfg, micro, d_b, rows, recomputed=recomputed, dense=dense)
  saved = pipe.iterations * saved_per_iteration(cfg, device, micro, d_b)
  return saved, pipe.iterations * pipe.layers_per_stage * host
