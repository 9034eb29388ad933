"""Index math for routing rows to experts: sort, group sizes, inverse permutation, per-rank dedup.

Pure functions; every one has a worked example that tests/test_moe_permute.py checks.
Shape legend: T tokens, K top-k, R = T*K routed rows, E experts, P ranks, L window sizes, N send rows,
S received rows, D model dim.
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


def empty_rows(num_rows: int, x_ND: jax.Array, ids_NK: jax.Array, w_NK: jax.Array, *, experts_per_rank: int):
  """Row buffers shaped like (x, ids, weights) with `num_rows` rows and nothing in them: zero features, the
  local expert id `experts_per_rank` ("on no expert here": sorted last, in no group) and zero weights."""
  return (
    jnp.zeros((num_rows, *x_ND.shape[1:]), x_ND.dtype),
    jnp.full((num_rows, ids_NK.shape[1]), experts_per_rank, jnp.int32),
    jnp.zeros((num_rows, w_NK.shape[1]), w_NK.dtype),
  )


def compact_ranks(dest_TP: jax.Array, *, num_rows: int, max_ranks: int) -> tuple[jax.Array, jax.Array]:
  """(rank_TJ, dest_TJ): the J = min(max_ranks, P) ranks each token is sent to, lowest first, and their
  send rows (`num_rows` where fewer). A token's top-k experts live on at most k ranks, so with
  max_ranks = k nothing is lost, and the per-(token, rank) buffers of both ways are [T, J, ...], not
  [T, P, ...]: 8 instead of 64 rows per token at EP=64, top-8. With J = P nothing changes.

  Example: dest_TP = [[4, 1, 4, 6], [0, 4, 4, 4]], num_rows=4, max_ranks=2
    -> rank_TJ = [[1, 0], [0, 1]], dest_TJ = [[1, 4], [0, 4]] (6 >= 4 is not sent; a column whose row is
    num_rows is no destination, whatever its rank).
  """
  t, p = dest_TP.shape
  if max_ranks >= p:
    return jnp.broadcast_to(jnp.arange(p, dtype=jnp.int32), (t, p)), dest_TP
  sent_TP = dest_TP < num_rows
  score_TP = jnp.where(sent_TP, p - jnp.arange(p, dtype=jnp.int32), 0)  # sent ranks first, lowest first
  _, rank_TJ = jax.lax.top_k(score_TP, max_ranks)
  dest_TJ = jnp.take_along_axis(jnp.where(sent_TP, dest_TP, num_rows), rank_TJ, axis=1)
  return rank_TJ.astype(jnp.int32), dest_TJ


def pack_for_ranks(x_TD, ids_TK, weights_TK, dest_TJ, *, num_rows: int, experts_per_rank: int, rank_TJ=None):
  """The send side of expert parallelism, written once for every EP dispatcher: row dest_TJ[t, j] of each
  `num_rows`-row buffer holds token t for rank rank_TJ[t, j] (default: j, so J = P columns, one per rank),
  with its top-k ids as that rank's local expert ids and its weights, both only where the expert lives
  there (elsewhere `experts_per_rank` and 0). Entries of dest_TJ >= num_rows are not sent. Returns
  (send_x_ND, send_ids_NK, send_w_NK).

  Example: x = [[1.], [2.]], ids_TK = [[0, 3], [2, 3]], weights_TK = [[.5, .5], [.3, .7]],
    experts_per_rank=2 (P=2), dest_TJ = [[0, 2], [4, 1]] (token 1 needs no row for rank 0: 4 is out of
    bounds), num_rows=3
    -> send_x = [[1.], [2.], [1.]], send_ids = [[0, 2], [0, 1], [2, 1]], send_w = [[.5, 0], [.3, .7], [0, .5]].
  """
  t, k = ids_TK.shape
  j = dest_TJ.shape[1]
  if rank_TJ is None:
    rank_TJ = jnp.broadcast_to(jnp.arange(j), (t, j))
  rank_TK, local_TK = ids_TK // experts_per_rank, ids_TK % experts_per_rank
  on_rank_TJK = rank_TK[:, None, :] == rank_TJ[:, :, None]
  x_TJD = jnp.broadcast_to(x_TD[:, None], (t, j, x_TD.shape[1]))
  ids_TJK = jnp.where(on_rank_TJK, local_TK[:, None, :], experts_per_rank).astype(jnp.int32)
  w_TJK = jnp.where(on_rank_TJK, weights_TK[:, None, :], 0).astype(weights_TK.dtype)
  empty = empty_rows(num_rows, x_TD, ids_TK, weights_TK, experts_per_rank=experts_per_rank)
  # Every (token, column) gets a row of its own, those not sent one past the buffer each (dropped), so the
  # scatter's indices are unique, and says so: JAX then differentiates it as a plain gather, where for
  # possibly repeated indices it scatters ids and compares them, keeping [T, J, D] boolean masks for the
  # backward (XLA:GPU held them at the step's peak).
  unsent_TJ = num_rows + jnp.arange(t * j, dtype=dest_TJ.dtype).reshape(t, j)
  rows_TJ = jnp.where(dest_TJ < num_rows, dest_TJ, unsent_TJ)
  values = (x_TJD, ids_TJK, w_TJK)
  return tuple(buf.at[rows_TJ].set(v, mode="drop", unique_indices=True) for buf, v in zip(empty, values, strict=True))


def sort_received(x_SD: jax.Array, ids_SK: jax.Array, *, experts_per_rank: int):
  """Expands received rows to (row, local expert) pairs sorted by expert, for the grouped GEMM. Local id
  `experts_per_rank` means "not here" and sorts last, outside every group. Returns (rows_RD with R = S * K,
  group_sizes_E of the local experts, order_R for `weighted_rows`).

  Example: x_SD = [[1.], [2.]], ids_SK = [[1, 2], [0, 1]], experts_per_rank=2
    -> rows = [[2.], [1.], [2.], [1.]], group_sizes = [1, 2], order = [2, 0, 3, 1].
  """
  order_R, sizes = sort_by_expert(ids_SK, num_experts=experts_per_rank + 1)
  return x_SD[order_R // ids_SK.shape[1]], sizes[:experts_per_rank], order_R


def weighted_rows(rows_RD: jax.Array, order_R: jax.Array, weights_SK: jax.Array) -> jax.Array:
  """Inverse of `sort_received`'s expansion: each received row's routing-weighted sum over its K pairs,
  [S, D]. Pairs of experts not on this rank have weight 0.

  Example: rows = [[20.], [10.], [21.], [11.]], order = [2, 0, 3, 1], weights_SK = [[1., 0.], [.5, .5]]
    -> [[10.], [20.5]].
  """
  s, k = weights_SK.shape
  out_SKD = rows_RD[inverse_permutation(order_R)].reshape(s, k, -1)
  return jnp.einsum("sk,skd->sd", weights_SK.astype(out_SKD.dtype), out_SKD)


def gather_returned(back_ND: jax.Array, dest_TP: jax.Array) -> jax.Array:
  """The receive side of the way back: token t's output is the sum over ranks p it was sent to of the row
  that returned to dest_TP[t, p], [T, D]; a destination at or past back's last row (N, what
  `destinations` and `compact_ranks` write for a rank not sent to) contributes zero. The columns may be any
  of the token's destinations (`compact_ranks`' [T, J]).

  The fill-mode gather is the whole mask: its gradient scatters with the out-of-range rows dropped, so no
  [T, P, D] mask is kept for the backward (a `where` over the gathered rows had XLA:GPU keep two boolean
  [T, P, D] buffers at the step's peak, 2.6 GiB per GPU for DeepSeek-V3 at batch 6 x 4,096).

  Example: back = [[1.], [2.], [4.]], dest_TP = [[0, 2], [3, 1]] -> [[5.], [2.]].
  """
  return jnp.sum(back_ND.at[dest_TP].get(mode="fill", fill_value=0), axis=1)


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
