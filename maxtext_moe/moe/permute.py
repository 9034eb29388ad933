"""Index math for routing rows to experts: sort, group sizes, inverse permutation, per-rank dedup.

Pure functions over integer arrays; every one has a worked example that tests/test_moe_permute.py checks.
Shape legend: T tokens, K top-k, R = T*K routed rows, E experts, P ranks, L window sizes.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp


def sort_by_expert(ids_TK: jax.Array, *, num_experts: int) -> tuple[jax.Array, jax.Array]:
  """Orders the flattened routed rows by expert (stable) and counts rows per expert.

  Example: ids_TK = [[2, 0], [0, 1]] (flattened rows 0..3 go to experts 2, 0, 0, 1)
    -> order_R = [1, 2, 3, 0], group_sizes_E = [2, 1, 1] (num_experts=3).

  Returns:
    order_R: row r of the sorted layout is flattened routed row order_R[r] (token order_R[r] // K).
    group_sizes_E: rows per expert, summing to R.
  """
  flat_R = ids_TK.reshape(-1)
  order_R = jnp.argsort(flat_R, stable=True)
  group_sizes_E = jnp.bincount(flat_R, length=num_experts).astype(jnp.int32)
  return order_R, group_sizes_E


def inverse_permutation(order_R: jax.Array) -> jax.Array:
  """inv[order[r]] = r, so that sorted[inv] restores the original order.

  Example: order_R = [1, 2, 3, 0] -> inv_R = [3, 0, 1, 2].
  """
  return jnp.zeros_like(order_R).at[order_R].set(jnp.arange(order_R.shape[0], dtype=order_R.dtype))


def distinct_ranks(ids_TK: jax.Array, *, experts_per_rank: int, num_ranks: int) -> jax.Array:
  """Which expert-parallel ranks each token must reach: a token is sent once to each rank that hosts at
  least one of its top-k experts (deduplication), instead of once per expert.

  Example: ids_TK = [[0, 1], [1, 6]], experts_per_rank=2, num_ranks=4
    -> needs_TP = [[True, False, False, False], [True, False, False, True]]
    (token 0's experts 0 and 1 both live on rank 0: one row on the wire instead of two).
  """
  rank_TK = ids_TK // experts_per_rank
  return (rank_TK[:, :, None] == jnp.arange(num_ranks)[None, None, :]).any(axis=1)


def expected_distinct_ranks(*, num_experts: int, top_k: int, num_ranks: int) -> float:
  """E[#distinct ranks per token] when top-k experts are a uniform random k-subset of E experts.

  A rank with E/P experts is missed with probability C(E - E/P, k) / C(E, k).
  Example: E=4, k=2, P=2 -> 2 * (1 - C(2,2)/C(4,2)) = 2 * (1 - 1/6) = 5/3.
  """
  from math import comb

  per_rank = num_experts // num_ranks
  return num_ranks * (1 - comb(num_experts - per_rank, top_k) / comb(num_experts, top_k))


class WindowPlan(NamedTuple):
  """One row window per expert: expert e multiplies rows [start_E[e], start_E[e] + group_sizes_E[e]) and
  reads them through a window of sizes[level_E[e]] rows that begins at window_start_E[e]; level_E[e] is
  -1 for an expert without rows."""

  sizes: tuple[int, ...]
  level_E: jax.Array
  start_E: jax.Array
  window_start_E: jax.Array


def window_sizes(num_rows: int, *, smallest: int = 16, growth: float = 1.125) -> tuple[int, ...]:
  """A ladder of static window sizes from `smallest` up to `num_rows`: each a multiple of `smallest`, at
  least `smallest` and at most (growth - 1) times the previous size more than it, so that rounding a group
  up to the next size wastes under `smallest` rows or (growth - 1) of its rows, whichever is more.

  Example: num_rows=100, smallest=16 -> (16, 32, 48, 64, 80, 96, 100).
  """
  sizes, m = [], smallest
  while m < num_rows:
    sizes.append(m)
    m += max(smallest, int(m * (growth - 1)) // smallest * smallest)
  return (*sizes, max(num_rows, 1))


def window_plan(group_sizes_E: jax.Array, *, num_rows: int, sizes: tuple[int, ...]) -> WindowPlan:
  """Gives each expert the smallest window size that holds its rows. A window that would run past the
  last row is moved back so that it ends there; it still covers the expert's rows because every size is
  <= num_rows. Rows of other experts inside a window are masked by the caller.

  Example: group_sizes_E = [5, 0, 2], num_rows=7, sizes=(2, 4, 7)
    -> level_E = [2, -1, 0] (5 rows need the 7-row window, 2 rows fit the 2-row one),
       start_E = [0, 5, 5], window_start_E = [0, 5, 5].
  """
  start_E = (jnp.cumsum(group_sizes_E) - group_sizes_E).astype(jnp.int32)
  sizes_L = jnp.array(sizes, jnp.int32)
  level_E = jnp.searchsorted(sizes_L, group_sizes_E, side="left").astype(jnp.int32)
  level_E = jnp.where(group_sizes_E > 0, jnp.minimum(level_E, len(sizes) - 1), -1)
  window_start_E = jnp.minimum(start_E, num_rows - sizes_L[jnp.maximum(level_E, 0)])
  return WindowPlan(sizes, level_E, start_E, jnp.maximum(window_start_E, 0).astype(jnp.int32))
