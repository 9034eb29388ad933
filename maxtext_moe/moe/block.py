"""The dropless MoE block: dispatch, experts, combine; plus the mesh wrapper that runs it per device.

`routed_experts` is single-device math that reads top to bottom. `moe_block` runs it under `shard_map`:
tokens split over every mesh axis, experts split over the expert axis (all-gathered over the others).
Routing (scores, top-k, bias) stays with the caller, so MaxText's DeepSeek-V3 routing is used unchanged.

Shape legend: T tokens, K top-k, D model dim, F expert hidden dim, E experts, R rows.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from maxtext_moe.moe import collectives
from maxtext_moe.moe import settings as rules
from maxtext_moe.moe.dispatch import AllToAllDispatcher, Dispatcher, LocalDispatcher, RaggedAllToAllDispatcher
from maxtext_moe.moe.gemm import grouped_matmul
from maxtext_moe.moe.rounds import RoundsDispatcher
from maxtext_moe.moe.settings import DispatchKind, MoESettings
from maxtext_moe.moe.stats import MAX_STATS
from maxtext_moe.moe.te_ep import TeEpDispatcher, te_ep_block
from maxtext_moe.upstream import te  # the TE seam, a leaf module: it imports nothing of ours

_ACTIVATIONS = {"silu": jax.nn.silu, "gelu": jax.nn.gelu, "relu": jax.nn.relu}
_WI_0, _WI_1, _WO = rules.REMAT_NAMES


def _gmm(rows_RD, w_EDF, group_sizes_E, name: str, settings: MoESettings) -> jax.Array:
  """The one grouped-GEMM call site, tagged with MaxText's remat name for the output."""
  out = grouped_matmul(
    rows_RD,
    w_EDF,
    group_sizes_E,
    backend=settings.gemm,
    window_sizes_L=settings.window_sizes,
    quantization=settings.quantization,
  )
  return checkpoint_name(out, name)


def expert_mlp(rows_RD, group_sizes_E, w0_EDF, w1_EDF, wo_EFD, *, settings: MoESettings) -> jax.Array:
  """Gated MLP per expert: act(x @ w0) * (x @ w1) @ wo."""
  act = _ACTIVATIONS[settings.activation]
  hidden_RF = act(_gmm(rows_RD, w0_EDF, group_sizes_E, _WI_0, settings)) * _gmm(
    rows_RD, w1_EDF, group_sizes_E, _WI_1, settings
  )
  return _gmm(hidden_RF.astype(rows_RD.dtype), wo_EFD, group_sizes_E, _WO, settings)


def routed_experts(
  x_TD, ids_TK, weights_TK, w0_EDF, w1_EDF, wo_EFD, *, dispatcher: Dispatcher, settings: MoESettings
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """route (given) -> dispatch -> experts -> combine. Returns (y_TD, per-device stats). A bounded-memory
  dispatcher (`rounds.RoundsDispatcher`) runs the experts itself, once per round."""
  if isinstance(dispatcher, RoundsDispatcher):
    experts = functools.partial(expert_mlp, w0_EDF=w0_EDF, w1_EDF=w1_EDF, wo_EFD=wo_EFD, settings=settings)
    return dispatcher.run(x_TD, ids_TK, weights_TK, experts)
  rows_RD, group_sizes_E, meta = dispatcher.dispatch(x_TD, ids_TK, weights_TK)
  out_RD = expert_mlp(rows_RD, group_sizes_E, w0_EDF, w1_EDF, wo_EFD, settings=settings)
  y_TD = dispatcher.combine(out_RD, meta)
  return y_TD, dispatcher.stats(ids_TK)


def make_dispatcher(
  settings: MoESettings, *, num_experts: int, ep: int, expert_axis: str | None, tokens_per_rank: int = 0
) -> Dispatcher | TeEpDispatcher:
  """The dispatcher `settings` asks for on this platform (`settings.resolve_dispatch` decides `auto`)."""
  kind = rules.resolve_dispatch(
    settings.dispatch, ep=ep, platform=rules.detect_platform(), capacity_factor=settings.capacity_factor
  )
  rules.check_dispatch(kind, ep=ep, capacity_factor=settings.capacity_factor)
  if kind == DispatchKind.TE_EP:
    capacity = settings.te_recv_capacity or te.recv_capacity(
      num_experts=num_experts,
      top_k=settings.top_k,
      tokens_per_rank=tokens_per_rank,
      ep_size=ep,
      factor=settings.capacity_factor,
    )
    return TeEpDispatcher(num_experts, ep, capacity)
  if kind == DispatchKind.LOCAL:
    return LocalDispatcher(num_experts)
  if settings.buffer_factor > 0:
    ragged = kind == DispatchKind.RAGGED_ALL_TO_ALL
    exchange = (settings.ragged_exchange or jax.lax.ragged_all_to_all) if ragged else collectives.all_to_all
    return RoundsDispatcher(num_experts, ep, expert_axis, settings.buffer_factor, ragged, exchange)
  if kind == DispatchKind.RAGGED_ALL_TO_ALL:
    exchange = settings.ragged_exchange or jax.lax.ragged_all_to_all
    return RaggedAllToAllDispatcher(num_experts, ep, expert_axis, exchange)
  return AllToAllDispatcher(num_experts, ep, expert_axis, settings.capacity_factor)


def _with_round_stats(stats: dict[str, jax.Array]) -> dict[str, jax.Array]:
  """Every dispatcher's stats carry the rounds fields: one round, no budget, for the worst-case ones."""
  return {"rounds": jnp.ones((), jnp.float32), "load_over_budget": jnp.zeros((), jnp.float32)} | stats


def expert_load(ids_TK: jax.Array, *, num_experts: int) -> jax.Array:
  """Assignments per expert, [E] float32."""
  return jnp.bincount(ids_TK.reshape(-1), length=num_experts).astype(jnp.float32)


def _token_axes(mesh: Mesh, num_tokens: int) -> tuple[str, ...]:
  """Mesh axes of size > 1, over which tokens are split evenly."""
  token_axes = tuple(a for a in mesh.axis_names if mesh.shape[a] > 1)
  n_shards = math.prod(mesh.shape[a] for a in token_axes)
  if num_tokens % n_shards:
    raise ValueError(f"MoE block: {num_tokens} tokens do not split evenly over {n_shards} devices")
  return token_axes


def moe_block(
  x_TD, ids_TK, weights_TK, w0_EDF, w1_EDF, wo_EFD, *, mesh: Mesh, expert_axis: str | None, settings: MoESettings
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Runs `routed_experts` on every device of `mesh`. Returns (y_TD, stats) with stats summed over devices:
  the dispatcher's (see `Dispatcher.stats`) and `load`, the [E] assignments per expert.

  Tokens are split over all mesh axes of size > 1 (T must divide evenly); expert weights are split over
  `expert_axis` (size EP) and replicated over the rest. te_ep runs its dispatch and combine on the mesh
  itself (`te_ep.te_ep_block`).
  """
  num_experts = w0_EDF.shape[0]
  ep = mesh.shape[expert_axis] if expert_axis else 1
  token_axes = _token_axes(mesh, x_TD.shape[0])
  tokens_per_rank = x_TD.shape[0] // math.prod(mesh.shape[a] for a in token_axes)
  settings = dataclasses.replace(settings, top_k=ids_TK.shape[1])
  dispatcher = make_dispatcher(
    settings, num_experts=num_experts, ep=ep, expert_axis=expert_axis, tokens_per_rank=tokens_per_rank
  )
  if isinstance(dispatcher, TeEpDispatcher):
    experts = functools.partial(expert_mlp, settings=settings)
    y, stats = te_ep_block(
      dispatcher,
      experts,
      x_TD,
      ids_TK,
      weights_TK,
      (w0_EDF, w1_EDF, wo_EFD),
      mesh=mesh,
      token_axes=token_axes,
      expert_axis=expert_axis,
    )
    return y, _with_round_stats(stats) | {"load": expert_load(ids_TK, num_experts=num_experts)}
  tok = P(token_axes or None)
  wspec = P(expert_axis if ep > 1 else None)

  def per_device(x, ids, w, w0, w1, wo):
    y, stats = routed_experts(x, ids, w, w0, w1, wo, dispatcher=dispatcher, settings=settings)
    stats = _with_round_stats(stats) | {"load": expert_load(ids, num_experts=num_experts)}
    if token_axes:  # counts add up over devices; the rounds (already global) and load ratios do not
      stats = {k: (jax.lax.pmax if k in MAX_STATS else jax.lax.psum)(v, token_axes) for k, v in stats.items()}
    return y, stats

  fn = jax.shard_map(
    per_device, mesh=mesh, in_specs=(tok, tok, tok, wspec, wspec, wspec), out_specs=(tok, P()), check_vma=False
  )
  return fn(x_TD, ids_TK, weights_TK, w0_EDF, w1_EDF, wo_EFD)
