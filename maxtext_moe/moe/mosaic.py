"""The grouped GEMM on an NVIDIA GPU without Transformer Engine: tokamax's Pallas Mosaic GPU kernels.

Why this and not the others on a GPU: XLA:GPU rewrites `jax.lax.ragged_dot` to a dense dot, and the
portable `tiled` backend (one size-bucketed window per expert under a `lax.switch`) compiles on XLA:GPU to
a `conditional` per expert and GEMM, each a host sync (docs/gpu-path.md). tokamax 0.0.17's Mosaic kernel
compiles to one custom call (`mosaic_gpu_v2`) per GEMM with no conditional, forward and backward.

- SM 9.x (Hopper): the forward, dX and dW are all tokamax's Mosaic kernels (its own VJP).
- SM 10.x (Blackwell): tokamax has no Mosaic kernel for dW (a ragged contracting dimension, "Only default
  `ragged_dot_dimension_numbers` supported"), so dW is `tiled_weight_grad`: fixed row tiles, each inside one
  expert's rows, a loop of known trip count (no data-dependent branch), accumulated in float32. On
  Blackwell the container's path is TE's grouped GEMM; this one is what runs without it.

The kernel is picked by the default device's compute capability (a compile for a GPU that is not there
runs under `jax.default_device` of a compile-only device). Shape legend: R rows, D in dim, F out dim,
E experts, N tiles, M tile rows.
"""

import jax
import jax.numpy as jnp
from jax import lax

TILE_ROWS = 512  # dW tiles: one [M, D]^T [M, F] product each; at most one partial tile per expert
ROW_ALIGN = 128  # the Mosaic kernels' row tiling (at most 128 in tokamax 0.0.17's configurations)


def compute_capability() -> tuple[int, int]:
  """(major, minor) of the default device; (0, 0) where it reports none (not a CUDA GPU)."""
  from jax.extend import backend  # pylint: disable=import-outside-toplevel

  cc = str(getattr(backend.get_default_device(), "compute_capability", "") or "0.0")
  major, _, minor = cc.partition(".")
  return int(major), int(minor or 0)


def tile_plan(group_sizes_E: jax.Array, *, num_rows: int, tile: int) -> tuple[jax.Array, jax.Array, jax.Array]:
  """Cuts each expert's rows into tiles of at most `tile` rows: (expert_N, start_N, end_N) for the
  N = ceil(num_rows / tile) + E tiles there can be; tiles past the last are empty (start = end = 0).

  Example: group_sizes_E = [5, 0, 2], num_rows=7, tile=4 -> N = 2 + 3 = 5 tiles,
    expert_N = [0, 0, 2, 0, 0], start_N = [0, 4, 5, 0, 0], end_N = [4, 5, 7, 0, 0].
  """
  num_experts = group_sizes_E.shape[0]
  n = -(-num_rows // tile) + num_experts
  tiles_E = -(-group_sizes_E // tile)
  last_E = jnp.cumsum(tiles_E)
  start_E = jnp.cumsum(group_sizes_E) - group_sizes_E
  t_N = jnp.arange(n)
  expert_N = jnp.minimum(jnp.searchsorted(last_E, t_N, side="right"), num_experts - 1)
  used_N = t_N < last_E[-1]
  start_N = start_E[expert_N] + (t_N - (last_E[expert_N] - tiles_E[expert_N])) * tile
  end_N = jnp.minimum(start_N + tile, start_E[expert_N] + group_sizes_E[expert_N])
  zero = jnp.zeros_like(start_N)
  return jnp.where(used_N, expert_N, 0), jnp.where(used_N, start_N, zero), jnp.where(used_N, end_N, zero)


def tiled_weight_grad(rows_RD: jax.Array, grad_RF: jax.Array, group_sizes_E: jax.Array, *, tile: int) -> jax.Array:
  """dW[e] = rows_e^T @ grad_e, [E, D, F] float32, one tile per iteration of a fixed-length loop."""
  num_rows = rows_RD.shape[0]
  tile = min(tile, num_rows)
  expert_N, start_N, end_N = tile_plan(group_sizes_E, num_rows=num_rows, tile=tile)

  def body(t, dw):
    first = jnp.minimum(start_N[t], num_rows - tile)
    pos_M = first + jnp.arange(tile)
    mine_M1 = ((pos_M >= start_N[t]) & (pos_M < end_N[t]))[:, None]
    x = jnp.where(mine_M1, lax.dynamic_slice_in_dim(rows_RD, first, tile), 0)
    g = lax.dynamic_slice_in_dim(grad_RF, first, tile)
    upd = jnp.dot(x.T, g, preferred_element_type=jnp.float32)
    return dw.at[expert_N[t]].add(upd)

  dw = jnp.zeros((group_sizes_E.shape[0], rows_RD.shape[1], grad_RF.shape[1]), jnp.float32)
  return lax.fori_loop(0, expert_N.shape[0], body, dw)


def _forward(rows_RD, w_EDF, group_sizes_E):
  import tokamax  # pylint: disable=import-outside-toplevel

  return tokamax.ragged_dot(
    rows_RD, w_EDF, group_sizes_E, implementation="mosaic_gpu", preferred_element_type=rows_RD.dtype
  )


@jax.custom_vjp
def _blackwell(rows_RD, w_EDF, group_sizes_E):
  return _forward(rows_RD, w_EDF, group_sizes_E)


def _blackwell_fwd(rows_RD, w_EDF, group_sizes_E):
  return _forward(rows_RD, w_EDF, group_sizes_E), (rows_RD, w_EDF, group_sizes_E)


def _blackwell_bwd(res, grad_RF):
  rows_RD, w_EDF, group_sizes_E = res
  d_rows = _forward(grad_RF.astype(rows_RD.dtype), jnp.swapaxes(w_EDF, 1, 2), group_sizes_E)
  d_w = tiled_weight_grad(rows_RD, grad_RF, group_sizes_E, tile=TILE_ROWS).astype(w_EDF.dtype)
  return d_rows, d_w, None


_blackwell.defvjp(_blackwell_fwd, _blackwell_bwd)


def grouped_matmul(rows_RD: jax.Array, w_EDF: jax.Array, group_sizes_E: jax.Array) -> jax.Array:
  """out[r] = rows[r] @ w[e(r)] by tokamax's Mosaic GPU kernels (SM 9.x and 10.x); rows past
  sum(group_sizes) give zeros. The kernels take a multiple of ROW_ALIGN rows: the rows are padded with
  rows outside every group (their outputs are dropped)."""
  num_rows = rows_RD.shape[0]
  padded = -(-num_rows // ROW_ALIGN) * ROW_ALIGN
  rows_PD = jnp.pad(rows_RD, ((0, padded - num_rows), (0, 0)))
  real_P1 = (jnp.arange(padded) < jnp.sum(group_sizes_E))[:, None]
  if compute_capability()[0] >= 10:
    out = _blackwell(rows_PD, w_EDF, group_sizes_E)
  else:
    out = _forward(rows_PD, w_EDF, group_sizes_E)
  return jnp.where(real_P1, out, 0)[:num_rows].astype(rows_RD.dtype)
