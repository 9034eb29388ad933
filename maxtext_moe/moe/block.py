"""The dropless MoE block: dispatch, experts, combine; plus the mesh wrapper that runs it per device.

`routed_experts` is single-device math that reads top to bottom. `moe_block` runs it under `shard_map`:
tokens split over every mesh axis, experts split over the expert axis (all-gathered over the others); a
dispatcher that declares `mesh_level` (TE's NCCL EP) runs on the mesh instead. Routing (scores, top-k,
bias) stays with the caller, so MaxText's DeepSeek-V3 routing is used unchanged.

Shape legend: T tokens, K top-k, D model dim, F expert hidden dim, E experts, R rows.
"""

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from maxtext_moe.moe import fp8_gather
from maxtext_moe.moe import settings as rules
from maxtext_moe.moe.collectives import all_gather_dims
from maxtext_moe.moe.dispatch import Dispatcher, Routing
from maxtext_moe.moe.gemm import grouped_matmul
from maxtext_moe.moe.registry import DispatchSpec, make_dispatcher
from maxtext_moe.moe.settings import MoESettings
from maxtext_moe.moe.stats import DispatchStats

_ACTIVATIONS = {"silu": jax.nn.silu, "gelu": jax.nn.gelu, "relu": jax.nn.relu}
_WI_0, _WI_1, _WO = rules.REMAT_NAMES


def _gmm(rows_RD, w_EDF, group_sizes_E, name: str, settings: MoESettings) -> jax.Array:
  """The one grouped-GEMM call site, its output tagged with MaxText's remat name unless the dispatch
  recomputes it whatever the policy says (`rules.outputs_recomputed`: the rounds)."""
  out = grouped_matmul(
    rows_RD,
    w_EDF,
    group_sizes_E,
    backend=settings.gemm,
    window_sizes_L=settings.window_sizes,
    quantization=settings.quantization,
  )
  if rules.outputs_recomputed(settings.dispatch, settings.buffers, nodes=settings.ep_nodes):
    return out
  return checkpoint_name(out, name)


def expert_mlp(rows_RD, group_sizes_E, w0_EDF, w1_EDF, wo_EFD, *, settings: MoESettings) -> jax.Array:
  """Gated MLP per expert: act(x @ w0) * (x @ w1) @ wo."""
  act = _ACTIVATIONS[settings.activation]
  hidden_RF = act(_gmm(rows_RD, w0_EDF, group_sizes_E, _WI_0, settings)) * _gmm(
    rows_RD, w1_EDF, group_sizes_E, _WI_1, settings
  )
  return _gmm(hidden_RF.astype(rows_RD.dtype), wo_EFD, group_sizes_E, _WO, settings)


@dataclasses.dataclass(frozen=True)
class GatedExperts:
  """The routed experts (`dispatch.Experts`): their weights (w0_EDF, w1_EDF, wo_EFD) and the gated MLP."""

  weights: tuple[jax.Array, ...]
  settings: MoESettings

  def __call__(self, rows_RD: jax.Array, group_sizes_E: jax.Array) -> jax.Array:
    return expert_mlp(rows_RD, group_sizes_E, *self.weights, settings=self.settings)

  def with_weights(self, weights: tuple[jax.Array, ...]) -> "GatedExperts":
    return dataclasses.replace(self, weights=tuple(weights))


def routed_experts(
  x_TD, ids_TK, weights_TK, w0_EDF, w1_EDF, wo_EFD, *, dispatcher: Dispatcher, settings: MoESettings
) -> tuple[jax.Array, DispatchStats]:
  """route (given) -> dispatch -> experts -> combine, on one device. Returns (y_TD, the dispatcher's stats)."""
  experts = GatedExperts((w0_EDF, w1_EDF, wo_EFD), settings)
  return dispatcher.run(x_TD, Routing(ids_TK, weights_TK), experts)


def expert_load(ids_TK: jax.Array, *, num_experts: int) -> jax.Array:
  """Assignments per expert, [E] float32."""
  return jnp.bincount(ids_TK.reshape(-1), length=num_experts).astype(jnp.float32)


def _token_axes(
  mesh: Mesh, num_tokens: int, vmapped: tuple[str, ...] = (), first: tuple[str, ...] = ()
) -> tuple[str, ...]:
  """Mesh axes of size > 1, over which tokens are split evenly (less those a surrounding vmap maps): those
  in `first` in its order, then the others in the mesh's."""
  split = [a for a in mesh.axis_names if mesh.shape[a] > 1 and a not in vmapped]
  token_axes = tuple(a for a in dict.fromkeys(first) if a in split) + tuple(a for a in split if a not in first)
  n_shards = math.prod(mesh.shape[a] for a in token_axes)
  if num_tokens % n_shards:
    raise ValueError(f"MoE block: {num_tokens} tokens do not split evenly over {n_shards} devices")
  return token_axes


def _resolved(settings: MoESettings, *, top_k: int, ep: int) -> MoESettings:
  """`settings` with `auto` dispatch turned into this platform's choice and the routing's top-k."""
  dispatch = rules.resolve_dispatch(
    settings.dispatch,
    ep=ep,
    platform=rules.detect_platform(),
    capacity_factor=settings.capacity_factor,
    nodes=settings.ep_nodes,
  )
  return dataclasses.replace(settings, dispatch=dispatch, top_k=top_k)


def moe_block(
  x_TD,
  ids_TK,
  weights_TK,
  w0_EDF,
  w1_EDF,
  wo_EFD,
  *,
  mesh: Mesh,
  expert_axis: str | None,
  settings: MoESettings,
  vmapped_axes: tuple[str, ...] = (),
  weight_specs: tuple[P, P, P] | None = None,
  token_order: tuple[str, ...] = (),
) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Runs the routed experts on every device of `mesh`. Returns (y_TD, stats) with stats summed over
  devices: the dispatcher's (`stats.DispatchStats`) and `load`, the [E] assignments per expert.

  Tokens are split over all mesh axes of size > 1 (T must divide evenly); each device computes with its
  experts (split over `expert_axis`, size EP) whole. `weight_specs`: how the three expert weights are stored
  over the mesh (their logical axes resolved; None: over `expert_axis` alone). The block takes them so and
  gathers every other axis itself (`_gathered`), so that their gradients leave it reduce-scattered to the
  same split: a weight taken replicated has its whole gradient all-reduced over every token axis instead
  (XLA:GPU's program of the 671B at EP 16 x FSDP 8 x data 2 did that, 75 GiB per step and GPU). `vmapped_axes`:
  mesh axes a surrounding `vmap` maps its batch onto (`spmd_axis_name`: MaxText's pipeline runs one stage
  per slice of `stage`); each slice's tokens are split over the other axes, and shard_map maps the vmapped
  dimension onto these itself. `token_order`: the axes tokens arrive split over, split first (docs/moe-block.md).
  """
  num_experts = w0_EDF.shape[0]
  token_axes = _token_axes(mesh, x_TD.shape[0], vmapped_axes, token_order)
  spec = DispatchSpec(
    _resolved(settings, top_k=ids_TK.shape[1], ep=mesh.shape[expert_axis] if expert_axis else 1),
    num_experts,
    mesh,
    expert_axis,
    token_axes,
    x_TD.shape[0] // math.prod(mesh.shape[a] for a in token_axes),
  )
  dispatcher = make_dispatcher(spec)
  experts = GatedExperts((w0_EDF, w1_EDF, wo_EFD), spec.settings)
  if dispatcher.mesh_level:
    y_TD, stats = dispatcher.run(x_TD, Routing(ids_TK, weights_TK), experts)
    return y_TD, stats.as_dict() | {"load": expert_load(ids_TK, num_experts=num_experts)}

  stored = weight_specs or (P(expert_axis if spec.ep > 1 else None),) * 3
  stored = tuple(_on_mesh(s, mesh, vmapped_axes) for s in stored)

  def per_device(x, ids, w, *expert_weights):
    fp8 = spec.settings.fp8_gather
    whole = tuple(_gathered(wt, s, keep=expert_axis, fp8=fp8) for wt, s in zip(expert_weights, stored, strict=True))
    y, stats = dispatcher.run(x, Routing(ids, w), experts.with_weights(whole))
    load = expert_load(ids, num_experts=num_experts)
    load = jax.lax.psum(load, token_axes) if token_axes else load
    return y, stats.over_devices(token_axes).as_dict() | {"load": load}

  tok = P(token_axes or None)
  y_TD, stats = jax.shard_map(
    per_device, mesh=mesh, in_specs=(tok, tok, tok, *stored), out_specs=(tok, P()), check_vma=False
  )(x_TD, ids_TK, weights_TK, w0_EDF, w1_EDF, wo_EFD)
  return y_TD, stats


def _axes(entry) -> tuple[str, ...]:
  """A PartitionSpec entry's mesh axes (None, one name, or a tuple of names)."""
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _on_mesh(spec: P, mesh: Mesh, vmapped: tuple[str, ...]) -> P:
  """`spec` with the axes of size 1 and those a surrounding vmap maps (`vmapped_axes`) left out."""
  kept = [tuple(a for a in _axes(e) if mesh.shape[a] > 1 and a not in vmapped) for e in spec]
  return P(*(k if len(k) > 1 else k[0] if k else None for k in kept))


def _gathered(w: jax.Array, spec: P, *, keep: str | None, fp8: bool = False) -> jax.Array:
  """One device's whole expert weight from its stored shard (`spec`, inside shard_map): every split gathered
  but `keep`'s (the expert axis) on the experts' dimension. The transpose of each all-gather is a
  reduce-scatter, so the weight's gradient leaves the block split as it is stored. `fp8`: moved as TE's
  e4m3 codes and scales (`fp8_gather`), for TE's FP8 grouped GEMM."""
  gathers = []
  for dim, entry in enumerate(spec):
    axes = tuple(a for a in _axes(entry) if not (dim == 0 and a == keep))
    if axes:
      gathers.append((dim, axes))
  if fp8 and gathers:
    return fp8_gather.gathered(w, tuple(gathers))
  return all_gather_dims(w, tuple(gathers))
