"""Dropless expert parallelism in bounded memory: budget-sized buffers, the overflow in further rounds.

The single-shot expert-parallel dispatcher (`dispatch.ExpertParallelDispatcher`, `moe_buffers:
worst_case` on one node) sizes its buffers for every token of every rank routed to one rank: T x P
received rows, T x P x K (row, local expert) pairs for the grouped GEMM. `RoundsDispatcher` sizes them
from the mean (`levels.round_levels`), on one node or, in two levels, across nodes (`moe.levels`):

- Each (source, destination) pair of a level carries at most a budget per round: (row, local expert)
  pairs at the last level, G = ceil(buffer_factor x T x K / its ranks), at least K so that any row fits;
  rows at the network level. A row for destination p goes in round (the budget used by the rows for p
  up to and including it - 1) // budget (`plan_rounds`). Every rank of a level runs the same number of
  rounds, the most any pair needs (`lax.pmax` over the axis). Natural routing needs one; adversarial
  routing (every token to one rank) more, and drops nothing.
- Round 0 always runs; the others run in a `lax.while_loop` for as long as some rank needs them, so no
  round's buffers outlive it and a routing that needs one round runs one. On XLA:GPU the loop's predicate
  is one host sync per call (forward, recomputation, backward). A loop and not a `lax.cond` per round:
  under MaxText's pipeline stages (a `vmap` over the stages) a conditional on a per-stage value becomes a
  select that runs every branch, where a loop runs until the last stage is done.
- The backward is a custom VJP of the same shape: each round's forward recomputed and transposed (what
  a `jax.checkpoint` per round gave), round 0 then the loop; nothing per round is kept.
- The tokens may be split into chunks (`moe_exchange_chunks`), each its own rounds: every chunk's round 0
  comes first, so XLA's scheduler can run one chunk's exchange beside another's expert GEMMs. The chunks
  are chained (`round_plan.tie`): the rows a chunk received and the previous chunk's results pass one
  barrier, so the dispatch of chunk c + 1 can run beside chunk c's GEMMs and the combine of chunk c beside chunk
  c + 1's; in the backward a chunk's recomputed rows wait for the previous chunks' weight gradients, so
  one chunk's rows are held at a time. Without the chain XLA:GPU fused the chunks' work after the
  dispatch (every chunk's expert counts in one fusion, every chunk's gate and up outputs in another), so
  no chunk's GEMMs could start before every chunk's rows had arrived. Across nodes the NVLink level runs
  every chunk's round 0 in one call, so its chain spans the chunks.
- Across nodes a round of the network level runs the NVLink level's rounds on the rows it received (a
  custom VJP inside one), so both levels are bounded and dropless.

Shape legend: T tokens, K top-k, D model dim, P ranks, E_l local experts, S received rows per round,
Q pairs per round, C chunks.
"""

import functools
from dataclasses import dataclass
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from maxtext_moe.moe import levels, round_plan
from maxtext_moe.moe.dispatch import Experts, Routing
from maxtext_moe.moe.exchange import Exchange
from maxtext_moe.moe.round_plan import RoundPlan, plan_rounds
from maxtext_moe.moe.stats import DispatchStats


@dataclass(frozen=True)
class _Runner:
  """The rounds of every level of one call, static (hashable: the custom VJP's non-differentiable
  argument): each level's exchange and sizes, and the experts without their weights."""

  exchanges: tuple[Exchange, ...]
  sizes: tuple[levels.LevelSizes, ...]
  experts: Any  # `dispatch.Experts` with no weights; the weights travel as differentiable arguments
  top_k: int

  def plan(self, level: int, ids_TK: jax.Array) -> RoundPlan:
    ex, size = self.exchanges[level], self.sizes[level]
    return plan_rounds(
      ids_TK,
      local_experts=ex.local_experts,
      num_ranks=ex.num_ranks,
      budget=size.budget,
      axis=ex.axis,
      count_rows=size.counts_rows,
    )

  def there(self, level: int, r, x_TD, ids_TK, w_TK, plan: RoundPlan) -> tuple:
    """Round r's rows of `level` to their ranks: ((received x, ids, weights), the trip, its stats)."""
    ex, size = self.exchanges[level], self.sizes[level]
    sent_TP = plan.needs_TP & (plan.round_TP == r)
    recv, trip = ex.there(x_TD, ids_TK, w_TK, sent_TP, plan.slot_TP, send_rows=size.recv_rows, recv_rows=size.recv_rows)
    if level + 1 < len(self.exchanges):  # the network level: rows to another node
      own = jax.lax.axis_index(ex.axis) // (self.exchanges[level + 1].num_ranks)
      return (
        recv,
        trip,
        {"rows_sent_network": jnp.sum(sent_TP, dtype=jnp.float32) - jnp.sum(sent_TP[:, own], dtype=jnp.float32)},
      )
    return recv, trip, {"rows_sent": jnp.sum(sent_TP, dtype=jnp.float32)}

  def last(self, recv: tuple, weights, tie=None) -> tuple[jax.Array, Any]:
    """The experts' GEMMs on the rows the last level received, once `tie` is computed and `tie` once the
    rows are here (`round_plan.tie`): (each row's routing-weighted sum over its experts here [S, D], `tie`)."""
    (recv_x_SD, recv_ids_SK, recv_w_SK), tie = round_plan.tie(recv, tie)
    rows_QD, group_sizes, order_Q = round_plan.expand(
      recv_x_SD,
      recv_ids_SK,
      local_experts=self.exchanges[-1].local_experts,
      num_pairs=levels.gemm_rows(self.sizes, self.top_k),
    )
    out_QD = self.experts.with_weights(weights)(rows_QD, group_sizes)
    return round_plan.reduce(out_QD, order_Q, recv_w_SK, jnp.sum(group_sizes)), tie

  def middle(self, level: int, recv: tuple, weights) -> tuple[jax.Array, dict]:
    """What the received rows of `level` come back as (each row's routing-weighted sum over its experts
    here): the next level's rounds, or at the last level the experts' GEMMs. ([S, D], its stats)."""
    if level + 1 < len(self.exchanges):
      (partial_SD,), inner = _rounds(self, level + 1, *((a,) for a in recv), weights)
      return partial_SD, jax.lax.stop_gradient(inner)
    return self.last(recv, weights)[0], {}

  def back(self, level: int, partial_SD: jax.Array, trip) -> jax.Array:
    return self.exchanges[level].back(partial_SD, trip, send_rows=self.sizes[level].recv_rows)

  def round(self, level: int, r, x_TD, ids_TK, w_TK, weights, plan: RoundPlan) -> tuple[jax.Array, dict]:
    """One round of `level`: its rows there, the next level's rounds (or the experts) on what arrived,
    the results back. Returns (y_TD, {stat: value} of this round)."""
    recv, trip, stats = self.there(level, r, x_TD, ids_TK, w_TK, plan)
    partial_SD, inner = self.middle(level, recv, weights)
    return self.back(level, partial_SD, trip), stats | inner

  def first(self, level: int, xs, ids, ws, weights, plans, tie=None) -> tuple[list, list, Any]:
    """Round 0 of every chunk of `level`: (y per chunk, stats per chunk, `tie`). Above the last level the
    next level's rounds run once on every chunk's received rows. At the last level the chunks are
    chained: the rows a chunk received and the previous chunk's results are tied (`round_plan.tie`), so its
    work after the dispatch waits for the previous chunk's GEMMs and the previous chunk's combine waits for
    its rows; the first chunk's rows are tied to `tie`."""
    sent = [self.there(level, 0, x, i, w, p) for x, i, w, p in zip(xs, ids, ws, plans, strict=True)]
    if level + 1 < len(self.exchanges):
      partials, inner = _rounds(self, level + 1, *zip(*(recv for recv, _, _ in sent), strict=True), weights)
      inner = jax.lax.stop_gradient(inner)
      # the next level's stats once (every chunk's summed, or the largest), zeros beside the other chunks
      zero = jax.tree.map(jnp.zeros_like, inner)
      stats = [s | (inner if c == 0 else zero) for c, (_, _, s) in enumerate(sent)]
    else:
      partials = []
      for recv, _, _ in sent:
        if partials:
          partial_SD, partials[-1] = self.last(recv, weights, partials[-1])
        else:
          partial_SD, tie = self.last(recv, weights, tie)
        partials.append(partial_SD)
      stats = [s for _, _, s in sent]
    ys = [self.back(level, part, trip) for part, (_, trip, _) in zip(partials, sent, strict=True)]
    return ys, stats, tie

  def forward(self, level: int, xs, ids, ws, weights) -> tuple[tuple, dict, tuple]:
    """(y per chunk, the stats, the plans): every chunk's round 0, then each chunk's further rounds."""
    plans = tuple(self.plan(level, i) for i in ids)
    # The exchange waits for the plans' global maxima (one small all-reduce over the expert axis): XLA:GPU
    # keeps no all-to-all in flight beside a collective over the same devices, so that all-reduce left
    # to run beside the expert GEMMs would keep the exchange from them.
    xs, plans = round_plan.tie(xs, plans)
    y0s, s0s, _ = self.first(level, xs, ids, ws, weights, plans)
    ys, stats = [], []
    for y0, s0, x, i, w, p in zip(y0s, s0s, xs, ids, ws, plans, strict=True):

      def body(carry, x=x, i=i, w=w, p=p):
        r, y, s = carry
        y_r, s_r = self.round(level, r, x, i, w, weights, p)
        return r + 1, y + y_r, _add(s, s_r)

      _, y, s = jax.lax.while_loop(lambda c, p=p: c[0] < p.rounds, body, (jnp.int32(1), y0, s0))
      ys.append(y)
      stats.append(_add(s, self._plan_stats(level, p)))
    return tuple(ys), functools.reduce(_add, stats), (xs, plans)

  def backward(self, level: int, xs, ids, ws, weights, plans, ys_bar) -> tuple:
    """Cotangents of (xs, ids, ws, weights): each round's forward recomputed and transposed, every chunk's
    round 0 first. Above the last level round 0 of every chunk is one transpose (the next level chains
    the chunks); at the last level the rows each chunk's recomputation received are tied to the weights'
    gradient of the chunks before it, so its GEMMs wait for theirs and one chunk's rows are held at a
    time."""

    def vjp(r, c):
      def f(x, w, weights):
        return self.round(level, r, x, ids[c], w, weights, plans[c])[0]

      return jax.vjp(f, xs[c], ws[c], weights)[1]

    if level + 1 < len(self.exchanges):

      def f0(xs, ws, weights):
        return tuple(self.first(level, xs, ids, ws, weights, plans)[0])

      dxs, dws, dweights = jax.vjp(f0, xs, ws, weights)[1](tuple(ys_bar))
      dxs, dws = list(dxs), list(dws)
    else:
      dxs, dws, dweights = [], [], None
      for c in range(len(xs)):

        def f1(x, w, weights, c=c, tie=dweights):
          ys, _, tie = self.first(level, (x,), (ids[c],), (w,), weights, (plans[c],), tie)
          return ys[0], tie

        _, vjp_c, tied = jax.vjp(f1, xs[c], ws[c], weights, has_aux=True)
        dx, dw, dweights_c = vjp_c(ys_bar[c])
        dxs.append(dx)
        dws.append(dw)
        dweights = dweights_c if tied is None else jax.tree.map(jnp.add, tied, dweights_c)
    for c in range(len(xs)):  # the further rounds, each chunk's loop adding to the weights' gradient

      def body(carry, c=c):
        r, g = carry
        return r + 1, jax.tree.map(jnp.add, g, vjp(r, c)(ys_bar[c]))

      g0 = (dxs[c], dws[c], dweights)
      dxs[c], dws[c], dweights = jax.lax.while_loop(
        lambda carry, c=c: carry[0] < plans[c].rounds, body, (jnp.int32(1), g0)
      )[1]
    return tuple(dxs), None, tuple(dws), dweights

  def _plan_stats(self, level: int, plan: RoundPlan) -> dict:
    """Rounds and load (the largest over levels), and at the network level the most nodes one token reached."""
    stats = {"rounds": plan.rounds.astype(jnp.float32), "load_over_budget": plan.load_over_budget}
    if level + 1 < len(self.exchanges):
      stats["nodes_per_token"] = jnp.max(jnp.sum(plan.needs_TP, axis=1)).astype(jnp.float32)
    return stats


_MAXED = ("rounds", "load_over_budget", "nodes_per_token")


def _add(a: dict, b: dict) -> dict:
  """Two rounds' (or levels', or chunks') stats: counts summed, rounds, load and nodes the largest."""
  out = dict(a)
  for k, v in b.items():
    out[k] = (jnp.maximum if k in _MAXED else jnp.add)(out[k], v) if k in out else v
  return out


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _rounds(runner: _Runner, level: int, xs, ids, ws, weights) -> tuple[tuple, dict]:
  """Every round of `level` on each chunk: (y per chunk, stats)."""
  ys, stats, _ = runner.forward(level, xs, ids, ws, weights)
  return ys, stats


def _rounds_fwd(runner: _Runner, level: int, xs, ids, ws, weights):
  ys, stats, (xs, plans) = runner.forward(level, xs, ids, ws, weights)
  return (ys, stats), (xs, ids, ws, weights, plans)


def _rounds_bwd(runner: _Runner, level: int, residuals, cotangents):
  xs, ids, ws, weights, plans = residuals
  return runner.backward(level, xs, ids, ws, weights, plans, cotangents[0])


_rounds.defvjp(_rounds_fwd, _rounds_bwd)


@dataclass(frozen=True)
class RoundsDispatcher:
  """Experts split evenly over the ranks of `exchanges` (one level, or network then NVLink), dropless, in
  buffers of `buffer_factor` times the mean load (`worst_case`: budgets no routing exceeds), the tokens
  in `chunks`. Call inside shard_map over the exchanges' axis."""

  mesh_level: ClassVar[bool] = False

  num_experts: int
  exchanges: tuple[Exchange, ...]
  buffer_factor: float
  routing_groups: tuple[int, int] = (0, 0)
  chunks: int = 1
  worst_case: bool = False

  @property
  def num_ranks(self) -> int:
    return self.num_experts // self.exchanges[-1].local_experts

  def sizes(self, num_tokens: int, top_k: int) -> tuple[levels.LevelSizes, ...]:
    """Each level's sizes for a chunk of `num_tokens` tokens."""
    return levels.round_levels(
      num_tokens,
      top_k,
      num_experts=self.num_experts,
      ranks=self.num_ranks,
      nodes=self.exchanges[0].num_ranks if len(self.exchanges) > 1 else 1,
      buffer_factor=self.buffer_factor,
      routing_groups=self.routing_groups,
      worst_case=self.worst_case,
    )

  def run(self, x_TD: jax.Array, routing: Routing, experts: Experts) -> tuple[jax.Array, DispatchStats]:
    """(y_TD: every round's outputs summed, chunk by chunk; the stats of the same plans)."""
    t, k = routing.ids_TK.shape
    chunks = self.chunks if self.chunks > 1 and t % self.chunks == 0 else 1
    sizes = self.sizes(t // chunks, k)
    runner = _Runner(self.exchanges, sizes, experts.with_weights(()), k)
    split = functools.partial(jnp.split, indices_or_sections=chunks)
    chunked = (tuple(split(a)) for a in (x_TD, routing.ids_TK, routing.weights_TK))
    ys, stats = _rounds(runner, 0, *chunked, experts.weights)
    stats = jax.lax.stop_gradient(stats)  # counts: no cotangent flows into the custom VJP through them
    return jnp.concatenate(ys), DispatchStats.of(
      rows_sent=stats["rows_sent"],
      rows_sent_no_dedup=t * k,
      buffer_rows=levels.received_rows(sizes),
      rounds=stats["rounds"],
      load_over_budget=stats["load_over_budget"],
      rows_sent_network=stats.get("rows_sent_network", 0),
      nodes_per_token=stats.get("nodes_per_token", 0),
    )
