"""Token dispatchers: the `Dispatcher` contract and its three implementations.

A dispatcher owns the whole trip from tokens to expert-sorted rows and back (torchtitan's single
dispatcher object): `dispatch(x, ids, weights) -> (rows, group_sizes, meta)`, `combine(rows, meta) -> y`,
and `stats(ids)` for the per-step metrics. Each splits, as Megatron's does, into local index math
(`permute`), the collective (injected: `collectives`), and local index math again.

- `LocalDispatcher`: all experts on this device (no expert parallelism).
- `AllToAllDispatcher`: experts split over a mesh axis of P ranks; runs inside `shard_map`. Portable
  (XLA:CPU has all_to_all but no ragged_all_to_all). Buffers are sized for the worst case (every token to
  one rank), so it is dropless unless a capacity factor is set; then overflow is counted in the stats,
  never silent. The wire carries the padded buffers.
- `RaggedAllToAllDispatcher`: the same, exchanged with a ragged all-to-all, so only real rows cross the
  wire (GPU/TPU; XLA:CPU lacks the op, tests drive it with `collectives.ragged_all_to_all_reference`).

Both expert-parallel dispatchers deduplicate per destination rank: a token goes once to each rank that
hosts any of its top-k experts (`permute.distinct_ranks`), that rank expands it to its local experts and
returns their weighted sum, so wire rows per token = distinct ranks instead of K. They share the packing
(`permute.pack_for_ranks`) and the receive-side expansion (`permute.sort_received`) and reduction
(`permute.weighted_rows`, `permute.gather_returned`); they differ in where each (token, rank) row goes.

Shape legend: T tokens, K top-k, D model dim, E experts (E_l local), P ranks, N send rows, S received rows,
R rows handed to the grouped GEMM.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import jax
import jax.numpy as jnp

from maxtext_moe.moe import collectives, permute
from maxtext_moe.moe.settings import capacity


class Dispatcher(Protocol):
  """The contract `block.routed_experts` relies on. Every method is traceable JAX."""

  def dispatch(self, x_TD: jax.Array, ids_TK: jax.Array, weights_TK: jax.Array) -> tuple[jax.Array, jax.Array, Any]:
    """Tokens -> (rows_RD sorted by local expert, group_sizes_E of the local experts, meta for combine)."""
    ...

  def combine(self, rows_RD: jax.Array, meta: Any) -> jax.Array:
    """Expert outputs in dispatch order -> y_TD, each token's routing-weighted sum over its top-k."""
    ...

  def stats(self, ids_TK: jax.Array) -> dict[str, jax.Array]:
    """Per-device float32 scalars: rows_sent, rows_sent_no_dedup, buffer_rows, dropped."""
    ...


def _stats(*, rows_sent, rows_sent_no_dedup, buffer_rows, dropped) -> dict[str, jax.Array]:
  f32 = jnp.float32
  values = {
    "rows_sent": rows_sent,
    "rows_sent_no_dedup": rows_sent_no_dedup,
    "buffer_rows": buffer_rows,
    "dropped": dropped,
  }
  return {k: jnp.asarray(v).astype(f32) for k, v in values.items()}


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class LocalMeta:
  """What `LocalDispatcher.combine` needs: the sort order and the routing weights."""

  order_R: jax.Array
  weights_TK: jax.Array


@dataclass(frozen=True)
class LocalDispatcher:
  """All `num_experts` experts are local."""

  num_experts: int

  def dispatch(self, x_TD: jax.Array, ids_TK: jax.Array, weights_TK: jax.Array):
    rows_RD, group_sizes_E, order_R = permute.sort_received(x_TD, ids_TK, experts_per_rank=self.num_experts)
    return rows_RD, group_sizes_E, LocalMeta(order_R, weights_TK)

  def combine(self, rows_RD: jax.Array, meta: LocalMeta) -> jax.Array:
    return permute.weighted_rows(rows_RD, meta.order_R, meta.weights_TK)

  def stats(self, ids_TK: jax.Array) -> dict[str, jax.Array]:
    del ids_TK  # nothing crosses the wire and nothing can be dropped
    return _stats(rows_sent=0, rows_sent_no_dedup=0, buffer_rows=0, dropped=0)


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class ExpertParallelMeta:
  """Where each (token, rank) row went (to gather results back) and the receive-side expansion."""

  sent_TP: jax.Array
  dest_TP: jax.Array
  order_R: jax.Array
  recv_w_SK: jax.Array
  sizes_PP: jax.Array | None = None  # the ragged exchange's row counts, for the way back


@dataclass(frozen=True)
class AllToAllDispatcher:
  """Experts split evenly over mesh axis `axis` (P ranks). Call inside shard_map over that axis.

  Row (token t, rank p) goes to slot p * C + (its order among the tokens for p) of a [P * C] buffer, C rows
  per rank (`settings.capacity`); `exchange` swaps the P blocks of C rows between ranks."""

  num_experts: int
  num_ranks: int
  axis: str
  capacity_factor: float = 0.0  # <= 0: dropless (worst-case buffers)
  exchange: Callable = collectives.all_to_all

  @property
  def local_experts(self) -> int:
    return self.num_experts // self.num_ranks

  def _rows(self, ids_TK: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array, int]:
    """(needs_TP, sent_TP, dest_TP, C): a row past a rank's C slots is not sent (dest = P * C: dropped)."""
    t, k = ids_TK.shape
    cap = capacity(t, k, num_ranks=self.num_ranks, capacity_factor=self.capacity_factor)
    needs_TP = permute.distinct_ranks(ids_TK, experts_per_rank=self.local_experts, num_ranks=self.num_ranks)
    slot_TP = jnp.cumsum(needs_TP, axis=0) - 1
    sent_TP = needs_TP & (slot_TP < cap)
    dest_TP = jnp.where(sent_TP, jnp.arange(self.num_ranks)[None, :] * cap + slot_TP, self.num_ranks * cap)
    return needs_TP, sent_TP, dest_TP, cap

  def dispatch(self, x_TD: jax.Array, ids_TK: jax.Array, weights_TK: jax.Array):
    _, sent_TP, dest_TP, cap = self._rows(ids_TK)
    send = permute.pack_for_ranks(
      x_TD, ids_TK, weights_TK, dest_TP, num_rows=self.num_ranks * cap, experts_per_rank=self.local_experts
    )
    recv_x_SD, recv_ids_SK, recv_w_SK = (self.exchange(a, axis_name=self.axis) for a in send)
    rows_RD, group_sizes_E, order_R = permute.sort_received(recv_x_SD, recv_ids_SK, experts_per_rank=self.local_experts)
    return rows_RD, group_sizes_E, ExpertParallelMeta(sent_TP, dest_TP, order_R, recv_w_SK)

  def combine(self, rows_RD: jax.Array, meta: ExpertParallelMeta) -> jax.Array:
    back_SD = self.exchange(permute.weighted_rows(rows_RD, meta.order_R, meta.recv_w_SK), axis_name=self.axis)
    return permute.gather_returned(back_SD, meta.dest_TP, meta.sent_TP)

  def stats(self, ids_TK: jax.Array) -> dict[str, jax.Array]:
    """Wire rows with and without dedup, buffer rows, and dropped (token, expert) assignments."""
    t, k = ids_TK.shape
    needs_TP, sent_TP, _, cap = self._rows(ids_TK)
    per_rank_TP = jnp.sum(ids_TK[:, None, :] // self.local_experts == jnp.arange(self.num_ranks)[None, :, None], -1)
    return _stats(
      rows_sent=jnp.sum(sent_TP),
      rows_sent_no_dedup=t * k,
      buffer_rows=self.num_ranks * cap,
      dropped=jnp.sum(jnp.where(needs_TP & ~sent_TP, per_rank_TP, 0)),
    )


@dataclass(frozen=True)
class RaggedAllToAllDispatcher:
  """Experts split evenly over mesh axis `axis` (P ranks), exchanged with a ragged all-to-all, so only
  real (deduplicated) rows cross the wire. Call inside shard_map over that axis. Always dropless.

  The sender packs each token once per destination rank, grouped by rank (`dest_TP`). All ranks share
  the [P, P] matrix of row counts (sizes_PP[q, p] = rows q sends p), from which each derives where its
  slice lands on every receiver (`collectives.ragged_offsets`); received rows are packed by source.
  `exchange` is the collective: `jax.lax.ragged_all_to_all` (GPU/TPU), or
  `collectives.ragged_all_to_all_reference` where XLA lacks it.
  """

  num_experts: int
  num_ranks: int
  axis: str
  exchange: Callable = jax.lax.ragged_all_to_all

  @property
  def local_experts(self) -> int:
    return self.num_experts // self.num_ranks

  def _rows(self, ids_TK: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(needs_TP, dest_TP, send_P): rows for rank p follow those for ranks < p, in token order."""
    t = ids_TK.shape[0]
    needs_TP = permute.distinct_ranks(ids_TK, experts_per_rank=self.local_experts, num_ranks=self.num_ranks)
    send_P = jnp.sum(needs_TP, axis=0, dtype=jnp.int32)
    start_P = jnp.cumsum(send_P) - send_P
    pos_TP = start_P[None, :] + jnp.cumsum(needs_TP, axis=0, dtype=jnp.int32) - 1
    return needs_TP, jnp.where(needs_TP, pos_TP, t * self.num_ranks), send_P

  def _exchange(self, operand: jax.Array, output: jax.Array, sizes_PP: jax.Array, *, back: bool) -> jax.Array:
    offsets = collectives.ragged_offsets(sizes_PP, jax.lax.axis_index(self.axis), back=back)
    return self.exchange(operand, output, *offsets, axis_name=self.axis)

  def dispatch(self, x_TD: jax.Array, ids_TK: jax.Array, weights_TK: jax.Array):
    t, k = ids_TK.shape
    needs_TP, dest_TP, send_P = self._rows(ids_TK)
    n_send = t * min(k, self.num_ranks)  # each token goes to at most min(K, P) ranks
    send = permute.pack_for_ranks(
      x_TD, ids_TK, weights_TK, dest_TP, num_rows=n_send, experts_per_rank=self.local_experts
    )
    sizes_PP = jax.lax.all_gather(send_P, self.axis)
    n_recv = t * self.num_ranks  # worst case: every rank sends all its tokens here
    empty = permute.empty_rows(n_recv, *send, experts_per_rank=self.local_experts)
    recv_x_SD, recv_ids_SK, recv_w_SK = (
      self._exchange(a, out, sizes_PP, back=False) for a, out in zip(send, empty, strict=True)
    )
    rows_RD, group_sizes_E, order_R = permute.sort_received(recv_x_SD, recv_ids_SK, experts_per_rank=self.local_experts)
    return rows_RD, group_sizes_E, ExpertParallelMeta(needs_TP, dest_TP, order_R, recv_w_SK, sizes_PP)

  def combine(self, rows_RD: jax.Array, meta: ExpertParallelMeta) -> jax.Array:
    t, p_n = meta.sent_TP.shape
    n_send = t * min(meta.recv_w_SK.shape[1], p_n)
    partial_SD = permute.weighted_rows(rows_RD, meta.order_R, meta.recv_w_SK)
    back_ND = self._exchange(
      partial_SD, jnp.zeros((n_send, partial_SD.shape[1]), partial_SD.dtype), meta.sizes_PP, back=True
    )
    return permute.gather_returned(back_ND, meta.dest_TP, meta.sent_TP)

  def stats(self, ids_TK: jax.Array) -> dict[str, jax.Array]:
    """Wire rows with and without dedup; the receive buffer; nothing is ever dropped."""
    t, k = ids_TK.shape
    needs_TP, _, _ = self._rows(ids_TK)
    return _stats(rows_sent=jnp.sum(needs_TP), rows_sent_no_dedup=t * k, buffer_rows=t * self.num_ranks, dropped=0)
