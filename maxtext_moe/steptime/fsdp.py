"""The parameters' collectives in the step-time model: FSDP gathers of the weights, reduce-scatters of
their gradients, and all-reduces of the gradient shards over the axes that replicate them (`data`, and
with pipeline stages `stage` for the weights outside the pipeline).

Every parameter leaf is gathered before its use in the forward and again in the backward, over the mesh
axes that shard it except the experts' axis on its expert dimension and the tensor axes (which our MoE
block gathers from its expert weights too, `planner/shards.stays_split`), and its gradient
reduce-scattered over the same group, both in the compute dtype (as XLA:GPU's compiled programs do); our
block's expert weights are gathered as FP8 codes under moe_gemm_quantization=fp8 (`moe.fp8_gather`). With
pipeline stages (`planner/stages.py`) a pipelined layer's weights are gathered per iteration and layer of
the stage, bubble included: MaxText hands each iteration its stage's weights still split over FSDP
(`NNXPipeline.get_current_stage_weights`), and the layer gathers them as without stages; their gradients
are reduce-scattered per iteration likewise (the gather's transpose, inside the scan's backward). With
vocab tiling the output head is gathered per chunk (`head_runs`), and the batch's hidden states whole
(`_tiled_loss_gathers`).
"""

import math
from typing import Any

from maxtext_moe.moe.layout import fp8_gathered
from maxtext_moe.planner.layer_phase import dtype_bytes, our_block
from maxtext_moe.planner.loss_phase import batch_split, tiled_batch_gathered, tiles
from maxtext_moe.planner.shards import mesh_axes_of, stays_split
from maxtext_moe.planner.stages import Stages
from maxtext_moe.steptime.model import Transfer

Sides = dict[str, tuple[int, int]]


def _split(
  names: tuple, rules: list, sides: Sides, skip: str | None = None, in_block: bool = False
) -> tuple[int, int, int]:
  """(ways a leaf stays split while computed with, ways it is gathered, NVLink domains the gather spans),
  leaving out the dimension of logical name `skip` (one layer of a stack); `in_block`: our MoE block
  computes with it (an expert weight: its tensor axes gathered too, `shards.stays_split`)."""
  gathered = kept = domains = 1
  in_block = in_block and "exp" in names
  for name, axes in zip(names, mesh_axes_of(names, rules), strict=True):
    for axis in axes if name != skip else ():
      ici, dcn = sides.get(axis, (1, 1))
      if stays_split(axis, name, in_block=in_block):
        kept *= ici * dcn
      else:
        gathered *= ici * dcn
        domains *= dcn
  return kept, gathered, domains


def param_splits(cfg: Any, leaves: list, rules: list, sides: Sides, pipe: Stages | None = None) -> list[tuple]:
  """(bytes per GPU as computed with and gathered per step, ways gathered, NVLink domains the gather spans,
  launches (a scanned leaf is gathered layer by layer), shard bytes per GPU, outside the pipeline) of every
  parameter leaf; the pipelined stack's as two rows, its layers outside the pipeline and its stage's."""
  # XLA:GPU gathers the weights after their cast to the compute dtype (seen in the gb300x1024 compile:
  # float32 weights, bfloat16 all-gathers), and reduce-scatters their gradients in it too.
  w_b = min(dtype_bytes(cfg.weight_dtype), dtype_bytes(cfg.dtype))
  in_block = our_block(cfg)
  fp8 = in_block and fp8_gathered(cfg)
  out = []
  for path, shape, names in leaves:
    if path[0] != "params":
      continue
    total = math.prod(shape) * w_b
    wire = 1.0 / w_b if fp8 and "exp" in names else 1.0  # our block's expert weights gathered as e4m3 codes
    if pipe is not None and pipe.stack in names:
      out += [(*r, wire) for r in _pipelined_rows(total / pipe.stack_layers, names, rules, sides, pipe, in_block)]
      continue
    kept, gathered, domains = _split(names, rules, sides, in_block=in_block)
    launches = shape[names.index("layers")] if "layers" in names else 1
    runs = head_runs(cfg, path)
    out.append((total / kept * runs, gathered, domains, launches * runs, total / kept / gathered, True, wire))
  return out


def head_runs(cfg: Any, path: tuple[str, ...]) -> int:
  """How many times a step gathers leaf `path` per pass: with `num_vocab_tiling` n > 1 the output head is
  gathered in each of the tiled loss's n chunks, in its forward scan and again in its backward's (its
  gradient reduce-scattered per chunk likewise): XLA:GPU's 16B-proxy program at n = 4 gathers it inside
  both loops' bodies. Every other leaf, and the head without tiling: once."""
  n = tiles(cfg)
  head = ("decoder", "logits_dense") if not bool(getattr(cfg, "logits_via_embedding", False)) else ("token_embedder",)
  return n if n > 1 and tuple(path[1 : 1 + len(head)]) == head else 1


def _pipelined_rows(layer: float, names: tuple, rules: list, sides: Sides, pipe: Stages, in_block: bool) -> list[tuple]:
  """`param_splits`'s rows of the pipelined stack, from one layer's bytes: the layers outside the pipeline
  gathered once each, the stage's per iteration and layer of the stage. Launches as for a stack without
  stages: one per layer of a `layers` stack, one per pass over a DeepSeek `moe_layers` stack (so per
  iteration for a stage's layers), so that a layout with stages and one without are counted alike."""
  kept, gathered, domains = _split(names, rules, sides, skip=pipe.stack, in_block=in_block)
  one, per_layer = layer / kept, pipe.stack == "layers"
  runs = pipe.iterations * pipe.layers_per_stage
  launches = runs if per_layer else pipe.iterations
  rows = [(one * runs, gathered, domains, launches, one / gathered * pipe.per_stage, False)]
  if pipe.outside:
    launches = pipe.outside if per_layer else 1
    rows.append((one * pipe.outside, gathered, domains, launches, one / gathered * pipe.outside, True))
  return rows


def transfers(cfg: Any, leaves: list, rules: list, sides: Sides, pipe: Stages | None = None) -> list[Transfer]:
  """The weights' gathers (forward and backward) and their gradients' reductions, per group."""
  splits = param_splits(cfg, leaves, rules, sides, pipe)
  by_group: dict[tuple[int, int], list[float]] = {}
  for gathered, group, domains, launches, *_, wire in splits:
    if group > 1:
      row = by_group.setdefault((group, domains), [0.0, 0.0, 0.0])
      row[0] += gathered
      row[1] += launches
      row[2] += gathered * wire  # on the wire: FP8-gathered expert weights at 1 byte a value
  out = []
  for (group, domains), (nbytes, n, moved) in sorted(by_group.items()):
    where = f"x{group}" + (f" over {domains} NVLink domains" if domains > 1 else "")
    out.append(Transfer(f"FSDP weight all-gathers {where}", "all-gather", 2 * moved, group, domains, True, 2 * n))
    out.append(Transfer(f"gradient reduce-scatters {where}", "reduce-scatter", nbytes, group, domains, True, n))
  data_ici, data_dcn = sides.get("data", (1, 1))
  if data_ici * data_dcn > 1:  # every gradient shard a GPU holds, the experts' (never gathered) included
    shard = sum(row[4] for row in splits)
    name = f"gradient all-reduce x{data_ici * data_dcn} (data)"
    out.append(Transfer(name, "all-reduce", shard, data_ici * data_dcn, data_dcn, True))
  out += _tiled_loss_gathers(cfg, rules, sides)
  if pipe is not None:  # outside the pipeline `stage` splits the batch like data: their gradients summed
    stage_ici, stage_dcn = sides.get("stage", (1, 1))
    shard = sum(row[4] for row in splits if row[5])
    name = f"gradient all-reduce x{pipe.stages} (stage: the weights outside the pipeline)"
    out.append(Transfer(name, "all-reduce", shard, stage_ici * stage_dcn, stage_dcn, True))
  return out


def _tiled_loss_gathers(cfg: Any, rules: list, sides: Sides) -> list[Transfer]:
  """The whole batch's hidden states gathered on every device for MaxText's tiled loss, where XLA does that
  (`planner.loss_phase.tiled_batch_gathered`): the 671B's program at 256 GPUs gathers the bf16
  [768, 4096, 7168] twice a step (forward and backward), waited for."""
  if not tiled_batch_gathered(cfg, rules, sides):
    return []
  group, domains = batch_split(rules, sides)
  whole = float(cfg.per_device_batch_size) * int(cfg.max_target_length) * group * int(cfg.emb_dim)
  name = f"vocab tiling: the batch's hidden states gathered x{group}"
  return [Transfer(name, "all-gather", 2 * whole * dtype_bytes(cfg.dtype), group, domains, False, 2)]
