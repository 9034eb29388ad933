"""Pipeline stages in the step-time model (`workload.py`), as MaxText runs them (`planner/stages.py` says
what was read in its code): I = M x R + delay x (S - 1) iterations, each running one layer per stage on one
microbatch.

- Compute: a device runs its stage's R layers on each of the M microbatches: the same FLOPs as every layer
  on its whole batch (MaxText's count is unchanged), its GEMMs at a microbatch's rows. The bubble's
  delay x (S - 1) iterations run every stage on filler, expert exchange included: their time is
  delay x (S - 1) / (M x R) of the pipelined layers' useful compute and exchange (`model.Pipeline`).
- Stage sends (`PipelineBase.get_new_loop_state`): per iteration a collective permute over `stage` of one
  microbatch's activations [microbatch, length, embed] for `shift` (the next stage's input: it waits for
  the iteration's output unless pipeline_delay_activation_forwarding sends the previous one), one for
  `state_io` and one for the circular storage when it is used (both beside the compute); the backward
  sends the same back. Over NVLink when the stages are inside a node, over the network when
  dcn_pipeline_parallelism > 1.
- Weight gathers: per iteration and layer of the stage (`fsdp.py`); kernels and the exchange's launches
  per iteration too.
"""

from typing import Any

from maxtext_moe.planner.layer_phase import dtype_bytes
from maxtext_moe.planner.stages import Stages, outside_layer_counts
from maxtext_moe.steptime.counts import gemm_shapes
from maxtext_moe.steptime.model import Pipeline, Transfer


def layer_runs(cfg: Any, pipe: Stages | None, dense_layers: int, moe_layers: int) -> tuple[int, int]:
  """(dense, MoE) layer runs per micro step: each layer once without stages; with them, the layers outside
  the pipeline once and a stage's layers once per iteration (the bubble's included)."""
  if pipe is None:
    return dense_layers, moe_layers
  dense, moe = outside_layer_counts(cfg, pipe)
  runs = pipe.iterations * pipe.layers_per_stage
  return (dense, moe + runs) if moe_layers else (dense + runs, moe)


def shapes(cfg: Any, pipe: Stages | None, rows: int, micro_rows: int, layers: tuple[int, int]) -> dict:
  """`counts.gemm_shapes` of every layer: outside the pipeline at `rows` per GEMM, the pipelined layers at a
  microbatch's `micro_rows`."""
  if pipe is None:
    return gemm_shapes(cfg, rows, *layers)
  dense, moe = outside_layer_counts(cfg, pipe)
  out = gemm_shapes(cfg, rows, dense, moe)
  piped = gemm_shapes(cfg, micro_rows, *((0, pipe.pipelined) if layers[1] else (pipe.pipelined, 0)))
  for cls in ("dense", "grouped"):
    out[cls] = out[cls] + piped[cls]
  return out


def pipeline(cfg: Any, pipe: Stages | None, flops: dict[str, float], layers: tuple[int, int]) -> Pipeline:
  """The bubble's terms: MaxText's S, R, M and delay, and the pipelined layers' shares of the compute (by
  FLOP class: their GEMMs' share of the class, attention's by layers, none of the unembedding) and of the
  expert exchange."""
  if pipe is None:
    return Pipeline()
  dense, moe = layers
  every = gemm_shapes(cfg, 1, dense, moe)
  piped = gemm_shapes(cfg, 1, *((0, pipe.pipelined) if moe else (pipe.pipelined, 0)))
  dense_share = sum(s[3] for s in piped["dense"]) / max(sum(s[3] for s in every["dense"]), 1e-30)
  exchange = pipe.pipelined / moe if moe else 0.0
  frac = {"dense": dense_share, "grouped": exchange, "attention": pipe.pipelined / (dense + moe)}
  share = sum(f * frac.get(cls, 0.0) for cls, f in flops.items()) / max(sum(flops.values()), 1e-30)
  return Pipeline(pipe.stages, pipe.repeats, pipe.microbatches, pipe.delay, share, exchange)


def sends(cfg: Any, pipe: Stages | None, sides: dict[str, tuple[int, int]], micro_tokens: int) -> list[Transfer]:
  """The stage-to-stage collective permutes of a step, forward and backward (see the module docstring)."""
  if pipe is None:
    return []
  one = micro_tokens * int(cfg.emb_dim) * dtype_bytes(cfg.dtype)
  domains = sides.get("stage", (1, 1))[1]
  n = 2 * pipe.iterations  # forward and backward
  where = "over the network" if domains > 1 else "over NVLink"
  shift = f"pipeline stage sends x{pipe.stages} ({where}; " + (
    "beside the compute)" if pipe.delay > 1 else "waited for)"
  )
  out = [Transfer(shift, "p2p", n * one, pipe.stages, domains, pipe.delay > 1, n)]
  rotations = 1 + pipe.circular_storage
  what = "state_io and circular storage" if pipe.circular_storage else "state_io"
  name = f"pipeline buffer rotations x{pipe.stages} ({where}; {what})"
  out.append(Transfer(name, "p2p", n * rotations * one, pipe.stages, domains, True, n * rotations))
  return out
