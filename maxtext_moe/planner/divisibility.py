"""Does a layout split every parameter evenly? The train state's arrays are jit arguments with explicit
shardings, and JAX refuses one whose dimension does not divide by its mesh axes (`IndivisibleError`), with
a traceback from deep inside MaxText's state construction. This finds them first, from the parameter tree
and the logical axis rules alone, and names the cheapest layout that divides.

Example: DeepSeek-V3's dense MLP kernel [7168, 18432] has its first dimension on ('fsdp', 'expert'); at
EP=8 x FSDP=9 that is 72 ways, and 7168 = 2^10 x 7 is not divisible by 9.
"""

import math
from dataclasses import dataclass
from typing import Any

from maxtext_moe.config import nodes
from maxtext_moe.errors import UserError
from maxtext_moe.moe.layout import mesh_sizes
from maxtext_moe.planner.shards import mesh_axes_of


@dataclass(frozen=True)
class Indivisible:
  """One parameter dimension that its mesh axes do not split evenly."""

  path: str
  dim: int
  size: int
  axes: tuple[str, ...]
  ways: int

  def line(self) -> str:
    return f"{self.path} dimension {self.dim} ({self.size}) does not split {self.ways} ways over mesh axes {self.axes}"


def rules_of(cfg: Any) -> list:
  """The logical axis rules the parameter tree traced without stages is checked by. With pipeline stages
  its `layers` stack (every layer of a Qwen3-MoE or Mixtral decoder, 94 for Qwen3-235B-A22B) is not what
  the `stage` axis splits: the pipelined layers are restacked per stage (`stages.py`), and whether they
  divide into the stages is the pipeline's own check (`config/stage_checks.py`)."""
  staged = bool(getattr(cfg, "using_pipeline_parallelism", False))
  return [
    (name, () if staged and name == "layers" else tuple(axes) if isinstance(axes, list) else axes)
    for name, axes in cfg.logical_axis_rules
  ]


def indivisible(leaves: list, rules: list, sizes: dict[str, int]) -> list[Indivisible]:
  """Every parameter dimension the layout `sizes` ({mesh axis: size}) does not split evenly."""
  found = []
  for path, shape, names in leaves:
    for dim, (size, axes) in enumerate(zip(shape, mesh_axes_of(names, rules), strict=True)):
      ways = math.prod(sizes.get(a, 1) for a in axes)
      if size % ways:  # named by the axes that split it (size > 1), as a reader counts the ways
        splitting = tuple(a for a in axes if sizes.get(a, 1) > 1)
        found.append(Indivisible("/".join(path), dim, size, splitting, ways))
  return found


def _splits(cfg: Any, num_devices: int) -> list[tuple[int, int, int, int]]:
  """(devices, ICI expert degree, ICI fsdp degree, DCN fsdp degree) to try: all the devices first (with the
  slices' FSDP degree traded for data parallelism, which replicates instead of splitting), then fewer;
  within each, the EP degree nearest the recipe's. The other degrees stay as they are."""
  slices = max(int(cfg.num_slices), 1)
  fixed = {a: d for a, d in zip(cfg.mesh_axes, cfg.ici_parallelism, strict=True) if a not in ("expert", "fsdp")}
  other = math.prod(d for d in fixed.values() if d > 0)
  ep = max(int(cfg.ici_expert_parallelism), 1)
  dcn_fsdp = max(int(cfg.dcn_fsdp_parallelism), 1)
  dcn_options = sorted((d for d in range(1, dcn_fsdp + 1) if dcn_fsdp % d == 0), reverse=True)
  per_node = nodes.gpus_per_node(cfg.recipe_hardware, int(getattr(cfg, "gpus_per_node", 0))) or 1
  out = []
  for per_slice in range(num_devices // slices, 0, -1):
    if per_slice % other or per_slice % per_node:  # whole nodes only: a job is so many nodes
      continue
    ici = per_slice // other
    eps = sorted((e for e in range(1, ici + 1) if ici % e == 0), key=lambda e: (abs(math.log(e / ep)), -e))
    for d in dcn_options if per_slice == num_devices // slices else [dcn_fsdp]:
      out += [(per_slice * slices, e, ici // e, d) for e in eps]
  return out


def _sizes(cfg: Any, devices: int, ep: int, fsdp: int, dcn_fsdp: int) -> dict[str, int]:
  sizes = mesh_sizes(cfg, devices)
  sizes["expert"] = ep * max(int(cfg.dcn_expert_parallelism), 1)
  sizes["fsdp"] = fsdp * dcn_fsdp
  return sizes


def _size(cfg: Any, devices: int) -> list[str]:
  """The override that makes the job `devices` devices: its node count on GPUs, the device count on CPU."""
  per_node = nodes.gpus_per_node(cfg.recipe_hardware, int(getattr(cfg, "gpus_per_node", 0)))
  return [f"nodes={devices // per_node}"] if per_node else [f"recipe_num_devices={devices}"]


def dividing_layout(cfg: Any, leaves: list, num_devices: int) -> list[str] | None:
  """The overrides of the nearest layout (most devices, then the EP degree nearest the recipe's) whose
  parameters all divide, or None."""
  rules = rules_of(cfg)
  dcn_fsdp = max(int(cfg.dcn_fsdp_parallelism), 1)
  for devices, ep, fsdp, dcn in _splits(cfg, num_devices):
    if int(cfg.num_experts) % (ep * max(int(cfg.dcn_expert_parallelism), 1)):
      continue
    if not indivisible(leaves, rules, _sizes(cfg, devices, ep, fsdp, dcn)):
      fix = [f"ici_expert_parallelism={ep}", f"ici_fsdp_parallelism={fsdp}"]
      if dcn != dcn_fsdp:
        data = max(int(cfg.dcn_data_parallelism), 1) * dcn_fsdp // dcn
        fix += [f"dcn_fsdp_parallelism={dcn}", f"dcn_data_parallelism={data}"]
      return fix + (_size(cfg, devices) if devices != num_devices else [])
  return None


def check(cfg: Any, leaves: list, num_devices: int) -> None:
  """Raises UserError (one line: the tensor, its dimension, the mesh axes, the nearest layout that divides)
  when this layout does not split every parameter evenly."""
  bad = indivisible(leaves, rules_of(cfg), mesh_sizes(cfg, num_devices))
  if not bad:
    return
  fix = dividing_layout(cfg, leaves, num_devices)
  hint = f"the nearest layout that divides: {' '.join(fix)}" if fix else "no EP x FSDP split of these devices divides"
  more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
  raise UserError(f"impossible layout on {num_devices} devices: {bad[0].line()}{more}; {hint}")
