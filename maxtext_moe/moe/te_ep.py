"""`te_ep`: Transformer Engine's NCCL EP as a dispatcher, at the mesh level.

TE's dispatch and combine are collectives with sharding rules of their own: they take global arrays whose
leading (token) dimension is sharded over (data, fsdp, expert), not per-device blocks inside shard_map as
our other dispatchers do. So `te_ep_block` runs dispatch and combine on the mesh and only the experts per
shard. NCCL EP sends a token once per destination rank (deduplicated, and aggregated inside an NVLink
domain before crossing nodes) and lays the receive buffer out by local expert in 128-row blocks: the
grouped GEMM's groups, with zero rows between them. Its combine is unweighted, so the expert outputs are
weighted first; padded receive slots are ignored by combine.

The receive capacity must equal the one TE EP was bootstrapped with (`upstream.te.bootstrap`, once per
process, before the step is traced). Dropless by default: TE's worst case. The aux-loss-free bias update
needs nothing from TE: MaxText computes it from the top-k ids before dispatch.

Shape legend: T tokens (global), K top-k, D model dim, P ranks, C receive capacity per rank, E_l local
experts.
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from maxtext_moe.moe import permute
from maxtext_moe.moe.settings import check_te_ep_layout
from maxtext_moe.upstream import te  # the TE seam, a leaf module: it imports nothing of ours


@dataclass(frozen=True)
class TeEpMeta:
  """What combine and the stats need from dispatch."""

  recv_w_PC: jax.Array
  counts_PE: jax.Array
  handle: Any
  total_recv_P1: jax.Array
  num_tokens: int
  dtype: Any


@dataclass(frozen=True)
class TeEpDispatcher:
  """Experts split evenly over the `expert` mesh axis (P ranks), moved by TE's NCCL EP."""

  num_experts: int
  num_ranks: int
  capacity: int  # rows each rank receives per call; exactly the bootstrapped one

  def dispatch(self, x_TD: jax.Array, ids_TK: jax.Array, weights_TK: jax.Array):
    """-> (rows_PCD, group sizes_PE per rank, meta), global arrays sharded over the ranks."""
    rows_PCD, recv_w_PC, counts_PE, handle, total = te.ep_dispatch(x_TD, ids_TK, weights_TK, capacity=self.capacity)
    meta = TeEpMeta(recv_w_PC, counts_PE, handle, total, x_TD.shape[0], x_TD.dtype)
    return rows_PCD.astype(x_TD.dtype), counts_PE, meta

  def combine(self, out_PCD: jax.Array, meta: TeEpMeta) -> jax.Array:
    weighted_PCD = out_PCD * meta.recv_w_PC[..., None].astype(out_PCD.dtype)
    return te.ep_combine(weighted_PCD, meta.counts_PE, meta.handle, num_tokens=meta.num_tokens).astype(meta.dtype)

  def stats(self, ids_TK: jax.Array, meta: TeEpMeta) -> dict[str, jax.Array]:
    """Global: wire rows with and without dedup, receive buffer rows, assignments past the capacity."""
    t, k = ids_TK.shape
    needs_TP = permute.distinct_ranks(
      ids_TK, experts_per_rank=self.num_experts // self.num_ranks, num_ranks=self.num_ranks
    )
    over = jnp.maximum(meta.total_recv_P1.astype(jnp.float32) - self.capacity, 0)
    f32 = jnp.float32
    return {
      "rows_sent": jnp.sum(needs_TP).astype(f32),
      "rows_sent_no_dedup": f32(t * k),
      "buffer_rows": f32(self.num_ranks * self.capacity),
      "dropped": jnp.sum(over),
    }


def te_ep_block(
  dispatcher: TeEpDispatcher,
  experts: Callable,
  x_TD,
  ids_TK,
  weights_TK,
  w_EDF: tuple,
  *,
  mesh: Any,
  token_axes: tuple[str, ...],
  expert_axis: str,
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """dispatch (mesh) -> experts(rows, group_sizes, *w) per shard -> combine (mesh). Tokens are split over
  (data or fsdp, expert), the layout TE's EP serves (settings.check_te_ep_layout)."""
  check_te_ep_layout(
    {a: mesh.shape[a] for a in token_axes}, num_experts=dispatcher.num_experts, expert_axis=expert_axis
  )
  lead = P(token_axes)
  x_TD, ids_TK, weights_TK = (
    jax.lax.with_sharding_constraint(a, NamedSharding(mesh, lead)) for a in (x_TD, ids_TK, weights_TK)
  )
  rows_PCD, counts_PE, meta = dispatcher.dispatch(x_TD, ids_TK, weights_TK)

  def per_shard(rows_1CD, counts_1E, *w):
    return experts(rows_1CD[0], counts_1E[0], *w)[None]

  wspec = P(expert_axis)
  out_PCD = jax.shard_map(
    per_shard, mesh=mesh, in_specs=(lead, lead, *(wspec,) * len(w_EDF)), out_specs=lead, check_vma=False
  )(rows_PCD, counts_PE, *w_EDF)
  return dispatcher.combine(out_PCD, meta), dispatcher.stats(ids_TK, meta)
