"""The dropless MoE block: dispatch, experts, combine; plus the mesh wrapper that runs it per device.

`routed_experts` is single-device math that reads top to bottom. `moe_block` runs it under `shard_map`:
tokens split over every mesh axis, experts split over the expert axis (all-gathered over the others).
Routing (scores, top-k, bias) stays with the caller, so MaxText's DeepSeek-V3 routing is used unchanged.

Shape legend: T tokens, K top-k, D model dim, F expert hidden dim, E experts, R rows.
"""

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from maxtext_moe.moe.dispatch import AllToAllDispatcher, LocalDispatcher, RaggedAllToAllDispatcher
from maxtext_moe.moe.gemm import GemmBackend, grouped_matmul


class DispatchKind(StrEnum):
  AUTO = "auto"  # local without expert parallelism; with it, ragged_all_to_all on GPU/TPU, all_to_all on CPU
  LOCAL = "local"
  ALL_TO_ALL = "all_to_all"
  RAGGED_ALL_TO_ALL = "ragged_all_to_all"


_ACTIVATIONS = {"silu": jax.nn.silu, "gelu": jax.nn.gelu, "relu": jax.nn.relu}


@dataclass(frozen=True)
class MoESettings:
  """How the routed experts run. Chosen by config keys (maxtext_moe.config.keys)."""

  dispatch: DispatchKind = DispatchKind.AUTO
  gemm: GemmBackend = GemmBackend.AUTO
  capacity_factor: float = 0.0
  activation: str = "silu"
  # The ragged dispatcher's collective; None: jax.lax.ragged_all_to_all. Tests on XLA:CPU pass
  # collectives.ragged_all_to_all_reference.
  ragged_exchange: Callable | None = None
  window_sizes: tuple[int, ...] | None = None  # the `tiled` GEMM's ladder; None: permute.window_sizes


def expert_mlp(rows_RD, group_sizes_E, w0_EDF, w1_EDF, wo_EFD, *, settings: MoESettings) -> jax.Array:
  """Gated MLP per expert: act(x @ w0) * (x @ w1) @ wo, through the one grouped-GEMM call site."""

  def gmm(x, w, name):
    # MaxText's remat names, so remat_policy=custom (and the offload presets) can save or offload them.
    return checkpoint_name(
      grouped_matmul(x, w, group_sizes_E, backend=settings.gemm, window_sizes_L=settings.window_sizes), name
    )

  hidden_RF = _ACTIVATIONS[settings.activation](gmm(rows_RD, w0_EDF, "moe_mlpwi_0")) * gmm(
    rows_RD, w1_EDF, "moe_mlpwi_1"
  )
  return gmm(hidden_RF.astype(rows_RD.dtype), wo_EFD, "moe_mlpwo")


def routed_experts(x_TD, ids_TK, weights_TK, w0_EDF, w1_EDF, wo_EFD, *, dispatcher, settings: MoESettings):
  """route (given) -> dispatch -> experts -> combine. Returns (y_TD, per-device stats)."""
  rows_RD, group_sizes_E, meta = dispatcher.dispatch(x_TD, ids_TK, weights_TK)
  out_RD = expert_mlp(rows_RD, group_sizes_E, w0_EDF, w1_EDF, wo_EFD, settings=settings)
  y_TD = dispatcher.combine(out_RD, meta)
  return y_TD, dispatcher.stats(ids_TK)


def _make_dispatcher(settings: MoESettings, *, num_experts: int, ep: int, expert_axis: str | None):
  kind = resolve_dispatch(settings.dispatch, ep=ep, capacity_factor=settings.capacity_factor)
  if kind == DispatchKind.LOCAL:
    if ep != 1:
      raise ValueError(f"moe_dispatch=local needs expert parallelism 1, got {ep}; use all_to_all")
    return LocalDispatcher(num_experts)
  if kind == DispatchKind.RAGGED_ALL_TO_ALL:
    if settings.capacity_factor > 0:
      raise ValueError("moe_dispatch=ragged_all_to_all is always dropless; set moe_capacity_factor=0")
    exchange = settings.ragged_exchange or jax.lax.ragged_all_to_all
    return RaggedAllToAllDispatcher(num_experts, ep, expert_axis, exchange)
  return AllToAllDispatcher(num_experts, ep, expert_axis, settings.capacity_factor)


def resolve_dispatch(
  kind: DispatchKind | str, *, ep: int, capacity_factor: float = 0.0, platform: str | None = None
) -> DispatchKind:
  """Turns `auto` into a concrete dispatcher: local without EP; with EP, ragged_all_to_all where XLA has
  it (GPU/TPU) unless a capacity is set, else the portable all_to_all."""
  kind = DispatchKind(kind)
  if kind != DispatchKind.AUTO:
    return kind
  if ep == 1:
    return DispatchKind.LOCAL
  platform = platform or jax.default_backend()
  if platform == "cpu" or capacity_factor > 0:
    return DispatchKind.ALL_TO_ALL
  return DispatchKind.RAGGED_ALL_TO_ALL


def expert_load(ids_TK: jax.Array, *, num_experts: int) -> jax.Array:
  """Assignments per expert, [E] float32."""
  return jnp.bincount(ids_TK.reshape(-1), length=num_experts).astype(jnp.float32)


def moe_block(
  x_TD, ids_TK, weights_TK, w0_EDF, w1_EDF, wo_EFD, *, mesh: Mesh, expert_axis: str | None, settings: MoESettings
):
  """Runs `routed_experts` on every device of `mesh`. Returns (y_TD, stats) with stats summed over devices.

  Tokens are split over all mesh axes of size > 1 (T must divide evenly); expert weights are split over
  `expert_axis` (size EP) and replicated over the rest.
  """
  num_experts = w0_EDF.shape[0]
  ep = mesh.shape[expert_axis] if expert_axis else 1
  token_axes = tuple(a for a in mesh.axis_names if mesh.shape[a] > 1)
  n_shards = 1
  for a in token_axes:
    n_shards *= mesh.shape[a]
  if x_TD.shape[0] % n_shards:
    raise ValueError(f"MoE block: {x_TD.shape[0]} tokens do not split evenly over {n_shards} devices")
  dispatcher = _make_dispatcher(settings, num_experts=num_experts, ep=ep, expert_axis=expert_axis)
  tok = P(token_axes or None)
  wspec = P(expert_axis if ep > 1 else None)

  def per_device(x, ids, w, w0, w1, wo):
    y, stats = routed_experts(x, ids, w, w0, w1, wo, dispatcher=dispatcher, settings=settings)
    stats["load"] = expert_load(ids, num_experts=num_experts)
    if token_axes:
      stats = jax.lax.psum(stats, token_axes)
    return y, stats

  fn = jax.shard_map(
    per_device, mesh=mesh, in_specs=(tok, tok, tok, wspec, wspec, wspec), out_specs=(tok, P()), check_vma=False
  )
  return fn(x_TD, ids_TK, weights_TK, w0_EDF, w1_EDF, wo_EFD)
