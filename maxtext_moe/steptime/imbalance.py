"""Routing imbalance: how much longer the expert GEMMs and the expert exchange take than at a perfect balance.

Under expert parallelism every rank holds `experts / ep` experts and waits, at the end of each MoE layer's
exchange, for the rank that received the most rows: the layer's expert GEMMs and its dispatch and combine
run at the busiest rank's rows, not the mean's. The model takes that as one factor, the mean over MoE
layers (and steps) of max/mean rows per EP rank, and multiplies the grouped GEMMs and the exchange by it.

Sources, in order: 1.0 for a published run that forces a balanced routing (Megatron's
`moe_router_force_load_balancing`: its figures are for exactly that); otherwise the load a run measured,
`moe_load.jsonl` (`plan --time --run RUN_DIR`, written by `maxtext-moe train` every `moe_load_every`
steps: each MoE layer's routed assignments per expert), grouped into the target's EP ranks the way MaxText
shards the expert axis (contiguous blocks of experts per rank); otherwise 1.0, said as unmeasured.
"""

import dataclasses
from pathlib import Path

import numpy as np

from maxtext_moe.errors import UserError
from maxtext_moe.runlog.files import LOAD, read_layers


@dataclasses.dataclass(frozen=True)
class Imbalance:
  factor: float  # mean over layers and steps of max/mean rows per EP rank; 1.0 balanced
  source: str


BALANCED = Imbalance(1.0, "1.0: the published run forces a balanced routing")
UNMEASURED = Imbalance(
  1.0,
  "1.0, unmeasured: no run given (plan --time --run RUN_DIR reads a run's moe_load.jsonl); natural routing is slower",
)


def per_rank(load: np.ndarray, ep: int) -> np.ndarray:
  """[..., E] rows per expert -> [..., ep] rows per EP rank (contiguous blocks of E / ep experts)."""
  experts = load.shape[-1]
  if experts % ep:
    raise UserError(f"{experts} experts do not split over {ep} EP ranks: pick an EP that divides the expert count")
  return load.reshape(*load.shape[:-1], ep, experts // ep).sum(-1)


def factor(load: np.ndarray, ep: int) -> float:
  """The mean over every leading index (steps, layers) of max/mean rows per EP rank; layers with no rows are
  skipped."""
  ranks = per_rank(np.asarray(load, np.float64), ep)
  mean = ranks.mean(-1)
  keep = mean > 0
  if not keep.any():
    return 1.0
  return float((ranks.max(-1)[keep] / mean[keep]).mean())


def from_run(run_dir: Path, ep: int, num_experts: int) -> Imbalance:
  """The imbalance `run_dir`'s moe_load.jsonl measured, at `ep` ranks, over its second half of rows (the
  routing bias settles first); one line of UserError when the run has no load or a different expert count."""
  path = Path(run_dir) / LOAD
  if not Path(run_dir).is_dir():
    raise UserError(f"--run {run_dir}: not a directory (give a maxtext-moe train run's RUN_DIR)")
  if not path.is_file():
    raise UserError(
      f"--run {run_dir}: no {LOAD} (train writes it every moe_load_every steps; run with moe_load_every=N > 0)"
    )
  try:
    layers = read_layers(path)
  except (KeyError, TypeError, ValueError) as e:  # a row without "load", or layers of different sizes
    raise UserError(f"--run {run_dir}: {LOAD} is not a maxtext-moe load file ({type(e).__name__}: {e})") from e
  if layers is None:
    raise UserError(f"--run {run_dir}: {LOAD} holds no complete row yet (let the run reach moe_load_every steps)")
  steps, load, _ = layers
  if load.shape[-1] != num_experts:
    raise UserError(
      f"--run {run_dir} routed {load.shape[-1]} experts, the recipe has {num_experts}: give a run of the same model"
    )
  half = load[len(steps) // 2 :]
  used = steps[len(steps) // 2 :]
  value = 1.0 if ep <= 1 else factor(half, ep)
  where = f"steps {int(used[0])}-{int(used[-1])}" if len(used) > 1 else f"step {int(used[0])}"
  return Imbalance(
    value, f"{value:.3f}: measured by {run_dir} ({LOAD}, {where}, {load.shape[1]} MoE layers) at EP {ep}"
  )
