"""The optimizer update's memory when its state lives on the host (`offload: optimizer`, `optimizer_params`):
MaxText's train step moves the Adam state (and offloaded parameters) to the device for the update, and
XLA:GPU starts every leaf's host copies together, within its scheduler's memory target (`of`)."""

from typing import Any

from maxtext_moe.planner.layer_phase import dtype_bytes, opt_slots

# XLA:GPU's scheduler keeps its overlap within a memory target: 95% (--xla_gpu_memory_limit_slop_factor) of
# the device memory it compiles for, less the program's arguments (`GetSchedulerMemoryLimit` in XLA's GPU
# scheduler; on a GPU JAX compiles for its allocator's limit, the usable HBM).
SCHEDULER_SLOP = 0.95


def of(cfg: Any, *, params: int, grads: int, optimizer: int, largest: int, hbm: int | None) -> int:
  """The optimizer update's bytes: the whole train state at once (`params`, `grads`, the `optimizer` state),
  as XLA:GPU starts every leaf's host copies together, unless its scheduler can keep the update within its
  memory target (`SCHEDULER_SLOP`; `hbm`: the usable memory) with fewer leaves in flight,
  down to one (the `largest` leaf's elements: its moments, and its parameter when the parameters live on the
  host): then it holds the target. gb200-nvl72/deepseek3-671b's target (161.1 GiB) is above its whole state
  (159.1), which its program holds: 158.9 compiled for its 169.6 GiB (given 80% of that, as `compile` gave
  XLA until December 2026, it held its target then, 130.1 GiB live of 128.9)."""
  whole = params + grads + optimizer
  if hbm is None:
    return whole
  mu_b, w_b = dtype_bytes(cfg.mu_dtype or cfg.weight_dtype), dtype_bytes(cfg.weight_dtype)
  from_host = bool(cfg.parameter_memory_host_offload)
  least = params + grads + largest * (opt_slots(cfg) * mu_b + w_b * from_host)
  arguments = params * (not from_host)  # on the device between steps: the program's arguments
  target = int(SCHEDULER_SLOP * (hbm - arguments))
  return whole if least > target else max(least, min(whole, target))
