"""The dispatcher for each `moe_dispatch`: one factory per kind, looked up in `DISPATCHERS`.

A factory takes what the block knows of the call (`DispatchSpec`) and returns an object that implements
`dispatch.Dispatcher`. Adding a dispatcher is its module, one entry here and its tests (docs/contributing.md).
"""

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax

from maxtext_moe.moe import exchange
from maxtext_moe.moe import settings as rules
from maxtext_moe.moe.dispatch import Dispatcher, ExpertParallelDispatcher, LocalDispatcher
from maxtext_moe.moe.rounds import RoundsDispatcher
from maxtext_moe.moe.settings import DispatchKind, MoESettings
from maxtext_moe.moe.te_ep import TeEpDispatcher
from maxtext_moe.upstream.te import calls as te  # the TE seam, a leaf module: it imports nothing of ours


@dataclass(frozen=True)
class DispatchSpec:
  """One call of the block: its settings (`auto` resolved), experts, mesh and token split."""

  settings: MoESettings
  num_experts: int
  mesh: Any
  expert_axis: str | None
  token_axes: tuple[str, ...]
  tokens_per_rank: int

  @property
  def ep(self) -> int:
    return self.mesh.shape[self.expert_axis] if self.expert_axis else 1


def _local(spec: DispatchSpec) -> Dispatcher:
  return LocalDispatcher(spec.num_experts)


def _exchanged(spec: DispatchSpec, *, ragged: bool) -> Dispatcher:
  """all_to_all / ragged_all_to_all: bounded rounds, or one worst-case (or capped) exchange; across nodes
  the two levels of `moe.levels` in rounds (worst-case budgets with moe_buffers=worst_case)."""
  s = spec.settings
  if ragged:
    collective = s.ragged_exchange or jax.lax.ragged_all_to_all
    exchanges = (exchange.Exchange(spec.expert_axis, spec.ep, spec.num_experts // spec.ep, True, collective),)
  else:
    exchanges = exchange.for_levels(spec.expert_axis, num_experts=spec.num_experts, ranks=spec.ep, nodes=s.ep_nodes)
  if rules.runs_in_rounds(s.dispatch, s.buffers) or len(exchanges) > 1:
    worst = not rules.runs_in_rounds(s.dispatch, s.buffers)
    return RoundsDispatcher(
      spec.num_experts, exchanges, s.buffer_factor, s.routing_groups, s.exchange_chunks, worst_case=worst
    )
  return ExpertParallelDispatcher(spec.num_experts, exchanges[0], s.capacity_factor)


def _te_ep(spec: DispatchSpec) -> Dispatcher:
  s = spec.settings
  capacity = s.te_recv_capacity or te.recv_capacity(
    num_experts=spec.num_experts,
    top_k=s.top_k,
    tokens_per_rank=spec.tokens_per_rank,
    ep_size=spec.ep,
    factor=s.capacity_factor,
  )
  return TeEpDispatcher(spec.num_experts, capacity, spec.mesh, spec.token_axes, spec.expert_axis)


DISPATCHERS: dict[DispatchKind, Callable[[DispatchSpec], Dispatcher]] = {
  DispatchKind.LOCAL: _local,
  DispatchKind.ALL_TO_ALL: lambda spec: _exchanged(spec, ragged=False),
  DispatchKind.RAGGED_ALL_TO_ALL: lambda spec: _exchanged(spec, ragged=True),
  DispatchKind.TE_EP: _te_ep,
}


def make_dispatcher(spec: DispatchSpec) -> Dispatcher:
  """The dispatcher `spec.settings.dispatch` names (already resolved from `auto`), after its checks."""
  s = spec.settings
  rules.check_dispatch(s.dispatch, ep=spec.ep, capacity_factor=s.capacity_factor, nodes=s.ep_nodes)
  rules.check_buffers(s.dispatch, s.buffers, capacity_factor=s.capacity_factor, nodes=s.ep_nodes)
  return DISPATCHERS[DispatchKind(s.dispatch)](spec)
