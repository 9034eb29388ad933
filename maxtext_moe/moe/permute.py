"""Index math for routing rows to experts: sort, group sizes, inverse permutation, per-rank dedup.

Pure functions over integer arrays; every one has a worked example that tests/test_moe_permute.py checks.
Shape legend: T tokens, K top-k, R = T*K routed rows, E experts, P ranks, N tiles, M tile rows.
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


class TilePlan(NamedTuple):
  """One tile size's worth of work: tile i multiplies rows [start_N[i], start_N[i] + valid_N[i]) with
  expert expert_N[i]'s weight. Only the first `count` of the N (static worst case) entries are real."""

  tile_rows: int
  expert_N: jax.Array
  start_N: jax.Array
  valid_N: jax.Array
  count: jax.Array


def tile_plan(group_sizes_E: jax.Array, *, num_rows: int, tile_sizes: tuple[int, ...]) -> list[TilePlan]:
  """Covers each expert's rows with big tiles first, then smaller ones, so padding stays under the
  smallest tile per expert. Tile counts are dynamic; array sizes are the static worst case.

  Example: group_sizes_E = [5, 0, 2], num_rows=7, tile_sizes=(4, 2)
    level M=4: one full tile of expert 0 at row 0            -> expert [0], start [0], valid [4], count 1
    level M=2: expert 0's last row at 4, expert 2's rows at 5 -> expert [0, 2], start [4, 5], valid [1, 2]
  (unused worst-case entries follow each level's `count` real ones).
  """
  num_experts = group_sizes_E.shape[0]
  start_E = jnp.cumsum(group_sizes_E) - group_sizes_E
  covered_E = jnp.zeros_like(group_sizes_E)
  plans = []
  for level, m in enumerate(tile_sizes):
    last = level == len(tile_sizes) - 1
    remaining_E = group_sizes_E - covered_E
    tiles_E = -(-remaining_E // m) if last else remaining_E // m
    cum_E = jnp.cumsum(tiles_E)
    i_N = jnp.arange(num_rows // m + (num_experts if last else 0))
    expert_N = jnp.minimum(jnp.searchsorted(cum_E, i_N, side="right"), num_experts - 1)
    first_row_N = start_E[expert_N] + covered_E[expert_N] + (i_N - (cum_E[expert_N] - tiles_E[expert_N])) * m
    valid_N = jnp.clip(start_E[expert_N] + group_sizes_E[expert_N] - first_row_N, 0, m)
    plans.append(
      TilePlan(m, expert_N.astype(jnp.int32), first_row_N.astype(jnp.int32), valid_N.astype(jnp.int32), cum_E[-1])
    )
    covered_E = covered_E + tiles_E * m
  return plans
