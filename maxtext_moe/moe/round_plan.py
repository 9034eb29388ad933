"""The bounded rounds' plan (`plan_rounds`: which round each row of a rank goes in, and how many rounds every
rank runs) and the row helpers of a round (`expand`, `reduce`, `tie`), for `moe.rounds`.

Shape legend: T tokens, K top-k, D model dim, P ranks, E_l local experts, S received rows per round,
Q pairs per round.
"""

from typing import NamedTuple

import jax
import jax.numpy as jnp

from maxtext_moe.moe import permute


class RoundPlan(NamedTuple):
  """Which round and which slot of it each (token, rank) row takes."""

  needs_TP: jax.Array  # token t has at least one expert on rank p
  round_TP: jax.Array  # its round (where needs_TP)
  slot_TP: jax.Array  # its row among those for rank p in that round
  rounds: jax.Array  # rounds every rank runs: 1 + the largest round of any row on any rank (global)
  load_over_budget: jax.Array  # the most budget any source uses for one rank, over the budget (global)


def plan_rounds(
  ids_TK: jax.Array, *, local_experts: int, num_ranks: int, budget: int, axis: str | None, count_rows: bool = False
) -> RoundPlan:
  """Rows in token order per destination, cut into rounds of at most `budget` (row, local expert) pairs,
  or rows with `count_rows`.

  Example (one source, axis=None): ids_TK = [[0, 1], [0, 2], [1, 3], [0, 1]], local_experts=2,
    num_ranks=2, budget=2: pairs for rank 0 are 2, 1, 1, 2 (cumulative 2, 3, 4, 6) -> rounds 0, 1, 1, 2;
    for rank 1: 0, 1, 1, 0 (cumulative 0, 1, 2, 2) -> rows of tokens 1 and 2 in round 0.
    round_TP[:, 0] = [0, 1, 1, 2], slot_TP[:, 0] = [0, 0, 1, 0], rounds = 3.
    With count_rows: rows for rank 0 are 1, 1, 1, 1 -> rounds 0, 0, 1, 1; rounds = 2.
  """
  rank_TK = ids_TK // local_experts
  pairs_TP = jnp.sum(rank_TK[:, :, None] == jnp.arange(num_ranks)[None, None, :], axis=1, dtype=jnp.int32)
  needs_TP = pairs_TP > 0
  used_TP = needs_TP.astype(jnp.int32) if count_rows else pairs_TP
  cum_TP = jnp.cumsum(used_TP, axis=0)
  round_TP = jnp.where(needs_TP, (cum_TP - 1) // budget, 0)
  # Slot: the row's index among rank p's rows, less the rows of p in earlier rounds. Every round holds at
  # least one row (a budget fits any row), so there are at most T rounds.
  row_TP = jnp.cumsum(needs_TP, axis=0, dtype=jnp.int32) - 1
  per_round = jnp.zeros(needs_TP.shape, jnp.int32)
  per_round = per_round.at[round_TP, jnp.arange(num_ranks)[None, :]].add(needs_TP.astype(jnp.int32))
  before_RP = jnp.cumsum(per_round, axis=0) - per_round
  slot_TP = row_TP - jnp.take_along_axis(before_RP, round_TP, axis=0)
  rounds = jnp.max(jnp.where(needs_TP, round_TP + 1, 0))
  load = jnp.max(cum_TP[-1]).astype(jnp.float32) / budget
  if axis is not None:
    rounds, load = jax.lax.pmax(rounds, axis), jax.lax.pmax(load, axis)
  return RoundPlan(needs_TP, round_TP, slot_TP, rounds, load)


def expand(recv_x_SD, recv_ids_SK, *, local_experts: int, num_pairs: int):
  """The received rows' (row, local expert) pairs sorted by expert, the empty ones cut off: (rows_QD,
  group_sizes, order_Q) with Q = min(num_pairs, S x K)."""
  order_R, sizes = permute.sort_by_expert(recv_ids_SK, num_experts=local_experts + 1)
  order_Q = order_R[: min(num_pairs, order_R.shape[0])]
  return recv_x_SD[order_Q // recv_ids_SK.shape[1]], sizes[:local_experts], order_Q


def reduce(out_QD, order_Q, recv_w_SK, num_valid):
  """Each received row's routing-weighted sum over its pairs, [S, D] (`permute.weighted_rows` for the
  cut-off pair layout). Rows past the groups are zeroed first: a grouped GEMM may leave them unwritten."""
  s, k = recv_w_SK.shape
  w_Q = recv_w_SK.reshape(-1)[order_Q].astype(out_QD.dtype)
  out_QD = jnp.where((jnp.arange(order_Q.shape[0]) < num_valid)[:, None], out_QD, 0)
  return jax.ops.segment_sum(out_QD * w_Q[:, None], order_Q // k, num_segments=s)


def tie(x, other):
  """(x, other), each available only once both are computed (an XLA optimization barrier). Both must be
  used: XLA drops an unused operand of a barrier, and the order with it."""
  if other is None:
    return x, None
  return jax.lax.optimization_barrier((x, other))
