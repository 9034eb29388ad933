"""Wall-clock timing of jitted JAX calls: compile once, then the median of a few runs."""

import statistics
import time
from collections.abc import Callable
from typing import Any

import jax


def time_call(fn: Callable[..., Any], *args: Any, reps: int = 5, best: bool = False) -> float:
  """Median (or with `best`, minimum) seconds per call of `fn(*args)` after one warm-up call (which also
  compiles)."""
  jax.block_until_ready(fn(*args))
  times = []
  for _ in range(reps):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return min(times) if best else statistics.median(times)
