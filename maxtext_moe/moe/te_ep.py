"""`te_ep`: Transformer Engine's NCCL EP as a dispatcher, at the mesh level.

TE's dispatch and combine are collectives with sharding rules of their own: they take global arrays whose
leading (token) dimension is sharded over (data, fsdp, expert), not per-device blocks inside shard_map as
our other dispatchers do. So it declares `mesh_level` and runs dispatch and combine on the mesh and only the experts per
shard. NCCL EP sends a token once per destination rank (deduplicated, and aggregated inside an NVLink
domain before crossing nodes) and lays the receive buffer out by local expert in 128-row blocks: the
grouped GEMM's groups, with zero rows between them. Its combine is unweighted, so the expert outputs are
weighted first; padded receive slots are ignored by combine.

The receive capacity must equal the one TE EP was bootstrapped with (`upstream.te.calls.bootstrap`, once per
process, before the step is traced). Dropless by default: TE's worst case. The aux-loss-free bias update
needs nothing from TE: MaxText computes it from the top-k ids before dispatch.

Shape legend: T tokens (global), K top-k, D model dim, P ranks, C receive capacity per rank, E_l local
experts.
"""

from dataclasses import dataclass
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from maxtext_moe.moe import permute
from maxtext_moe.moe.dispatch import Experts, Routing
from maxtext_moe.moe.mesh_axes import check_te_ep_layout
from maxtext_moe.moe.stats import DispatchStats
from maxtext_moe.upstream.te import calls as te  # the TE seam, a leaf module: it imports nothing of ours


@dataclass(frozen=True)
class TeEpDispatcher:
  """Experts split evenly over the mesh's expert axis (P ranks), moved by TE's NCCL EP, at mesh level.
  Tokens are split over (data or fsdp, expert), the layout TE's EP serves (mesh_axes.check_te_ep_layout)."""

  mesh_level: ClassVar[bool] = True

  num_experts: int
  capacity: int  # rows each rank receives per call; exactly the bootstrapped one
  mesh: Any
  token_axes: tuple[str, ...]
  expert_axis: str

  @property
  def num_ranks(self) -> int:
    return self.mesh.shape[self.expert_axis]

  def run(self, x_TD: jax.Array, routing: Routing, experts: Experts) -> tuple[jax.Array, DispatchStats]:
    """dispatch (mesh) -> experts(rows, group_sizes) per shard -> combine (mesh)."""
    check_te_ep_layout(
      {a: self.mesh.shape[a] for a in self.token_axes}, num_experts=self.num_experts, expert_axis=self.expert_axis
    )
    lead = P(self.token_axes)
    x_TD, ids_TK, weights_TK = (
      jax.lax.with_sharding_constraint(a, NamedSharding(self.mesh, lead))
      for a in (x_TD, routing.ids_TK, routing.weights_TK)
    )
    rows_PCD, recv_w_PC, counts_PE, handle, total_P1 = te.ep_dispatch(x_TD, ids_TK, weights_TK, capacity=self.capacity)

    def per_shard(rows_1CD, counts_1E, *w):
      return experts.with_weights(w)(rows_1CD[0], counts_1E[0])[None]

    wspec = P(self.expert_axis)
    out_PCD = jax.shard_map(
      per_shard,
      mesh=self.mesh,
      in_specs=(lead, lead, *(wspec,) * len(experts.weights)),
      out_specs=lead,
      check_vma=False,
    )(rows_PCD.astype(x_TD.dtype), counts_PE, *experts.weights)
    weighted_PCD = out_PCD * recv_w_PC[..., None].astype(out_PCD.dtype)  # TE's combine is unweighted
    y_TD = te.ep_combine(weighted_PCD, counts_PE, handle, num_tokens=x_TD.shape[0]).astype(x_TD.dtype)
    return y_TD, self._stats(ids_TK, total_P1)

  def _stats(self, ids_TK: jax.Array, total_recv_P1: jax.Array) -> DispatchStats:
    """Global: wire rows with and without dedup, receive buffer rows, assignments past the capacity."""
    t, k = ids_TK.shape
    needs_TP = permute.distinct_ranks(
      ids_TK, experts_per_rank=self.num_experts // self.num_ranks, num_ranks=self.num_ranks
    )
    over = jnp.maximum(total_recv_P1.astype(jnp.float32) - self.capacity, 0)
    return DispatchStats.of(
      rows_sent=jnp.sum(needs_TP),
      rows_sent_no_dedup=t * k,
      buffer_rows=self.num_ranks * self.capacity,
      dropped=jnp.sum(over),
    )
