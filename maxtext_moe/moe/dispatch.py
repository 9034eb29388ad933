"""The dispatcher contract, and the single-shot dispatchers: local and expert-parallel.

A dispatcher owns the whole trip from tokens to their experts and back (torchtitan's single dispatcher
object), and every one of them implements one method:

    run(x_TD, routing, experts) -> (y_TD, DispatchStats)

where `routing` holds each token's top-k expert ids and weights, `experts(rows_RD, group_sizes_E)` runs the
local experts on rows sorted by expert, and y_TD is each token's routing-weighted sum of its experts'
outputs. `mesh_level` says where `run` is called: False, per device inside shard_map over the mesh (the
block splits tokens over every axis, experts over the expert axis); True, on the mesh's global arrays
(TE's NCCL EP, whose collectives carry their own sharding rules).

Most dispatchers are single-shot: `SingleShot.run` is dispatch -> experts -> combine, split as Megatron's
are into local index math (`permute`), the exchange (`exchange.Exchange`) and local index math again.

- `LocalDispatcher`: all experts on this device (no expert parallelism).
- `ExpertParallelDispatcher`: experts split over a mesh axis of P ranks, one exchange there and back. A
  token goes once to each rank that hosts any of its top-k experts (`permute.distinct_ranks`: dedup), that
  rank expands it to its local experts and returns their weighted sum. Padded all_to_all buffers hold
  `rows_per_rank` rows per rank: T when dropless (the worst case), fewer with a capacity factor, and then
  what overflows is dropped and counted, never silent. The ragged exchange moves only real rows, always
  dropless.
The bounded-memory dispatcher (`rounds.RoundsDispatcher`) runs the same exchange in rounds; TE's
(`te_ep.TeEpDispatcher`) runs at mesh level. `registry.DISPATCHERS` maps each `moe_dispatch` to its factory.

Shape legend: T tokens, K top-k, D model dim, E experts (E_l local), P ranks, N send rows, S received
rows, R rows handed to the grouped GEMM.
"""

from dataclasses import dataclass
from typing import ClassVar, Protocol

import jax
import jax.numpy as jnp

from maxtext_moe.moe import permute
from maxtext_moe.moe.buffers import capacity
from maxtext_moe.moe.exchange import Exchange, Trip
from maxtext_moe.moe.stats import DispatchStats


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Routing:
  """Each token's top-k experts and their weights (the router's output)."""

  ids_TK: jax.Array
  weights_TK: jax.Array


class Experts(Protocol):
  """The routed experts with their weights: rows sorted by expert in, their outputs out."""

  weights: tuple[jax.Array, ...]

  def __call__(self, rows_RD: jax.Array, group_sizes_E: jax.Array) -> jax.Array: ...

  def with_weights(self, weights: tuple[jax.Array, ...]) -> "Experts": ...


class Dispatcher(Protocol):
  """The contract `block.moe_block` relies on. `run` is traceable JAX."""

  mesh_level: ClassVar[bool]

  def run(self, x_TD: jax.Array, routing: Routing, experts: Experts) -> tuple[jax.Array, DispatchStats]: ...


class SingleShot:
  """dispatch -> experts -> combine, once. Subclasses give `dispatch`, `combine` and `stats`."""

  mesh_level: ClassVar[bool] = False

  def run(self, x_TD: jax.Array, routing: Routing, experts: Experts) -> tuple[jax.Array, DispatchStats]:
    rows_RD, group_sizes_E, meta = self.dispatch(x_TD, routing)
    return self.combine(experts(rows_RD, group_sizes_E), meta), self.stats(routing, meta)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class LocalMeta:
  """What `LocalDispatcher.combine` needs: the sort order and the routing weights."""

  order_R: jax.Array
  weights_TK: jax.Array


@dataclass(frozen=True)
class LocalDispatcher(SingleShot):
  """All `num_experts` experts are local."""

  num_experts: int

  def dispatch(self, x_TD: jax.Array, routing: Routing) -> tuple[jax.Array, jax.Array, LocalMeta]:
    """Tokens -> (rows_RD sorted by expert, group_sizes_E, meta for combine)."""
    rows_RD, group_sizes_E, order_R = permute.sort_received(x_TD, routing.ids_TK, experts_per_rank=self.num_experts)
    return rows_RD, group_sizes_E, LocalMeta(order_R, routing.weights_TK)

  def combine(self, rows_RD: jax.Array, meta: LocalMeta) -> jax.Array:
    """Expert outputs in dispatch order -> y_TD."""
    return permute.weighted_rows(rows_RD, meta.order_R, meta.weights_TK)

  def stats(self, routing: Routing, meta: LocalMeta) -> DispatchStats:
    del routing, meta  # nothing crosses the wire and nothing can be dropped
    return DispatchStats.of(rows_sent=0, rows_sent_no_dedup=0, buffer_rows=0)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class ExpertParallelMeta:
  """Where each (token, rank) row went, the receive-side expansion, and who needed a row at all."""

  trip: Trip
  needs_TP: jax.Array
  order_R: jax.Array
  recv_w_SK: jax.Array


@dataclass(frozen=True)
class ExpertParallelDispatcher(SingleShot):
  """Experts split evenly over `exchange`'s P ranks, one exchange there and back. Call inside shard_map.

  Row (token t, rank p) takes slot (its order among the tokens for p); slots from `rows_per_rank` on are
  not sent (dropped, counted). The ragged exchange sends at most T x min(K, P) rows and receives T x P."""

  num_experts: int
  exchange: Exchange
  capacity_factor: float = 0.0  # <= 0: dropless (T rows per rank)

  def _sizes(self, t: int, k: int) -> tuple[int, int, int]:
    """(rows per rank, send rows N, receive rows S)."""
    p = self.exchange.num_ranks
    if self.exchange.ragged:
      return t, t * min(k, p), t * p
    cap = capacity(t, k, num_ranks=p, capacity_factor=self.capacity_factor)
    return cap, p * cap, p * cap

  def dispatch(self, x_TD: jax.Array, routing: Routing) -> tuple[jax.Array, jax.Array, ExpertParallelMeta]:
    """Tokens -> (rows_RD sorted by local expert, group_sizes_E of the local experts, meta for combine)."""
    t, k = routing.ids_TK.shape
    per_rank, send_rows, recv_rows = self._sizes(t, k)
    ex = self.exchange
    needs_TP = permute.distinct_ranks(routing.ids_TK, experts_per_rank=ex.local_experts, num_ranks=ex.num_ranks)
    slot_TP = jnp.cumsum(needs_TP, axis=0, dtype=jnp.int32) - 1
    sent_TP = needs_TP & (slot_TP < per_rank)
    (recv_x_SD, recv_ids_SK, recv_w_SK), trip = ex.there(
      x_TD, routing.ids_TK, routing.weights_TK, sent_TP, slot_TP, send_rows=send_rows, recv_rows=recv_rows
    )
    rows_RD, group_sizes_E, order_R = permute.sort_received(recv_x_SD, recv_ids_SK, experts_per_rank=ex.local_experts)
    return rows_RD, group_sizes_E, ExpertParallelMeta(trip, needs_TP, order_R, recv_w_SK)

  def combine(self, rows_RD: jax.Array, meta: ExpertParallelMeta) -> jax.Array:
    """Expert outputs in dispatch order -> y_TD."""
    partial_SD = permute.weighted_rows(rows_RD, meta.order_R, meta.recv_w_SK)
    send_rows = self._sizes(meta.needs_TP.shape[0], meta.recv_w_SK.shape[1])[1]
    return self.exchange.back(partial_SD, meta.trip, send_rows=send_rows)

  def stats(self, routing: Routing, meta: ExpertParallelMeta) -> DispatchStats:
    """Wire rows with and without dedup, receive buffer rows, and dropped (token, expert) assignments."""
    t, k = routing.ids_TK.shape
    ex = self.exchange
    rank_TK = routing.ids_TK // ex.local_experts
    per_rank_TP = jnp.sum(rank_TK[:, None, :] == jnp.arange(ex.num_ranks)[None, :, None], -1)
    unsent_TP = meta.needs_TP & ~meta.trip.sent_TP
    return DispatchStats.of(
      rows_sent=jnp.sum(meta.trip.sent_TP),
      rows_sent_no_dedup=t * k,
      buffer_rows=self._sizes(t, k)[2],
      dropped=jnp.sum(jnp.where(unsent_TP, per_rank_TP, 0)),
    )
