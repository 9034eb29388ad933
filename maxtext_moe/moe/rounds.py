"""Dropless expert parallelism in bounded memory: capacity-sized buffers, and the overflow in further rounds.

The worst-case dispatchers (`dispatch.AllToAllDispatcher`, `dispatch.RaggedAllToAllDispatcher` with
`buffer_factor=0`) size their buffers for every token of every rank routed to one rank: T x P received
rows, T x P x K (row, local expert) pairs for the grouped GEMM. `RoundsDispatcher` sizes them from the mean:

- Each (source, destination) rank pair may carry at most G (row, local expert) pairs per round,
  G = ceil(buffer_factor x T x K / P) (`round_budget`), at least K so that any one row fits. A token's
  row for rank p goes in round (pairs of the rows for p up to and including it - 1) // G, so a round
  carries at most min(G, T) rows and G + K - 1 pairs from each source (`plan_rounds`).
- Every rank runs the same number of rounds: the largest any pair of ranks needs (`lax.pmax`). Natural
  routing needs one; adversarial routing (every token to one rank) needs more, and drops nothing.
- The rounds are a `lax.scan` of static length (the most any routing can need), each round a `lax.cond`
  that skips the exchange and the GEMM past the last needed round, and a `jax.checkpoint` so the backward
  keeps nothing per round but its index (the round's output is recomputed).
- A round receives P x min(G, T) rows and hands the grouped GEMM P x (G + K - 1) pairs: the sorted pairs
  with the empty ones (ids "not here") cut off, since they sort last. The worst-case mode's are P x T and
  P x T x K.

Shape legend: T tokens, K top-k, D model dim, P ranks, E_l local experts, G per-pair budget, S received
rows per round (P x min(G, T)), Q pairs per round (P x (G + K - 1)).
"""

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp

from maxtext_moe.moe import collectives, permute
from maxtext_moe.moe.settings import round_budget


def max_rounds(num_tokens: int, top_k: int, *, budget: int, local_experts: int) -> int:
  """The rounds the worst routing needs: all T x min(K, E_l) pairs of a source for one rank."""
  return math.ceil(num_tokens * min(top_k, local_experts) / budget)


class RoundPlan(NamedTuple):
  """Which round and which slot of it each (token, rank) row takes."""

  needs_TP: jax.Array  # token t has at least one expert on rank p
  round_TP: jax.Array  # its round (where needs_TP)
  slot_TP: jax.Array  # its row among those for rank p in that round, < G
  rounds: jax.Array  # rounds every rank runs: 1 + the largest round of any row on any rank (global)
  load_over_budget: jax.Array  # the largest pairs any source has for one rank, over G (global)


def plan_rounds(ids_TK: jax.Array, *, local_experts: int, num_ranks: int, budget: int, axis: str | None) -> RoundPlan:
  """Rows in token order per destination, cut into rounds of at most `budget` pairs.

  Example (one source, axis=None): ids_TK = [[0, 1], [0, 2], [1, 3], [0, 1]], local_experts=2,
    num_ranks=2, budget=2: pairs for rank 0 are 2, 1, 1, 2 (cumulative 2, 3, 4, 6) -> rounds 0, 1, 1, 2;
    for rank 1: 0, 1, 1, 0 (cumulative 0, 1, 2, 2) -> rows of tokens 1 and 2 in round 0.
    round_TP[:, 0] = [0, 1, 1, 2], slot_TP[:, 0] = [0, 0, 1, 0], rounds = 3.
  """
  rank_TK = ids_TK // local_experts
  pairs_TP = jnp.sum(rank_TK[:, :, None] == jnp.arange(num_ranks)[None, None, :], axis=1, dtype=jnp.int32)
  needs_TP = pairs_TP > 0
  cum_TP = jnp.cumsum(pairs_TP, axis=0)
  round_TP = jnp.where(needs_TP, (cum_TP - 1) // budget, 0)
  # Slot: the row's index among rank p's rows, less the rows of p in earlier rounds.
  row_TP = jnp.cumsum(needs_TP, axis=0, dtype=jnp.int32) - 1
  most = max_rounds(ids_TK.shape[0], ids_TK.shape[1], budget=budget, local_experts=local_experts)
  per_round = jnp.zeros((most + 1, num_ranks), jnp.int32)
  per_round = per_round.at[round_TP, jnp.arange(num_ranks)[None, :]].add(needs_TP.astype(jnp.int32))
  before_RP = jnp.cumsum(per_round, axis=0) - per_round
  slot_TP = row_TP - jnp.take_along_axis(before_RP, round_TP, axis=0)
  rounds = jnp.max(jnp.where(needs_TP, round_TP + 1, 0))
  load = jnp.max(cum_TP[-1]).astype(jnp.float32) / budget
  if axis is not None:
    rounds, load = jax.lax.pmax(rounds, axis), jax.lax.pmax(load, axis)
  return RoundPlan(needs_TP, round_TP, slot_TP, rounds, load)


def _expand(recv_x_SD, recv_ids_SK, *, local_experts: int, num_pairs: int):
  """The received rows' (row, local expert) pairs sorted by expert, the empty ones cut off: (rows_QD,
  group_sizes, order_Q) with Q = min(num_pairs, S x K)."""
  order_R, sizes = permute.sort_by_expert(recv_ids_SK, num_experts=local_experts + 1)
  order_Q = order_R[: min(num_pairs, order_R.shape[0])]
  return recv_x_SD[order_Q // recv_ids_SK.shape[1]], sizes[:local_experts], order_Q


def _reduce(out_QD, order_Q, recv_w_SK, num_valid):
  """Each received row's routing-weighted sum over its pairs, [S, D] (`permute.weighted_rows` for the
  cut-off pair layout). Rows past the groups are zeroed first: a grouped GEMM may leave them unwritten."""
  s, k = recv_w_SK.shape
  w_Q = recv_w_SK.reshape(-1)[order_Q].astype(out_QD.dtype)
  out_QD = jnp.where((jnp.arange(order_Q.shape[0]) < num_valid)[:, None], out_QD, 0)
  return jax.ops.segment_sum(out_QD * w_Q[:, None], order_Q // k, num_segments=s)


@dataclass(frozen=True)
class RoundsDispatcher:
  """Experts split evenly over mesh axis `axis` (P ranks), dropless, in buffers of `buffer_factor` times
  the mean load. Call inside shard_map over that axis. `ragged`: exchange with a ragged all-to-all (only
  real rows on the wire), else a padded all_to_all."""

  num_experts: int
  num_ranks: int
  axis: str
  buffer_factor: float
  ragged: bool = False
  exchange: Callable = collectives.all_to_all  # ragged: jax.lax.ragged_all_to_all or its reference

  @property
  def local_experts(self) -> int:
    return self.num_experts // self.num_ranks

  def budget(self, ids_TK: jax.Array) -> int:
    t, k = ids_TK.shape
    return round_budget(
      t, k, num_ranks=self.num_ranks, buffer_factor=self.buffer_factor, local_experts=self.local_experts
    )

  def plan(self, ids_TK: jax.Array) -> RoundPlan:
    return plan_rounds(
      ids_TK, local_experts=self.local_experts, num_ranks=self.num_ranks, budget=self.budget(ids_TK), axis=self.axis
    )

  def _send_rows(self, plan: RoundPlan, r: jax.Array, rows: int) -> tuple[jax.Array, jax.Array, int]:
    """(sent_TP, dest_TP, N) of round r, `rows` slots per rank: padded, rank p's rows at [p rows, (p + 1)
    rows); ragged, packed by rank."""
    p_n = plan.needs_TP.shape[1]
    sent_TP = plan.needs_TP & (plan.round_TP == r)
    if not self.ragged:
      dest_TP = jnp.where(sent_TP, jnp.arange(p_n)[None, :] * rows + plan.slot_TP, p_n * rows)
      return sent_TP, dest_TP, p_n * rows
    n_send = p_n * rows
    send_P = jnp.sum(sent_TP, axis=0, dtype=jnp.int32)
    start_P = jnp.cumsum(send_P) - send_P
    return sent_TP, jnp.where(sent_TP, start_P[None, :] + plan.slot_TP, n_send), n_send

  def _swap(self, operand, sent_TP, *, recv_rows: int, back: bool):
    """One exchange of a round: there (S rows out of N) or back (N rows out of S)."""
    if not self.ragged:
      return self.exchange(operand, axis_name=self.axis)
    sizes_PP = jax.lax.all_gather(jnp.sum(sent_TP, axis=0, dtype=jnp.int32), self.axis)
    offsets = collectives.ragged_offsets(sizes_PP, jax.lax.axis_index(self.axis), back=back)
    output = jnp.zeros((recv_rows, *operand.shape[1:]), operand.dtype)
    if operand.dtype == jnp.int32 and not back:  # empty id rows are "not here", never expert 0
      output = output + self.local_experts
    return self.exchange(operand, output, *offsets, axis_name=self.axis)

  def _round(self, x_TD, ids_TK, weights_TK, experts, plan: RoundPlan, r):
    t, k = ids_TK.shape
    g = self.budget(ids_TK)
    rows = min(g, t)  # a round carries at most G rows from a source to a rank (each has a pair), and <= T
    sent_TP, dest_TP, n_send = self._send_rows(plan, r, rows)
    send = permute.pack_for_ranks(
      x_TD, ids_TK, weights_TK, dest_TP, num_rows=n_send, experts_per_rank=self.local_experts
    )
    s = self.num_ranks * rows
    recv_x_SD, recv_ids_SK, recv_w_SK = (self._swap(a, sent_TP, recv_rows=s, back=False) for a in send)
    rows_QD, group_sizes, order_Q = _expand(
      recv_x_SD, recv_ids_SK, local_experts=self.local_experts, num_pairs=self.num_ranks * (g + k - 1)
    )
    partial_SD = _reduce(experts(rows_QD, group_sizes), order_Q, recv_w_SK, jnp.sum(group_sizes))
    back_ND = self._swap(partial_SD, sent_TP, recv_rows=n_send, back=True)
    return permute.gather_returned(back_ND, dest_TP, sent_TP)

  def run(self, x_TD, ids_TK, weights_TK, experts: Callable) -> tuple[jax.Array, dict[str, jax.Array]]:
    """(y_TD: every round's outputs summed, rounds past `plan.rounds` skipped (all ranks agree); the stats
    of the same plan, so its global counts are gathered once)."""
    plan = self.plan(ids_TK)
    t, k = ids_TK.shape
    most = max_rounds(t, k, budget=self.budget(ids_TK), local_experts=self.local_experts)

    @jax.checkpoint
    def one(r):
      return jax.lax.cond(
        r < plan.rounds,
        lambda: self._round(x_TD, ids_TK, weights_TK, experts, plan, r),
        lambda: jnp.zeros_like(x_TD),
      )

    def body(y_TD, r):
      return y_TD + one(r), None

    y_TD, _ = jax.lax.scan(body, jnp.zeros_like(x_TD), jnp.arange(most))
    return y_TD, self._stats(ids_TK, plan)

  def _stats(self, ids_TK: jax.Array, plan: RoundPlan) -> dict[str, jax.Array]:
    """Wire rows with and without dedup, one round's receive buffer, nothing dropped; and (global) the
    rounds run and the largest load over the per-round budget."""
    t, k = ids_TK.shape
    f32 = jnp.float32
    return {
      "rows_sent": jnp.sum(plan.needs_TP).astype(f32),
      "rows_sent_no_dedup": jnp.asarray(t * k, f32),
      "buffer_rows": jnp.asarray(self.num_ranks * min(self.budget(ids_TK), t), f32),
      "dropped": jnp.zeros((), f32),
      "rounds": plan.rounds.astype(f32),
      "load_over_budget": plan.load_over_budget,
    }
