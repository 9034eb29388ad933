"""Grouped GEMM: rows sorted by expert times that expert's weight. One call site, several backends.

`grouped_matmul(rows_RD, w_EDF, group_sizes_E, backend=...)` is the only entry point; the MoE layer
calls it and never a backend directly (torchtitan's "overridable seam").

Backends:
- `ragged_dot`: `jax.lax.ragged_dot`, the reference semantics. On XLA:CPU it runs at ~1.5% of a dense
  matmul of equal FLOPs (DESIGN.md).
- `tiled`: hand-written, because no library offers a fast portable grouped GEMM. Each expert's rows are
  covered by tiles of a few static sizes, big first (`permute.tile_plan`), and a `fori_loop` with a
  dynamic trip count runs only the tiles that exist: dropless, and padding stays below the smallest
  tile per expert. Its VJP is written by hand (a dynamic-trip-count loop has no reverse-mode AD):
  dX runs the same loop with transposed weights, dW accumulates X_tile^T dY_tile per expert.
- `tokamax`: `tokamax.ragged_dot`, which picks a Pallas/Mosaic kernel on GPU/TPU where one applies.
- `auto`: `tiled` on CPU, `ragged_dot` elsewhere until GPU measurements pick otherwise.
Shape legend: R rows, D in dim, F out dim, E experts, M tile rows.
"""

import functools
from enum import StrEnum

import jax
import jax.numpy as jnp
from jax import lax

from maxtext_moe.moe.permute import TilePlan, tile_plan


class GemmBackend(StrEnum):
  AUTO = "auto"
  RAGGED_DOT = "ragged_dot"
  TILED = "tiled"
  TOKAMAX = "tokamax"


# Big tiles for throughput, a small one so an expert's tail wastes < 16 rows. On 2 CPU cores at R=8192,
# D=256, F=512, E=64, (128, 16) gave the best forward+backward among (128,32,8), (256,64,16), (256,32),
# (512,64,8) and (128,16): about 0.4 of a dense matmul of equal FLOPs (fwd alone about 0.5).
DEFAULT_TILE_SIZES = (128, 16)


def resolve_backend(backend: GemmBackend | str, *, platform: str | None = None) -> GemmBackend:
  """Turns `auto` into a concrete backend for `platform` (default: JAX's default backend)."""
  backend = GemmBackend(backend)
  if backend != GemmBackend.AUTO:
    return backend
  platform = platform or jax.default_backend()
  return GemmBackend.TILED if platform == "cpu" else GemmBackend.RAGGED_DOT


def _pad_rows(x_RD: jax.Array, extra: int) -> jax.Array:
  return jnp.concatenate([x_RD, jnp.zeros((extra, x_RD.shape[1]), x_RD.dtype)])


def _row_mask(plan: TilePlan, i: jax.Array) -> jax.Array:
  return (jnp.arange(plan.tile_rows) < plan.valid_N[i])[:, None]


def _tiles_matmul(rows_RD: jax.Array, w_EDF: jax.Array, plans: list[TilePlan], *, transpose: bool) -> jax.Array:
  """out[r] = rows[r] @ w[e(r)] (or @ w[e(r)].T), one tile at a time; rows outside every tile stay zero."""
  pad = max(p.tile_rows for p in plans)
  rows = _pad_rows(rows_RD, pad)
  out = jnp.zeros((rows.shape[0], w_EDF.shape[1] if transpose else w_EDF.shape[2]), rows_RD.dtype)
  for plan in plans:

    def body(i, out, plan=plan):
      start, m = plan.start_N[i], plan.tile_rows
      w = lax.dynamic_index_in_dim(w_EDF, plan.expert_N[i], keepdims=False)
      y = jnp.dot(
        lax.dynamic_slice_in_dim(rows, start, m), w.T if transpose else w, preferred_element_type=rows_RD.dtype
      )
      y = jnp.where(_row_mask(plan, i), y, lax.dynamic_slice_in_dim(out, start, m))
      return lax.dynamic_update_slice_in_dim(out, y, start, 0)

    out = lax.fori_loop(0, plan.count, body, out)
  return out[: rows_RD.shape[0]]


def _tiles_weight_grad(rows_RD: jax.Array, grad_RF: jax.Array, plans: list[TilePlan], num_experts: int) -> jax.Array:
  """dW[e] = sum over e's tiles of rows_tile^T @ grad_tile, accumulated in f32."""
  pad = max(p.tile_rows for p in plans)
  rows, grads = _pad_rows(rows_RD, pad), _pad_rows(grad_RF, pad)
  dw = jnp.zeros((num_experts, rows_RD.shape[1], grad_RF.shape[1]), jnp.float32)
  for plan in plans:

    def body(i, dw, plan=plan):
      start, m, e = plan.start_N[i], plan.tile_rows, plan.expert_N[i]
      x = jnp.where(_row_mask(plan, i), lax.dynamic_slice_in_dim(rows, start, m), 0)
      g = lax.dynamic_slice_in_dim(grads, start, m)
      upd = lax.dynamic_index_in_dim(dw, e) + jnp.dot(x.T, g, preferred_element_type=jnp.float32)[None]
      return lax.dynamic_update_index_in_dim(dw, upd, e, 0)

    dw = lax.fori_loop(0, plan.count, body, dw)
  return dw


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _tiled(rows_RD: jax.Array, w_EDF: jax.Array, group_sizes_E: jax.Array, tile_sizes: tuple[int, ...]) -> jax.Array:
  plans = tile_plan(group_sizes_E, num_rows=rows_RD.shape[0], tile_sizes=tile_sizes)
  return _tiles_matmul(rows_RD, w_EDF, plans, transpose=False)


def _tiled_fwd(rows_RD, w_EDF, group_sizes_E, tile_sizes):
  return _tiled(rows_RD, w_EDF, group_sizes_E, tile_sizes), (rows_RD, w_EDF, group_sizes_E)


def _tiled_bwd(tile_sizes, res, grad_RF):
  rows_RD, w_EDF, group_sizes_E = res
  plans = tile_plan(group_sizes_E, num_rows=rows_RD.shape[0], tile_sizes=tile_sizes)
  d_rows = _tiles_matmul(grad_RF, w_EDF, plans, transpose=True)
  d_w = _tiles_weight_grad(rows_RD, grad_RF, plans, w_EDF.shape[0]).astype(w_EDF.dtype)
  return d_rows, d_w, None


_tiled.defvjp(_tiled_fwd, _tiled_bwd)


def grouped_matmul(
  rows_RD: jax.Array,
  w_EDF: jax.Array,
  group_sizes_E: jax.Array,
  *,
  backend: GemmBackend | str = GemmBackend.AUTO,
  tile_sizes: tuple[int, ...] | None = None,
) -> jax.Array:
  """out[r] = rows[r] @ w[e(r)], where rows are sorted by expert and group_sizes_E[e] rows belong to e.

  Args:
    rows_RD: [R, D] rows sorted by expert; rows past sum(group_sizes_E) produce zeros.
    w_EDF: [E, D, F] expert weights.
    group_sizes_E: [E] int32 rows per expert.
    backend: a `GemmBackend`.
    tile_sizes: tile row counts for the `tiled` backend, largest first.

  Returns:
    [R, F] in rows_RD's dtype.
  """
  backend = resolve_backend(backend)
  group_sizes_E = group_sizes_E.astype(jnp.int32)
  if backend == GemmBackend.RAGGED_DOT:
    return lax.ragged_dot(rows_RD, w_EDF, group_sizes_E)
  if backend == GemmBackend.TILED:
    sizes = tuple(sorted({min(m, max(rows_RD.shape[0], 1)) for m in (tile_sizes or DEFAULT_TILE_SIZES)}, reverse=True))
    return _tiled(rows_RD, w_EDF, group_sizes_E, sizes)
  if backend == GemmBackend.TOKAMAX:
    import tokamax  # pylint: disable=import-outside-toplevel

    return tokamax.ragged_dot(rows_RD, w_EDF, group_sizes_E)
  raise ValueError(f"unknown grouped GEMM backend {backend!r}")
