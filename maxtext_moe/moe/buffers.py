"""The expert-parallel buffers' sizes, written once for the dispatchers, the planner and the step-time model.

- `capacity`: rows per destination of a capped single-shot all_to_all.
- `round_budget`: the bounded rounds' budget on one node (`levels.round_levels` for every level).
- `EpBuffers`, `routed_rows`, `received_rows`: what one device's exchange holds, for any dispatch.

Pure Python (no JAX): the planner imports it.

Shape legend: T tokens per device, K top-k, P expert-parallel ranks, G a round's budget.
"""

import math
from dataclasses import dataclass

from maxtext_moe.moe import levels
from maxtext_moe.moe.settings import DEFAULT_BUFFER_FACTOR, BufferMode, DispatchKind, runs_in_rounds
from maxtext_moe.moe.te_capacity import te_ep_capacity


def capacity(num_tokens: int, top_k: int, *, num_ranks: int, capacity_factor: float) -> int:
  """Rows per destination rank in the all_to_all buffers: T when dropless (capacity_factor <= 0), else
  ceil(capacity_factor * T * K / P), at most T.

  Example: capacity(8, 3, num_ranks=4, capacity_factor=0.5) -> 3.
  """
  if capacity_factor <= 0:
    return num_tokens
  return max(1, min(num_tokens, math.ceil(capacity_factor * num_tokens * top_k / num_ranks)))


def round_budget(num_tokens: int, top_k: int, *, num_ranks: int, buffer_factor: float, local_experts: int) -> int:
  """Bounded-memory EP on one node (`moe.rounds`): G, the (row, local expert) pairs a source sends one rank per
  round, ceil(buffer_factor x T x K / P), at least K (any one row fits), at most T x min(K, E_l)
  (`levels.round_levels`' one level).

  Example: round_budget(64, 4, num_ranks=8, buffer_factor=1.5, local_experts=2) -> 48.
  """
  sizes = levels.round_levels(
    num_tokens, top_k, num_experts=local_experts * num_ranks, ranks=num_ranks, buffer_factor=buffer_factor
  )
  return sizes[-1].budget


@dataclass(frozen=True)
class EpBuffers:
  """What sizes one device's expert exchange: its dispatch and buffers, the expert-parallel ranks and the
  nodes they span, the routing groups and the chunks (the settings' and the mesh's, for the planner)."""

  kind: DispatchKind | str
  buffers: BufferMode | str
  num_ranks: int
  num_experts: int
  capacity_factor: float = 0.0
  buffer_factor: float = DEFAULT_BUFFER_FACTOR
  nodes: int = 1
  routing_groups: tuple[int, int] = (0, 0)
  chunks: int = 1

  def rounds(self, num_tokens: int, top_k: int) -> tuple[int, tuple[levels.LevelSizes, ...]] | None:
    """(chunks, each chunk's levels) of the rounds this exchange runs, or None (single shot)."""
    if not runs_in_rounds(self.kind, self.buffers, nodes=self.nodes):
      return None
    chunks = self.chunks if self.chunks > 1 and num_tokens % self.chunks == 0 else 1
    sizes = levels.round_levels(
      num_tokens // chunks,
      top_k,
      num_experts=self.num_experts,
      ranks=self.num_ranks,
      nodes=self.nodes if DispatchKind(self.kind) == DispatchKind.ALL_TO_ALL else 1,
      buffer_factor=self.buffer_factor,
      routing_groups=self.routing_groups,
      worst_case=BufferMode(self.buffers) == BufferMode.WORST_CASE,
    )
    return chunks, sizes


def routed_rows(exchange: "EpBuffers", num_tokens: int, top_k: int) -> int:
  """Rows of the buffers handed to the grouped GEMM on one device (dropless sizes are worst cases):
  local T x K; all_to_all P x capacity x K; ragged_all_to_all T x P x K; te_ep TE's receive capacity
  (`te_capacity`: T x P x K at most, 128-row aligned per local expert); in rounds (`moe.rounds`) one
  round's P x (G + K - 1) of one chunk (`levels.gemm_rows`: XLA:GPU's programs hold one chunk's buffers
  at the backward's peak, the chunks' backwards running one after the other).

  Example: routed_rows(EpBuffers("all_to_all", "bounded", num_ranks=8, num_experts=64), 1024, 8)
    -> 8 x (1536 + 7) = 12344.
  """
  kind, p = DispatchKind(exchange.kind), exchange.num_ranks
  if kind == DispatchKind.LOCAL:
    return num_tokens * top_k
  if bounded := exchange.rounds(num_tokens, top_k):
    return levels.gemm_rows(bounded[1], top_k)
  if kind == DispatchKind.ALL_TO_ALL:
    return p * capacity(num_tokens, top_k, num_ranks=p, capacity_factor=exchange.capacity_factor) * top_k
  if kind == DispatchKind.TE_EP:
    return te_ep_capacity(
      num_tokens=num_tokens, top_k=top_k, num_ranks=p, num_experts=exchange.num_experts, factor=exchange.capacity_factor
    )
  return num_tokens * p * top_k


def received_rows(exchange: "EpBuffers", num_tokens: int, top_k: int) -> int:
  """Rows of the exchange's receive buffers on one device (the tokens, before their expansion to (row,
  expert) pairs): in rounds every level's of one round and chunk (`levels.received_rows`); all_to_all P x
  capacity; ragged_all_to_all T x P; none for local and te_ep (whose receive buffer is the grouped GEMM's
  own, `routed_rows`).

  Example: received_rows(EpBuffers("all_to_all", "bounded", num_ranks=8, num_experts=64), 1024, 8)
    -> 8 x min(1536, 1024) = 8192.
  """
  kind, p = DispatchKind(exchange.kind), exchange.num_ranks
  if kind in (DispatchKind.LOCAL, DispatchKind.TE_EP):
    return 0
  if bounded := exchange.rounds(num_tokens, top_k):
    return levels.received_rows(bounded[1])
  if kind == DispatchKind.ALL_TO_ALL:
    return p * capacity(num_tokens, top_k, num_ranks=p, capacity_factor=exchange.capacity_factor)
  return num_tokens * p
