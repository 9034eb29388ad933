"""The optimizer update's memory when its state lives on the host (`offload: optimizer`, `optimizer_params`):
MaxText's train step moves the Adam state (and offloaded parameters) to the device for the update, and
XLA:GPU starts every leaf's host copies together, within its scheduler's memory target (`of`)."""

from typing import Any

from maxtext_moe.planner.layer_phase import dtype_bytes, opt_slots

# XLA:GPU's scheduler keeps its overlap within a memory target: 95% (--xla_gpu_memory_limit_slop_factor) of
# 80% of the device memory it compiles for, less the program's arguments (`GetSchedulerMemoryLimit` in
# XLA's GPU scheduler).
SCHEDULER_SLOP, SCHEDULER_SHARE = 0.95, 0.8


def of(cfg: Any, *, params: int, grads: int, optimizer: int, largest: int, hbm: int | None) -> int:
  """The optimizer update's bytes: the whole train state at once (`params`, `grads`, the `optimizer` state),
  as XLA:GPU starts every leaf's host copies together, unless its scheduler can keep the update within its
  memory target (`SCHEDULER_SLOP`, `SCHEDULER_SHARE`; `hbm`: the usable memory) with fewer leaves in flight,
  down to one (the `largest` leaf's elements: its moments, and its parameter when the parameters live on the
  host): then it holds the target. gb200-nvl72/deepseek3-671b holds 130.1 GiB, its target 128.9, of 159.1 at
  once (all of it compiled with 300 GiB); the 671B on 32 H100 nodes, whose update cannot meet its 55.3 with
  one leaf (58.8), holds it all (77.6, planned 79.7)."""
  whole = params + grads + optimizer
  if hbm is None:
    return whole
  mu_b, w_b = dtype_bytes(cfg.mu_dtype or cfg.weight_dtype), dtype_bytes(cfg.weight_dtype)
  from_host = bool(cfg.parameter_memory_host_offload)
  least = params + grads + largest * (opt_slots(cfg) * mu_b + w_b * from_host)
  arguments = params * (not from_host)  # on the device between steps: the program's arguments
  target = int(SCHEDULER_SLOP * (SCHEDULER_SHARE * hbm - arguments))
  return whole if least > target else max(least, min(whole, target))
