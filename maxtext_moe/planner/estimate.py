"""The memory model: one device's bytes at the training step's peak, from the resolved config alone.

Nothing is compiled or allocated, so it answers for 1,024 GPUs on a laptop (`memory_plan.py` searches
fixes with it).

The estimate (bytes per device; T = tokens per device, V = vocab, D = model dim, F = expert hidden dim):

  state        parameters (weight_dtype) + Adam's two moments (mu_dtype), each leaf divided by the mesh axes
               its logical names resolve to (MaxText's logical_axis_rules, flax's resolution), minus the
               optimizer state offload puts on the host. Offloaded parameters are on the device during the
               step all the same: MaxText's train step moves every parameter to the device before the
               forward pass (`train_step`, parameter_memory_host_offload) and XLA:GPU keeps each stacked
               leaf there whole until the update; what the offload saves is their re-laid-out copy
  grads        one grad_dtype copy of the sharded parameters
  scan copy    with param_scan_axis != 0 the stacked layer weights are re-laid out layer-major once for the
               scanned backward (seen in XLA's buffer assignment; MaxText's param_scan_axis=0 avoids it)
  saved        what the remat policy keeps per layer: the layer input (T x D) under `full`; under `custom`
               each tensor MaxText names that the layer's backward needs, where the config puts it (attention's
               projections and output, the MLP's gated inputs, the experts' GEMM outputs); on the host when
               offloaded
  update       with the optimizer state on the host, MaxText's train step moves it to the device for the
               update, one fusion per leaf whose outputs take its inputs' place; XLA:GPU starts every
               leaf's host copies together, so the update holds the whole train state
               (`update_phase.py`). The step's peak is the larger of this and the rest
  peak         the larger of two phases, each buffer counted as often as XLA keeps it live there
               (`xla_buffers`: XLA:GPU's counts for a GPU recipe, XLA:CPU's for a CPU one):
                 loss     float32 (the model's loss head's and each MTP head's) and compute-dtype T x V
                          logits-sized buffers (`loss_phase.py`; with MaxText's vocab tiling a chunk of
                          the model's head's, and the whole batch's hidden states gathered)
                 layer    the backward of one MoE layer while some logits-sized buffers are still live:
                            the larger of the experts' moment (R routed rows x D and x F at their largest,
                              S received rows x D, attention's q/k/v/output where the policy recomputes
                              them) and attention's (B x H x L x L scores and masks for dot-product
                              attention; for flash, 4 x T x H x (qk + v head dims))
                            + one layer's weights as computed with (`layer_weights`: gathered over FSDP,
                              each device's experts): the experts' matrices with their weight gradients,
                              the other weights of a MoE and a dense layer
                            + T x D residual-stream temporaries
                            + with FP8/MXFP8 dense GEMMs (`quantization`), their quantized operands: one
                              layer's non-expert weights and the widest GEMM input, row- and column-wise
  MoE rows R   what our dispatchers allocate, dropless sizes being worst cases:
                 local  T x K;  all_to_all  EP x cap x K (cap = T dropless);  ragged_all_to_all  T x EP x K;
                 with moe_buffers=bounded (all_to_all, ragged_all_to_all) one round's EP x (G + K - 1),
                 G = ceil(factor x T x K / EP): extra rounds cost time, not memory; MaxText's TE block
                 (te_moe_block) ragged_buffer_factor x T x K (it stops when the buffer overflows)

With pipeline stages (S stages, M microbatches, I = M x R + delay x (S - 1) iterations; `stages.py` says
what was read in MaxText's code for each):
  state        the pipelined layers' leaves x (their stage's R layers + those outside the pipeline) /
               the stack's layers: a device stores P / S of the P pipelined layers and, whole, the dense
               layers and the MoE layers outside the pipeline
  saved        outside the pipeline, per layer at T / S tokens (the stage axis splits their batch); the
               pipeline's scan keeps per iteration what the policy keeps of its stage's layers at a
               microbatch's T / M tokens, plus the stage input (T / M x D) under any policy but custom: x I
  weights      the stage's weights re-laid out once (weight dtype) and one iteration's for a repeat (its
               float32 gradient, the compute-dtype weights and gradient shards: `stages.iteration_bytes`)
  peak         the loss phase at T / S; the layer phase the larger of a layer's backward outside the
               pipeline (T / S) and a pipelined layer's (T / M) with the loop's buffers: state_io (M / S
               microbatches), shift, prev_outputs (delay 2), circ_storage (M microbatches) and its mover,
               each T / M x D, one copy each

`maxtext-moe bench plan` checks the whole estimate against XLA:CPU's compiled `memory_analysis()`, and
`bench plan --gpu` against XLA:GPU's for every GPU model we ship. XLA:GPU's scheduler spends memory it
has to spare on overlap (docs/design-facts.md): the counts are what it keeps at the recipe's flags.
"""

import dataclasses
import math
from typing import Any

from maxtext_moe.moe.layout import mesh_sides, mesh_sizes
from maxtext_moe.planner import (
  layer_phase,
  layer_weights,
  loss_phase,
  saved_activations,
  stages,
  update_phase,
  xla_buffers,
)
from maxtext_moe.planner.layer_phase import dtype_bytes, experts_recomputed, opt_slots, our_block
from maxtext_moe.planner.shards import mesh_axes_of, tensor_ways

GIB = 2**30
# A step planned within this share of the usable memory is at its edge: where a step needs nearly all of it,
# XLA:GPU's buffer assignment packs its buffers 2-5% above the bytes live at once (the 671B on 32 H100 nodes:
# layouts planned at 71.9 and 70.8 GiB of 72.8 compile to 73.5 and 74.7), so the compile, not the planner,
# says whether it fits (`plan --search` ranks such layouts last, `plan` says so).
EDGE = 0.05


@dataclasses.dataclass
class Estimate:
  """One device's memory, in bytes, and where it goes."""

  params: int
  optimizer: int
  grads: int
  scan_copy: int
  saved_activations: int
  logits_phase: int
  layer_phase: int
  moe_rows: int
  moe_dispatch: int
  attention: int
  layer_weights: int  # a layer's backward: its weights gathered, the experts' weight gradients
  layer_activations: int  # a layer's backward: residual-stream temporaries
  host: int
  device_total: int
  hbm: int | None
  host_capacity: int | None
  tflops_per_step: float
  tokens_per_step: int
  fp8_copies: int = 0  # a layer's backward: the quantized copies of the dense GEMMs' operands (FP8 dense)
  stage_copy: int = 0  # with pipeline stages: the stage's weights re-laid out (`stages.relaid_bytes`)
  step_total: int = 0  # the forward and backward's peak (parameters, state on the device, gradients, saved
  # activations and the larger of the loss and layer phases)
  update_phase: int = 0  # the optimizer update's, when its state is on the host (0 otherwise)
  params_from_host: bool = False  # `params` is the step's copy of parameters kept on the host
  host_state: int = 0  # of `host`: the optimizer state and parameters offload puts there (no activations)
  stages: int = 1  # pipeline stages (`stages.py`); the terms below are 0 without them
  microbatches: int = 0
  iterations: int = 0  # the pipeline's loop: microbatches x repeats + delay x (stages - 1)
  microbatch_tokens: int = 0  # tokens per device in one microbatch (`tokens_per_step`: outside the pipeline)
  pipeline_saved: int = 0  # of `saved_activations`: what the pipeline's iterations keep
  pipeline_buffers: int = 0  # of `layer_phase`: the loop's buffers, when the peak is a pipelined layer's
  pipeline_iteration: int = 0  # of `layer_phase`: the iteration's stage weights (`stages.iteration_bytes`)
  peak_layer: str = ""  # whose backward `layer_phase` is: a pipelined layer's or one outside the pipeline
  pipeline_bubble: float = 0.0  # of the pipelined layers' iterations, the bubble's share
  overrides: list[str] = dataclasses.field(default_factory=list)

  @property
  def fits(self) -> bool:
    device_ok = self.hbm is None or self.device_total <= self.hbm
    host_ok = self.host_capacity is None or self.host <= self.host_capacity
    return device_ok and host_ok

  def schedule_rows(self) -> list[str]:
    """The plan table's pipeline schedule, and whose backward the layer phase is (`stages.py`)."""
    if self.stages <= 1:
      return []
    return [
      f"  pipeline: {self.stages} stages, {self.microbatches} microbatches of {self.microbatch_tokens:,} tokens "
      f"per device, {self.iterations} iterations ({self.pipeline_bubble:.1%} of them the bubble's); layer phase: "
      f"a layer {self.peak_layer}",
    ]

  def phase_rows(self) -> list[str]:
    """The plan table's two phases whose larger is the peak, when the optimizer state is on the host."""
    if not self.update_phase:
      return []
    rows = (
      ("forward and backward", self.step_total),
      ("optimizer update (its state from the host)", self.update_phase),
    )
    return [f"  {name:<44}{n / GIB:>10,.1f}" for name, n in rows]


def _stored(cfg: Any, leaves: list, rules: list, sizes: dict[str, int], pipe: stages.Stages | None) -> list:
  """[(elements per device, scanned)] of each parameter leaf (`stages.stored_elements`)."""
  out = []
  for path, shape, names in leaves:
    if path[0] != "params":
      continue
    n = stages.stored_elements(shape, names, rules, sizes, pipe)
    scanned = any(name in ("layers", "dense_layers", "moe_layers") for name in names)
    out.append(
      (n, n if pipe is None or pipe.stack not in names else n * pipe.outside // pipe.stored_layers())
      if scanned
      else (n, 0)
    )
  return out


def _state_bytes(
  cfg: Any, leaves: list, rules: list, sizes: dict[str, int], pipe: stages.Stages | None = None
) -> tuple[int, int, int, int]:
  """(parameters, Adam state, gradients, scanned-weights copy) bytes per device, before offload; with
  pipeline stages the pipelined layers' over the stages (`stages.stored_elements`), which are not scanned
  layers (no re-laid-out copy)."""
  w_b, g_b = dtype_bytes(cfg.weight_dtype), dtype_bytes(cfg.grad_dtype)
  mu_b = dtype_bytes(cfg.mu_dtype or cfg.weight_dtype)
  stored = _stored(cfg, leaves, rules, sizes, pipe)
  param_elems, scanned_elems = sum(n for n, _ in stored), sum(s for _, s in stored)
  scan_copy = scanned_elems * w_b if int(cfg.param_scan_axis) != 0 and cfg.scan_layers else 0
  return param_elems * w_b, param_elems * mu_b * opt_slots(cfg), param_elems * g_b, scan_copy


def batch_tokens(cfg: Any, sizes: dict[str, int], rules: list, num_devices: int) -> int:
  """Tokens per device of the micro batch over the activations' batch axes (MaxText's `activation_batch`
  rule, which has no `stage`): with pipeline stages, the pipeline's whole batch on each stage. Tensor
  parallelism leaves the batch whole and splits each activation's other dimensions (`shards.tensor_ways`):
  a device holds what 1/tp of its group's tokens would, so it counts as that many tokens (our MoE block
  splits the group's tokens themselves)."""
  batch_shards = math.prod(sizes.get(a, 1) for a in mesh_axes_of(("activation_batch",), rules)[0])
  batch_shards *= tensor_ways(sizes)
  return int(cfg.per_device_batch_size * num_devices) * int(cfg.max_target_length) // max(batch_shards, 1)


def estimate(
  cfg: Any,
  leaves: list,
  *,
  num_devices: int,
  dispatch: str,
  hbm_gib: float | None,
  host_gib: float | None,
  tflops: float,
) -> Estimate:
  """The per-device estimate for a resolved config and its parameter leaves (see the module docstring)."""
  sizes = mesh_sizes(cfg, num_devices)
  rules = [(name, tuple(axes) if isinstance(axes, list) else axes) for name, axes in cfg.logical_axis_rules]
  d_b, pipe = dtype_bytes(cfg.dtype), stages.Stages.of(cfg)
  state = _state_fields(cfg, leaves, rules, sizes, pipe)
  tokens = batch_tokens(cfg, sizes, rules, num_devices)
  # Outside the pipeline (MaxText's `logical_axis_rules_pp_act_as_dp`, and the logits' batch rule) the
  # stage axis splits the batch like data.
  outside_tokens = tokens // pipe.stages if pipe else tokens
  one = layer_weights.of(leaves, rules, sizes, moe_model=int(cfg.num_experts) > 1, in_block=our_block(cfg))
  ep, recomputed = sizes.get("expert", 1), experts_recomputed(cfg, dispatch)
  outside = layer_phase.of(cfg, one, outside_tokens, ep=ep, dispatch=dispatch)
  whole = int(cfg.per_device_batch_size * num_devices) * int(cfg.max_target_length) // (pipe.stages if pipe else 1)
  whole *= loss_phase.tiled_batch_gathered(cfg, rules, mesh_sides(cfg, num_devices))
  logits_phase, layer_logits = loss_phase.logits_bytes(cfg, outside_tokens, d_b, xla_buffers.for_config(cfg), whole)
  layers = stages.outside_layer_counts(cfg, pipe)
  saved, saved_host = saved_activations.total(
    cfg, outside_tokens, d_b, outside.rows, recomputed=recomputed, layers=layers
  )
  peak, piped, inside = outside, None, False
  if pipe:
    gathered = stages.pipelined_elements(leaves, rules, sizes, pipe)
    piped = stages.memory(cfg, pipe, one, tokens, ep=ep, dispatch=dispatch, gathered=gathered)
    saved, saved_host = saved + piped.saved, saved_host + piped.saved_host
    inside = piped.phase.total + piped.buffers + piped.iteration > (outside.total if sum(layers) else 0)
    peak = piped.phase if inside else outside
    state["stage_copy"] = stages.relaid_bytes(cfg, gathered)
  layer = layer_logits + peak.total + (piped.buffers + piped.iteration if inside else 0)
  resident = state["params"] + state["optimizer"] + state["grads"] + state["scan_copy"] + state["stage_copy"]
  step_total = resident + saved + max(logits_phase, layer)
  return Estimate(
    **state,
    saved_activations=saved,
    logits_phase=logits_phase,
    layer_phase=layer,
    moe_rows=peak.rows,
    moe_dispatch=peak.moe_dispatch,
    attention=peak.attention,
    layer_weights=peak.weights,
    layer_activations=peak.activations,
    fp8_copies=peak.fp8,
    host=saved_host + state["host_state"],
    device_total=max(step_total, state["update_phase"]),
    hbm=None if hbm_gib is None else int(hbm_gib * GIB),
    host_capacity=None if host_gib is None else int(host_gib * GIB),
    tflops_per_step=tflops,
    tokens_per_step=outside_tokens,
    step_total=step_total,
    **(_pipeline_fields(pipe, piped, inside=inside) if pipe else {}),
  )


def _state_fields(cfg: Any, leaves: list, rules: list, sizes: dict[str, int], pipe: stages.Stages | None) -> dict:
  """The estimate's state terms: parameters, Adam state (on the device), gradients, the re-laid-out copy,
  what the offload keys put on the host, and the update phase when the optimizer state is there (`_update`).
  Offloaded parameters stay in `params`: MaxText's step brings them to the device (module docstring)."""
  params, optimizer, grads, scan_copy = _state_bytes(cfg, leaves, rules, sizes, pipe)
  opt_off, params_off = bool(cfg.optimizer_memory_host_offload), bool(cfg.parameter_memory_host_offload)
  update = update_phase.of(params=params, grads=grads, optimizer=optimizer) if opt_off else 0
  return {
    "params": params,
    "optimizer": optimizer * (not opt_off),
    "grads": grads,
    "scan_copy": scan_copy,
    "stage_copy": 0,  # with pipeline stages, `stages.relaid_bytes`
    "host_state": optimizer * opt_off + params * params_off,
    "update_phase": update,
    "params_from_host": params_off,
  }


def _pipeline_fields(pipe: stages.Stages, piped: stages.PipelineMemory, *, inside: bool) -> dict:
  """The estimate's pipeline terms (`stages.py`); `inside`: the layer phase is a pipelined layer's."""
  return {
    "stages": pipe.stages,
    "microbatches": pipe.microbatches,
    "iterations": pipe.iterations,
    "microbatch_tokens": piped.microbatch_tokens,
    "pipeline_saved": piped.saved,
    "pipeline_buffers": piped.buffers if inside else 0,
    "pipeline_iteration": piped.iteration if inside else 0,
    "peak_layer": "pipelined" if inside else "outside the pipeline",
    "pipeline_bubble": pipe.bubble,
  }
