"""Dropless expert parallelism in bounded memory: capacity-sized buffers, and the overflow in further rounds.

The single-shot expert-parallel dispatcher (`dispatch.ExpertParallelDispatcher`, `moe_buffers:
worst_case`) sizes its buffers for every token of every rank routed to one rank: T x P received
rows, T x P x K (row, local expert) pairs for the grouped GEMM. `RoundsDispatcher` sizes them from the mean:

- Each (source, destination) rank pair may carry at most G (row, local expert) pairs per round,
  G = ceil(buffer_factor x T x K / P) (`round_budget`), at least K so that any one row fits. A token's
  row for rank p goes in round (pairs of the rows for p up to and including it - 1) // G, so a round
  carries at most min(G, T) rows and G + K - 1 pairs from each source (`plan_rounds`).
- Every rank runs the same number of rounds: the largest any pair of ranks needs (`lax.pmax`). Natural
  routing needs one; adversarial routing (every token to one rank) needs more, and drops nothing.
- The rounds are a `lax.scan` of static length (the most any routing can need), each round a `lax.cond`
  that skips the exchange and the GEMM past the last needed round, and a `jax.checkpoint` so the backward
  keeps nothing per round but its index. On a GPU mesh (`RoundSkip.AFTER_FIRST`) round 0 runs
  unconditionally and the scan of the others sits in one `lax.cond` taken only when some rank needs a
  second round: on XLA:GPU a conditional outside a command buffer is a host sync, so natural routing pays
  one per call (forward, recomputation, backward) instead of one per round.
- A round receives P x min(G, T) rows and hands the grouped GEMM P x (G + K - 1) pairs: the sorted pairs
  with the empty ones (ids "not here") cut off, since they sort last. The worst-case mode's are P x T and
  P x T x K.

Shape legend: T tokens, K top-k, D model dim, P ranks, E_l local experts, G per-pair budget, S received
rows per round (P x min(G, T)), Q pairs per round (P x (G + K - 1)).
"""

import math
from dataclasses import dataclass
from enum import StrEnum
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp

from maxtext_moe.moe import permute
from maxtext_moe.moe.dispatch import Experts, Routing
from maxtext_moe.moe.exchange import Exchange
from maxtext_moe.moe.settings import round_budget
from maxtext_moe.moe.stats import DispatchStats


def max_rounds(num_tokens: int, top_k: int, *, budget: int, local_experts: int) -> int:
  """The rounds the worst routing needs: all T x min(K, E_l) pairs of a source for one rank (a token's
  top-k experts are distinct, as every router's are; pairs of repeated ids past these rounds are counted
  as dropped by `RoundPlan.unscheduled`, so a dropless run stops on them instead of losing them)."""
  return math.ceil(num_tokens * min(top_k, local_experts) / budget)


class RoundPlan(NamedTuple):
  """Which round and which slot of it each (token, rank) row takes."""

  needs_TP: jax.Array  # token t has at least one expert on rank p
  round_TP: jax.Array  # its round (where needs_TP)
  slot_TP: jax.Array  # its row among those for rank p in that round, < G
  rounds: jax.Array  # rounds every rank runs: 1 + the largest round of any row on any rank (global)
  load_over_budget: jax.Array  # the largest pairs any source has for one rank, over G (global)
  unscheduled: jax.Array  # pairs in rounds past `max_rounds` (this source): only repeated top-k ids make any


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
  unscheduled = jnp.sum(jnp.where(round_TP >= most, pairs_TP, 0))
  if axis is not None:
    rounds, load = jax.lax.pmax(rounds, axis), jax.lax.pmax(load, axis)
  return RoundPlan(needs_TP, round_TP, slot_TP, rounds, load, unscheduled)


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


class RoundSkip(StrEnum):
  """How the rounds a routing does not need are skipped (each way keeps the backward per-round)."""

  EACH = "each"  # a `lax.cond` per round: one conditional per round and call
  AFTER_FIRST = "after_first"  # round 0 always; the rest only when some rank needs a second round: one
  # conditional per call under natural routing. On XLA:GPU every conditional outside a command buffer is a
  # host sync, and this layout also needs less temporary memory there; XLA:CPU keeps the two branches'
  # temporaries apart (about 2x the bounded buffers), so CPU keeps EACH.


@dataclass(frozen=True)
class RoundsDispatcher:
  """Experts split evenly over `exchange`'s P ranks, dropless, in buffers of `buffer_factor` times the
  mean load: the exchange of `dispatch.ExpertParallelDispatcher`, run once per round. Call inside
  shard_map over the exchange's axis."""

  mesh_level: ClassVar[bool] = False

  num_experts: int
  exchange: Exchange
  buffer_factor: float
  skip: RoundSkip = RoundSkip.EACH

  @property
  def local_experts(self) -> int:
    return self.exchange.local_experts

  def budget(self, ids_TK: jax.Array) -> int:
    t, k = ids_TK.shape
    return round_budget(
      t, k, num_ranks=self.exchange.num_ranks, buffer_factor=self.buffer_factor, local_experts=self.local_experts
    )

  def plan(self, ids_TK: jax.Array) -> RoundPlan:
    return plan_rounds(
      ids_TK,
      local_experts=self.local_experts,
      num_ranks=self.exchange.num_ranks,
      budget=self.budget(ids_TK),
      axis=self.exchange.axis,
    )

  def _round(self, x_TD, routing: Routing, experts: Experts, plan: RoundPlan, r):
    t, k = routing.ids_TK.shape
    g = self.budget(routing.ids_TK)
    p = self.exchange.num_ranks
    send_rows = p * min(g, t)  # a round carries at most G rows from a source to a rank (each has a pair), and <= T
    sent_TP = plan.needs_TP & (plan.round_TP == r)
    (recv_x_SD, recv_ids_SK, recv_w_SK), trip = self.exchange.there(
      x_TD, routing.ids_TK, routing.weights_TK, sent_TP, plan.slot_TP, send_rows=send_rows, recv_rows=send_rows
    )
    rows_QD, group_sizes, order_Q = _expand(
      recv_x_SD, recv_ids_SK, local_experts=self.local_experts, num_pairs=p * (g + k - 1)
    )
    partial_SD = _reduce(experts(rows_QD, group_sizes), order_Q, recv_w_SK, jnp.sum(group_sizes))
    return self.exchange.back(partial_SD, trip, send_rows=send_rows)

  def run(self, x_TD: jax.Array, routing: Routing, experts: Experts) -> tuple[jax.Array, DispatchStats]:
    """(y_TD: every round's outputs summed; the stats of the same plan, so its global counts are gathered
    once). Rounds past the last one some rank needs are skipped (`plan.rounds` is global, so every rank
    takes the same branch): one at a time (`RoundSkip.EACH`), or all at once when only round 0 is needed
    (`RoundSkip.AFTER_FIRST`)."""
    plan = self.plan(routing.ids_TK)
    t, k = routing.ids_TK.shape
    most = max_rounds(t, k, budget=self.budget(routing.ids_TK), local_experts=self.local_experts)

    @jax.checkpoint
    def one(r):
      return self._round(x_TD, routing, experts, plan, r)

    def body(y_TD, r):
      return y_TD + jax.lax.cond(r < plan.rounds, lambda: one(r), lambda: jnp.zeros_like(x_TD)), None

    def rounds_from(first):
      return jax.lax.scan(body, jnp.zeros_like(x_TD), jnp.arange(first, most))[0]

    if self.skip == RoundSkip.EACH or most == 1:
      return rounds_from(0), self._stats(routing.ids_TK, plan)

    def first_only():
      return jnp.zeros_like(x_TD) + one(0)

    def every_round():
      return jax.lax.scan(body, first_only(), jnp.arange(1, most))[0]

    return jax.lax.cond(plan.rounds > 1, every_round, first_only), self._stats(routing.ids_TK, plan)

  def _stats(self, ids_TK: jax.Array, plan: RoundPlan) -> DispatchStats:
    """Wire rows with and without dedup, one round's receive buffer, pairs past the static rounds (none
    for distinct top-k ids); and (global) the rounds run and the largest load over the per-round budget."""
    t, k = ids_TK.shape
    return DispatchStats.of(
      rows_sent=jnp.sum(plan.needs_TP),
      rows_sent_no_dedup=t * k,
      buffer_rows=self.exchange.num_ranks * min(self.budget(ids_TK), t),
      dropped=plan.unscheduled,
      rounds=plan.rounds,
      load_over_budget=plan.load_over_budget,
    )
