"""Checks on MaxText's pipeline stages (`checks.ALL_CHECKS` runs `check_pipeline_for_moe`; the resolution
runs `check_pipeline_divides_layers` where MaxText asserts), one `ValueError` line each, as in `checks`."""

import math
from typing import Any

from maxtext_moe.config.quantization import quantization_name
from maxtext_moe.moe.layout import mesh_sizes


def pipeline_stages(cfg: Any) -> int:
  return int(getattr(cfg, "ici_pipeline_parallelism", 1)) * int(getattr(cfg, "dcn_pipeline_parallelism", 1))


def check_pipeline_for_moe(cfg: Any) -> None:
  """MaxText's pipeline stages with MoE layers run through the seam (upstream/pipeline/moe_stages.py: the routing bias
  among a stage's weights, the expert loads folded from the pipeline's iterations, repeats included, one
  bias update per step) with our block, for any decoder; what it does not run is refused here."""
  stages = pipeline_stages(cfg)
  if stages <= 1 or int(cfg.num_experts) <= 1:
    return
  if str(cfg.moe_impl) != "dropless":
    why = (
      "MaxText's own MoE block takes a routing-bias sign per microbatch inside the pipeline, not one per step"
      if cfg.routed_bias
      else "only our block is checked against training without stages"
    )
    raise ValueError(f"pipeline stages ({stages}) with moe_impl={cfg.moe_impl}: {why}; set moe_impl=dropless")
  if str(cfg.moe_dispatch) == "te_ep":
    raise ValueError(
      f"moe_dispatch=te_ep does not run inside pipeline stages ({stages}): TE's NCCL EP is not vmapped over "
      "the stages; use moe_dispatch=auto (all_to_all under stages)"
    )
  if str(cfg.moe_gemm_backend) == "te" or str(cfg.moe_gemm_quantization) != "none":
    raise ValueError(
      f"moe_gemm_backend={cfg.moe_gemm_backend} moe_gemm_quantization={cfg.moe_gemm_quantization} does not run "
      f"inside pipeline stages ({stages}): Transformer Engine's grouped GEMM and quantize cannot be vmapped over "
      "the stages (their batching rules fail as the step is traced); use moe_gemm_backend=auto (tokamax under "
      "stages) and moe_gemm_quantization=none"
    )
  if getattr(cfg, "pipeline_fsdp_ag_per_repeat", False):
    raise ValueError(
      "pipeline_fsdp_ag_per_repeat=true with MoE layers: MaxText's prefetching pipeline keeps only the layer "
      "records it held before the step (none), so the expert loads and the routing-bias update are lost; set "
      "pipeline_fsdp_ag_per_repeat=false"
    )
  if float(getattr(cfg, "load_balance_loss_weight", 0.0)) > 0.0:
    raise ValueError(
      f"pipeline stages ({stages}) with load_balance_loss_weight={cfg.load_balance_loss_weight}: MaxText "
      "averages the pipelined layers' load-balance loss over the pipeline's iterations, the bubble's included, "
      "not over the step's tokens; set load_balance_loss_weight=0, or train without stages"
    )


# Transformer Engine 2.20's quantize primitives cannot be vmapped: current scaling's amax has no batching
# rule, and the quantize's drops an argument it then binds with (a TypeError at trace time, before any
# compile). MaxText's pipeline vmaps each stage's layers over the stages, TE's dense projections with them.
TE_QUANTIZED_DENSE = ("te_fp8_currentscaling", "te_fp8_delayedscaling", "te_mxfp8", "te_nvfp4", "te_nvfp4_no_rht")


def check_pipeline_quantization(cfg: Any) -> None:
  """A `quantization` whose dense GEMMs are TE's quantized ones does not trace under pipeline stages."""
  stages, name = pipeline_stages(cfg), quantization_name(cfg)
  if stages > 1 and name in TE_QUANTIZED_DENSE:
    raise ValueError(
      f"quantization={name} does not run inside pipeline stages ({stages}): Transformer Engine's quantize "
      "cannot be vmapped over the stages (its batching rules fail as the step is traced); set "
      "quantization=fp8 (Flax's FP8, XLA's GEMM), or train without stages"
    )


def check_microbatch_splits(cfg: Any, num_devices: int | None = None) -> None:
  """MaxText's pipeline splits each microbatch's sequences over a stage's devices on the axes its rule for
  `activation_batch` names (`stages_in_spec`; `stage` is the stages' own dimension): a microbatch of fewer
  sequences, or a count that does not divide, is a shard_map error from inside its loop (`_shift_right`),
  after MaxText's own checks pass (they only ask that the microbatches divide the batch). `num_devices`: the
  job's (`launch.preflight`), default the recipe's; nothing is checked where neither is known."""
  stages, micro = pipeline_stages(cfg), int(getattr(cfg, "num_pipeline_microbatches", -1))
  devices = int(getattr(cfg, "recipe_num_devices", -1)) if num_devices is None else num_devices
  if stages <= 1 or micro <= 0 or devices <= 0:
    return
  batch = next((axes for name, axes in cfg.logical_axis_rules if name == "activation_batch"), ())  # the first
  axes = (batch,) if isinstance(batch, str) else tuple(batch)
  sizes = mesh_sizes(cfg, devices)
  ways = math.prod(sizes.get(a, 1) for a in axes if a != "stage")
  sequences = int(devices * float(cfg.per_device_batch_size))  # MaxText's micro_batch_size_to_train_on there
  if sequences % (micro * ways) == 0:
    return
  fits = [m for m in range(stages, sequences // ways + 1, stages) if (sequences // ways) % m == 0]
  split = " x ".join(f"{a}={sizes[a]}" for a in axes if a != "stage" and sizes.get(a, 1) > 1)
  fix = (
    f"num_pipeline_microbatches={max(m for m in fits if m <= micro) if any(m <= micro for m in fits) else fits[0]}"
    if fits and sequences % ways == 0
    else f"per_device_batch_size so that the {sequences:,} sequences split {micro * ways:,} ways"
  )
  raise ValueError(
    f"pipeline stages: {micro} microbatches of the step's {sequences:,} sequences do not split over a stage's "
    f"{ways} devices on the batch ({split}): each microbatch is {sequences / micro:g} sequences; set {fix}"
  )


def check_pipeline_divides_layers(cfg: Any) -> None:
  """The pipelined layers (pipeline_parallel_layers, resolved) split into stages x layers per stage x
  repeats. MaxText asserts it while it derives the repeats; called there (`upstream.resolution`) to say what
  to set, on a config whose later keys are not derived yet."""
  stages, lps = pipeline_stages(cfg), int(cfg.num_layers_per_pipeline_stage)
  pipelined, repeats = int(cfg.pipeline_parallel_layers), int(cfg.num_pipeline_repeats)
  if (
    stages <= 1
    or lps < 1
    or (pipelined % (stages * lps) == 0 if repeats == -1 else stages * lps * repeats == pipelined)
  ):
    return
  raise ValueError(_not_dividing(cfg, stages, lps, pipelined, repeats))


def _not_dividing(cfg: Any, stages: int, lps: int, pipelined: int, repeats: int) -> str:
  """The line for pipelined layers that do not split into the stages: what they are and what to set."""
  per_visit = stages * lps
  if repeats != -1 and pipelined % per_visit == 0:
    fixes = [f"num_pipeline_repeats={pipelined // per_visit} (or -1: derived)"]
  else:
    fixes = ["num_pipeline_repeats=-1 (derived)"] if repeats != -1 else []
    if pipelined % stages == 0:
      fits = [d for d in range(1, pipelined // stages + 1) if pipelined // stages % d == 0 and d != lps]
      fixes.append(
        "num_layers_per_pipeline_stage="
        + (" or ".join(map(str, fits)) if len(fits) <= 6 else f"a divisor of {pipelined // stages}")
      )
    fit = per_visit * (pipelined // per_visit)
    if 0 < fit < pipelined:
      fixes.append(f"pipeline_parallel_layers={fit} (the other {pipelined - fit} run outside the pipeline)")
    fixes.append(f"a stage count (ici_pipeline_parallelism x dcn_pipeline_parallelism) that divides {pipelined}")
  shown = f" x num_pipeline_repeats={repeats}" if repeats != -1 else ""
  which = "MoE layers" if str(getattr(cfg.decoder_block, "value", cfg.decoder_block)) == "deepseek" else "layers"
  return (
    f"pipeline stages: the {pipelined} pipelined layers (pipeline_parallel_layers; by default all the decoder's "
    f"{which}) do not split into {stages} stages x num_layers_per_pipeline_stage={lps}{shown}; set "
    + ", or ".join(fixes)
  )
