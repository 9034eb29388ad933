"""Before a cluster job is written or fanned out: `plan`'s verdict as one line, so a layout that does not fit
fails on the submitting machine (`k8s`) or the batch host (`plan --check`, the first step of
scripts/slurm/train.sbatch), not after every node was scheduled.

The node layout (whole NVLink domains, the DCN degrees, the nearest node counts that divide) is the
recipe's resolution (config/nodes.py) and the tensor divisibility planner/divisibility.py's, both reached
through `memory_plan`; the memory verdict and its cheapest fix are `memory_plan`'s own. A local checkpoint
the recipe loads is checked against its model first (checkpoint/model_check.py). Nothing is re-derived here.
"""

from dataclasses import dataclass
from typing import Any

from maxtext_moe.checkpoint import model_check
from maxtext_moe.config.checkpointing import Retention
from maxtext_moe.errors import UserError
from maxtext_moe.planner.estimate import GIB, Estimate
from maxtext_moe.planner.memory_plan import MemoryPlan, memory_plan
from maxtext_moe.planner.planning import planning

_LAUNCHER_KEYS = ("nodes", "run_name", "base_output_directory")  # what the launchers add: not the layout's


def _size(n: int) -> str:
  """Decimal units, as file systems' bandwidths are given: 32.1 GB, 257 GB, 12.3 MB."""
  for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
    if n >= scale:
      return f"{n / scale:,.{0 if n >= 100 * scale else 1}f} {unit}"
  return f"{n:,} bytes"


def state_bytes(e: Estimate) -> int:
  """One GPU's share of the train state a checkpoint writes: the float32 parameters and Adam's mu and nu,
  wherever offload keeps them (device or host)."""
  return e.params + e.optimizer + e.host_state - (e.params if e.params_from_host else 0)


@dataclass(frozen=True)
class Verdict:
  """A layout that fits: the plan, what one checkpoint of it writes, and what the kept ones take."""

  plan: MemoryPlan
  retention: Retention | None = None
  planned: Any = None  # the recipe's `planner.planning` (a launcher's step-time model takes it too)

  @property
  def gpus_per_node(self) -> int:
    return max(self.plan.num_devices // max(self.plan.nodes, 1), 1)

  @property
  def state_per_gpu(self) -> int:
    return state_bytes(self.plan.base)

  @property
  def checkpoint_bytes(self) -> int:
    """One checkpoint of the job: every GPU's share once (data-parallel replicas hold the same state)."""
    return self.state_per_gpu * self.plan.num_devices // max(self.plan.layout.get("data", 1), 1)

  def line(self) -> str:
    """'RECIPE on N node(s) fits: X GiB of Y per GPU; a checkpoint writes A GB per GPU, B GB per node, C TB per job;
    the kept checkpoints take ...' (`Retention.on_disk`)."""
    e, p = self.plan.base, self.plan
    room = f"{e.device_total / GIB:.1f} GiB of {e.hbm / GIB:.1f} usable per GPU" if e.hbm else "no memory limit"
    per_node = self.state_per_gpu * self.gpus_per_node
    what = "devices" if p.hardware.value == "cpu" else "GPUs"
    return (
      f"{p.recipe} on {p.nodes} node(s), {p.num_devices} {what}, fits ({room}); a checkpoint's train state is "
      f"{_size(self.state_per_gpu)} per {what[:-1]}, {_size(per_node)} per node, {_size(self.checkpoint_bytes)} per job"
      + (f"; {self.retention.on_disk(self.checkpoint_bytes, _size)}" if self.retention else "")
    )


def check(
  recipe: str, overrides: list[str], *, gpus: int | None = None, gpu_mem_gib: float | None = None, job: Any = None
) -> Verdict:
  """`plan RECIPE overrides` as a launcher must take it: a local checkpoint that does not hold the model's
  parameters, a layout that does not divide, or one that plan says does not fit, is a UserError (one line,
  with the fix); else the verdict. The recipe is resolved once (`planner.planning`; `job`: its config where
  the launcher has it already) for all three."""
  planned = planning(recipe, overrides, gpus, gpu_mem_gib, job=job)
  ctx, cfg = planned
  staged = int(cfg.ici_pipeline_parallelism) * int(cfg.dcn_pipeline_parallelism) > 1
  model_check.check(cfg, model_check.ModelTree(str(cfg.model_name), ctx.leaves, staged=staged))
  p = memory_plan(recipe, overrides, planned=planned)  # layout, divisibility: raised here
  e = p.base
  if e.fits:
    return Verdict(p, Retention.of({key: getattr(cfg, key, None) for key in Retention.KEYS}), planned)
  own = [o for o in overrides if o.partition("=")[0] not in _LAUNCHER_KEYS]
  where = f"maxtext-moe plan {' '.join([recipe, *own])} --nodes {p.nodes} shows the estimate"
  if e.hbm is not None and e.device_total > e.hbm:
    need = f"{e.device_total / GIB:.1f} GiB per GPU at the peak, {e.hbm / GIB:.1f} usable"
  else:
    need = f"{e.host / GIB:.1f} GiB of host memory per GPU, {(e.host_capacity or 0) / GIB:.1f} there"
  if p.fix is not None:
    fix = f"cheapest fix ({p.fix_kind}): {p.fix_words()} ({p.fix.device_total / GIB:.1f} GiB per GPU)"
  else:
    fix = (
      f"no offload preset, EP/FSDP split or smaller micro-batch fits ({p.tried} tried): 'maxtext-moe plan MODEL "
      "--gpu GPU --nodes N --search' finds a layout that does"
    )
  raise UserError(f"{recipe} on {p.nodes} node(s) does not fit: {need} ({where}); {fix}")
