"""Token dispatchers: `dispatch(x, ids, weights) -> (rows, group_sizes, meta)` and `combine(rows, meta) -> y`.

Each dispatcher owns the whole trip from tokens to expert-sorted rows and back (torchtitan's single
dispatcher object). Local index math lives in `permute`. The TE NCCL-EP dispatcher will be one more
class with the same three methods.

- `LocalDispatcher`: all experts on this device (no expert parallelism).
- `AllToAllDispatcher`: experts split over a mesh axis of P ranks; runs inside `shard_map`. Portable
  (XLA:CPU has all_to_all but no ragged_all_to_all). Tokens are deduplicated per destination rank: a
  token goes once to each rank hosting any of its top-k experts; that rank expands it to its local
  experts and returns the weighted sum, so wire rows per token = distinct ranks instead of K.
  Buffers are sized for the worst case (every token to one rank), so it is dropless unless a capacity
  factor is set; then overflow is counted in the stats, never silent. The wire carries the padded buffers.
- `RaggedAllToAllDispatcher`: the same dedup, exchanged with `ragged_all_to_all` so only real rows cross
  the wire (GPU/TPU; XLA:CPU lacks the op, tests drive it with `collectives.ragged_all_to_all_reference`).

Shape legend: T tokens, K top-k, D model dim, E experts (E_l local), P ranks, C rows per rank buffer,
S = P*C*K received slots, R rows.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from maxtext_moe.moe import permute


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
    order_R, group_sizes_E = permute.sort_by_expert(ids_TK, num_experts=self.num_experts)
    rows_RD = x_TD[order_R // ids_TK.shape[1]]
    return rows_RD, group_sizes_E, LocalMeta(order_R, weights_TK)

  def combine(self, rows_RD: jax.Array, meta: LocalMeta) -> jax.Array:
    t, k = meta.weights_TK.shape
    out_TKD = rows_RD[permute.inverse_permutation(meta.order_R)].reshape(t, k, -1)
    return jnp.einsum("tk,tkd->td", meta.weights_TK.astype(out_TKD.dtype), out_TKD)

  def stats(self, ids_TK: jax.Array) -> dict[str, jax.Array]:
    del ids_TK  # nothing crosses the wire and nothing can be dropped
    zero = jnp.zeros((), jnp.float32)
    return {"rows_sent": zero, "rows_sent_no_dedup": zero, "buffer_rows": zero, "dropped": zero}


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class AllToAllMeta:
  """Send-side slots (to return results) and receive-side expansion (to reduce them)."""

  keep_TP: jax.Array
  slot_TP: jax.Array
  order_S: jax.Array
  recv_w_PCK: jax.Array


@dataclass(frozen=True)
class AllToAllDispatcher:
  """Experts split evenly over mesh axis `axis` (P ranks). Call inside shard_map over that axis."""

  num_experts: int
  num_ranks: int
  axis: str
  capacity_factor: float = 0.0  # <= 0: dropless (worst-case buffers)

  @property
  def local_experts(self) -> int:
    return self.num_experts // self.num_ranks

  def capacity(self, num_tokens: int, top_k: int) -> int:
    """Rows per destination buffer: T (dropless) or ceil(cf * T * K / P), at most T."""
    if self.capacity_factor <= 0:
      return num_tokens
    return max(1, min(num_tokens, math.ceil(self.capacity_factor * num_tokens * top_k / self.num_ranks)))

  def _send_slots(self, ids_TK: jax.Array, cap: int):
    needs_TP = permute.distinct_ranks(ids_TK, experts_per_rank=self.local_experts, num_ranks=self.num_ranks)
    slot_TP = jnp.cumsum(needs_TP, axis=0) - 1
    keep_TP = needs_TP & (slot_TP < cap)
    return needs_TP, keep_TP, jnp.where(keep_TP, slot_TP, cap)  # cap = out of bounds: dropped by scatter

  def dispatch(self, x_TD: jax.Array, ids_TK: jax.Array, weights_TK: jax.Array):
    t, k = ids_TK.shape
    p_n, e_l, cap = self.num_ranks, self.local_experts, self.capacity(t, k)
    _, keep_TP, slot_TP = self._send_slots(ids_TK, cap)
    rank_TK, local_TK = ids_TK // e_l, ids_TK % e_l
    on_rank_TPK = rank_TK[:, None, :] == jnp.arange(p_n)[None, :, None]
    p_TP = jnp.broadcast_to(jnp.arange(p_n), (t, p_n))
    send_x = jnp.zeros((p_n, cap, x_TD.shape[1]), x_TD.dtype)
    send_x = send_x.at[p_TP, slot_TP].set(jnp.broadcast_to(x_TD[:, None], (t, p_n, x_TD.shape[1])), mode="drop")
    # Local expert id per (token, k) on each rank; e_l marks "not on this rank" (sorted last, no group).
    send_ids = (
      jnp.full((p_n, cap, k), e_l, jnp.int32)
      .at[p_TP, slot_TP]
      .set(jnp.where(on_rank_TPK, local_TK[:, None, :], e_l).astype(jnp.int32), mode="drop")
    )
    send_w = (
      jnp.zeros((p_n, cap, k), weights_TK.dtype)
      .at[p_TP, slot_TP]
      .set(jnp.where(on_rank_TPK, weights_TK[:, None, :], 0), mode="drop")
    )
    recv_x, recv_ids, recv_w = (jax.lax.all_to_all(a, self.axis, 0, 0, tiled=True) for a in (send_x, send_ids, send_w))
    order_S, sizes = permute.sort_by_expert(recv_ids.reshape(p_n * cap, k), num_experts=e_l + 1)
    rows_SD = recv_x.reshape(p_n * cap, -1)[order_S // k]
    return rows_SD, sizes[:e_l], AllToAllMeta(keep_TP, slot_TP, order_S, recv_w)

  def combine(self, rows_SD: jax.Array, meta: AllToAllMeta) -> jax.Array:
    p_n, cap, k = meta.recv_w_PCK.shape
    out_PCKD = rows_SD[permute.inverse_permutation(meta.order_S)].reshape(p_n, cap, k, -1)
    partial_PCD = jnp.einsum("pck,pckd->pcd", meta.recv_w_PCK.astype(out_PCKD.dtype), out_PCKD)
    back_PCD = jax.lax.all_to_all(partial_PCD, self.axis, 0, 0, tiled=True)
    got_TPD = back_PCD.at[jnp.arange(p_n)[None, :], meta.slot_TP].get(mode="fill", fill_value=0)
    return jnp.sum(jnp.where(meta.keep_TP[..., None], got_TPD, 0), axis=1)

  def stats(self, ids_TK: jax.Array) -> dict[str, jax.Array]:
    """Per-device wire rows with and without dedup, buffer rows, and dropped (token, expert) assignments."""
    t, k = ids_TK.shape
    cap = self.capacity(t, k)
    needs_TP, keep_TP, _ = self._send_slots(ids_TK, cap)
    per_rank_TP = jnp.sum(ids_TK[:, None, :] // self.local_experts == jnp.arange(self.num_ranks)[None, :, None], -1)
    dropped = jnp.sum(jnp.where(needs_TP & ~keep_TP, per_rank_TP, 0))
    f32 = jnp.float32
    return {
      "rows_sent": jnp.sum(keep_TP).astype(f32),
      "rows_sent_no_dedup": f32(t * k),
      "buffer_rows": f32(self.num_ranks * cap),
      "dropped": dropped.astype(f32),
    }


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class RaggedMeta:
  """Send-side packing (to gather results per token) and the exchange layout (to send them back)."""

  needs_TP: jax.Array
  pos_TP: jax.Array
  order_S: jax.Array
  recv_w_SK: jax.Array
  sizes_PP: jax.Array


@dataclass(frozen=True)
class RaggedAllToAllDispatcher:
  """Experts split evenly over mesh axis `axis` (P ranks), exchanged with a ragged all-to-all, so only
  real (deduplicated) rows cross the wire. Call inside shard_map over that axis. Always dropless.

  The sender packs each token once per destination rank, grouped by rank (`pos_TP`). All ranks share
  the [P, P] matrix of row counts (sizes_PP[q, p] = rows q sends p), from which each derives where its
  slice lands on every receiver; received rows are packed by source. `exchange` is the collective:
  `jax.lax.ragged_all_to_all` (GPU/TPU), or `collectives.ragged_all_to_all_reference` where XLA lacks it.
  """

  num_experts: int
  num_ranks: int
  axis: str
  exchange: Callable = jax.lax.ragged_all_to_all

  @property
  def local_experts(self) -> int:
    return self.num_experts // self.num_ranks

  def _pack(self, ids_TK: jax.Array):
    t = ids_TK.shape[0]
    needs_TP = permute.distinct_ranks(ids_TK, experts_per_rank=self.local_experts, num_ranks=self.num_ranks)
    send_P = jnp.sum(needs_TP, axis=0, dtype=jnp.int32)
    start_P = jnp.cumsum(send_P) - send_P
    pos_TP = start_P[None, :] + jnp.cumsum(needs_TP, axis=0, dtype=jnp.int32) - 1
    return needs_TP, jnp.where(needs_TP, pos_TP, t * self.num_ranks), send_P

  def _exchange(self, operand, output, sizes_PP: jax.Array, *, back: bool):
    """Forward: this rank's slice for p sits at its send offset and lands after the rows of lower ranks
    that also send to p. Back: the same slices retrace their path."""
    me = jax.lax.axis_index(self.axis)
    send_off_PP = jnp.cumsum(sizes_PP, axis=1) - sizes_PP  # [q, p]: where q's slice for p starts on q
    recv_off_PP = jnp.cumsum(sizes_PP, axis=0) - sizes_PP  # [q, p]: where q's slice lands on p
    if not back:
      args = (send_off_PP[me], sizes_PP[me], recv_off_PP[me], sizes_PP[:, me])
    else:
      args = (recv_off_PP[:, me], sizes_PP[:, me], send_off_PP[:, me], sizes_PP[me])
    return self.exchange(operand, output, *(a.astype(jnp.int32) for a in args), axis_name=self.axis)

  def dispatch(self, x_TD: jax.Array, ids_TK: jax.Array, weights_TK: jax.Array):
    t, k = ids_TK.shape
    p_n, e_l = self.num_ranks, self.local_experts
    needs_TP, pos_TP, send_P = self._pack(ids_TK)
    rank_TK, local_TK = ids_TK // e_l, ids_TK % e_l
    on_rank_TPK = rank_TK[:, None, :] == jnp.arange(p_n)[None, :, None]
    n_send = t * min(k, p_n)  # each token goes to at most min(K, P) ranks
    send_x = jnp.zeros((n_send, x_TD.shape[1]), x_TD.dtype).at[pos_TP].set(x_TD[:, None], mode="drop")
    local_TPK = jnp.where(on_rank_TPK, local_TK[:, None, :], e_l).astype(jnp.int32)
    send_ids = jnp.full((n_send, k), e_l, jnp.int32).at[pos_TP].set(local_TPK, mode="drop")
    send_w = (
      jnp.zeros((n_send, k), weights_TK.dtype)
      .at[pos_TP]
      .set(jnp.where(on_rank_TPK, weights_TK[:, None], 0), mode="drop")
    )
    sizes_PP = jax.lax.all_gather(send_P, self.axis)
    n_recv = t * p_n  # worst case: every rank sends all its tokens here
    recv_x = self._exchange(send_x, jnp.zeros((n_recv, x_TD.shape[1]), x_TD.dtype), sizes_PP, back=False)
    recv_ids = self._exchange(send_ids, jnp.full((n_recv, k), e_l, jnp.int32), sizes_PP, back=False)
    recv_w = self._exchange(send_w, jnp.zeros((n_recv, k), weights_TK.dtype), sizes_PP, back=False)
    order_S, sizes = permute.sort_by_expert(recv_ids, num_experts=e_l + 1)
    rows_SD = recv_x[order_S // k]
    return rows_SD, sizes[:e_l], RaggedMeta(needs_TP, pos_TP, order_S, recv_w, sizes_PP)

  def combine(self, rows_SD: jax.Array, meta: RaggedMeta) -> jax.Array:
    n_recv, k = meta.recv_w_SK.shape
    out_SKD = rows_SD[permute.inverse_permutation(meta.order_S)].reshape(n_recv, k, -1)
    partial_SD = jnp.einsum("sk,skd->sd", meta.recv_w_SK.astype(out_SKD.dtype), out_SKD)
    t, p_n = meta.needs_TP.shape
    n_send = t * min(k, p_n)
    back_SD = self._exchange(
      partial_SD, jnp.zeros((n_send, partial_SD.shape[1]), partial_SD.dtype), meta.sizes_PP, back=True
    )
    got_TPD = back_SD.at[meta.pos_TP].get(mode="fill", fill_value=0)
    return jnp.sum(jnp.where(meta.needs_TP[..., None], got_TPD, 0), axis=1)

  def stats(self, ids_TK: jax.Array) -> dict[str, jax.Array]:
    """Wire rows with and without dedup; the receive buffer; nothing is ever dropped."""
    t, k = ids_TK.shape
    needs_TP, _, _ = self._pack(ids_TK)
    f32 = jnp.float32
    return {
      "rows_sent": jnp.sum(needs_TP).astype(f32),
      "rows_sent_no_dedup": f32(t * k),
      "buffer_rows": f32(t * self.num_ranks),
      "dropped": jnp.zeros((), f32),
    }
