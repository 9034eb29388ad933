"""Index math for routing rows to experts: sort, group sizes, inverse permutation, per-rank dedup.

Pure functions over integer arrays; every one has a worked example that tests/test_moe_permute.py checks.
Shape legend: T tokens, K top-k, R = T*K routed rows, E experts, P ranks, N tiles, M tile rows.
"""

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


def tile_layout(group_sizes_E: jax.Array, *, num_rows: int, tile_rows: int) -> tuple[jax.Array, jax.Array, int]:
  """Places expert-sorted rows into tiles of `tile_rows` rows, each tile holding one expert only.

  Each expert's group starts on a fresh tile; the tail of its last tile is padding. The tile count is
  the static worst case N = ceil(R / M) + E, so nothing is ever dropped.

  Example: group_sizes_E = [3, 0, 2], num_rows=5, tile_rows=2 -> N = 3 + 3 = 6 tiles,
    dest_R = [0, 1, 2, 4, 5] (expert 0 fills tile 0 and half of tile 1; expert 2 starts at tile 2),
    tile_expert_N = [0, 0, 2, 2, 2, 2] (unused tiles repeat the last expert and hold zeros).

  Returns:
    dest_R: padded slot of each sorted row.
    tile_expert_N: the expert each tile multiplies with.
    num_tiles: N.
  """
  num_experts = group_sizes_E.shape[0]
  num_tiles = -(-num_rows // tile_rows) + num_experts
  padded_E = -(-group_sizes_E // tile_rows) * tile_rows
  padded_end_E = jnp.cumsum(padded_E)
  start_E = jnp.cumsum(group_sizes_E) - group_sizes_E
  expert_R = jnp.repeat(jnp.arange(num_experts), group_sizes_E, total_repeat_length=num_rows)
  dest_R = (padded_end_E - padded_E)[expert_R] + jnp.arange(num_rows) - start_E[expert_R]
  tile_start_N = jnp.arange(num_tiles) * tile_rows
  tile_expert_N = jnp.searchsorted(padded_end_E, tile_start_N, side="right")
  last_used = jnp.max(jnp.where(group_sizes_E > 0, jnp.arange(num_experts), 0))
  tile_expert_N = jnp.minimum(tile_expert_N, last_used).astype(jnp.int32)
  return dest_R.astype(jnp.int32), tile_expert_N, num_tiles
