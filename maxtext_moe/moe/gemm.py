"""Grouped GEMM: rows sorted by expert times that expert's weight. One call site, several backends.

`grouped_matmul(rows_RD, w_EDF, group_sizes_E, backend=...)` is the only entry point; the MoE layer
calls it and never a backend directly (torchtitan's "overridable seam").

Backends:
- `ragged_dot`: `jax.lax.ragged_dot`. The reference semantics; on XLA:CPU it runs at ~1.5% of a dense
  matmul of equal FLOPs (DESIGN.md), so it is not the CPU default.
- `tiled`: hand-written because nothing in jax/flax/optax does this portably. Rows are placed into
  fixed-size tiles that each hold one expert (`permute.tile_layout`), and all tiles run as one batched
  matmul against their expert's weight. Dropless: the tile count is the static worst case.
- `auto`: `tiled` on CPU, `ragged_dot` elsewhere until the GPU measurements say otherwise.
Shape legend: R rows, D in dim, F out dim, E experts, N tiles, M tile rows.
"""

from enum import StrEnum

import jax
import jax.numpy as jnp

from maxtext_moe.moe.permute import tile_layout


class GemmBackend(StrEnum):
  AUTO = "auto"
  RAGGED_DOT = "ragged_dot"
  TILED = "tiled"


DEFAULT_TILE_ROWS = 128


def resolve_backend(backend: GemmBackend | str, *, platform: str | None = None) -> GemmBackend:
  """Turns `auto` into a concrete backend for `platform` (default: JAX's default backend)."""
  backend = GemmBackend(backend)
  if backend != GemmBackend.AUTO:
    return backend
  platform = platform or jax.default_backend()
  return GemmBackend.TILED if platform == "cpu" else GemmBackend.RAGGED_DOT


def _tiled(rows_RD: jax.Array, w_EDF: jax.Array, group_sizes_E: jax.Array, *, tile_rows: int) -> jax.Array:
  num_rows, dim = rows_RD.shape
  dest_R, tile_expert_N, num_tiles = tile_layout(group_sizes_E, num_rows=num_rows, tile_rows=tile_rows)
  slots = num_tiles * tile_rows
  # Rows past sum(group_sizes) belong to no expert: send them out of bounds (dropped) and read back zeros.
  dest_R = jnp.where(jnp.arange(num_rows) < jnp.sum(group_sizes_E), dest_R, slots)
  tiles_NMD = jnp.zeros((slots, dim), rows_RD.dtype).at[dest_R].set(rows_RD, mode="drop")
  tiles_NMD = tiles_NMD.reshape(num_tiles, tile_rows, dim)
  out_NMF = jnp.einsum("nmd,ndf->nmf", tiles_NMD, w_EDF[tile_expert_N], preferred_element_type=rows_RD.dtype)
  return out_NMF.reshape(slots, -1).at[dest_R].get(mode="fill", fill_value=0)


def grouped_matmul(
    rows_RD: jax.Array,
    w_EDF: jax.Array,
    group_sizes_E: jax.Array,
    *,
    backend: GemmBackend | str = GemmBackend.AUTO,
    tile_rows: int = DEFAULT_TILE_ROWS,
) -> jax.Array:
  """out[r] = rows[r] @ w[e(r)], where rows are sorted by expert and group_sizes_E[e] rows belong to e.

  Args:
    rows_RD: [R, D] rows sorted by expert; rows past sum(group_sizes_E) produce zeros.
    w_EDF: [E, D, F] expert weights.
    group_sizes_E: [E] int32 rows per expert.
    backend: a `GemmBackend`.
    tile_rows: M, rows per tile for the `tiled` backend.

  Returns:
    [R, F] in rows_RD's dtype.
  """
  backend = resolve_backend(backend)
  if backend == GemmBackend.RAGGED_DOT:
    return jax.lax.ragged_dot(rows_RD, w_EDF, group_sizes_E)
  if backend == GemmBackend.TILED:
    return _tiled(rows_RD, w_EDF, group_sizes_E, tile_rows=min(tile_rows, max(rows_RD.shape[0], 1)))
  raise ValueError(f"unknown grouped GEMM backend {backend!r}")
