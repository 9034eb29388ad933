"""Grouped GEMM: rows sorted by expert times that expert's weight. One call site, several backends.

`grouped_matmul(rows_RD, w_EDF, group_sizes_E, backend=...)` is the only entry point; the MoE layer
calls it and never a backend directly (torchtitan's "overridable seam").

Backends:
- `ragged_dot`: `jax.lax.ragged_dot`, the reference semantics. On XLA:CPU it runs at ~1.5% of a dense
  matmul of equal FLOPs (docs/design-facts.md).
- `tiled`: hand-written, because no library offers a fast portable grouped GEMM. Each expert's rows are
  read through ONE window whose static size is the smallest on a ladder (`permute.window_sizes`: steps of
  16 rows, then of ~12.5%) that holds them, so each expert costs one dense matmul that wastes at most
  ~12.5% (or 16 rows) and reads its weight once. A `fori_loop` over experts switches on the window size;
  rows of neighbouring experts inside a window are masked. Dropless: the ladder ends at R.
  The VJP is written by hand (a loop over `lax.switch` has no efficient reverse-mode AD): dX runs the
  same loop with transposed weights, dW is one X_e^T dY_e product per expert.
  History: fixed tiles of (128, 16) rows reached ~0.45 of dense (fwd) on 2 CPU cores, because at ~128
  rows per expert most rows fell into 16-row tiles that re-read the weight each time.
- `tokamax`: on an SM 9.x/10.x GPU tokamax's Mosaic GPU kernels (`mosaic.py`: one custom call per GEMM,
  no data-dependent branch; what `auto` picks on a GPU without TE); elsewhere `tokamax.ragged_dot`.
- `te`: Transformer Engine's `grouped_dense` (GPU; `upstream.te.calls`, the TE seam, which imports nothing of
  ours): BF16, or FP8 / MXFP8 through TE's quantizer sets (`quantization`).
- `auto`: `settings.resolve_backend` decides.
Shape legend: R rows, D in dim, F out dim, E experts, M window rows, L window sizes.
"""

import functools

import jax
import jax.numpy as jnp
from jax import lax

from maxtext_moe.moe import mosaic
from maxtext_moe.moe.permute import WindowPlan, window_plan, window_sizes
from maxtext_moe.moe.settings import GemmBackend, detect_platform, resolve_backend


def _window(rows: jax.Array, plan: WindowPlan, e: jax.Array, m: int, group_sizes_E: jax.Array):
  """Expert e's static m-row window of `rows`, its first row, and a [m, 1] mask of e's own rows in it."""
  first = plan.window_start_E[e]
  pos_M = first + jnp.arange(m)
  mask_M1 = ((pos_M >= plan.start_E[e]) & (pos_M < plan.start_E[e] + group_sizes_E[e]))[:, None]
  return lax.dynamic_slice_in_dim(rows, first, m), first, mask_M1


def _per_expert(plan: WindowPlan, body, init):
  """Runs body(m, e, carry) for every expert with rows, where m is its window size.

  One loop over experts with a `lax.switch` on the window size: one loop per size instead costs a copy of
  the carried buffer per loop on XLA:CPU (measured: 25 loops took 3x longer than this)."""
  branches = [lambda e, carry: carry] + [functools.partial(body, m) for m in plan.sizes]
  return lax.fori_loop(
    0, plan.level_E.shape[0], lambda e, carry: lax.switch(plan.level_E[e] + 1, branches, e, carry), init
  )


def _windows_matmul(rows_RD, w_EDF, group_sizes_E, plan: WindowPlan, *, transpose: bool) -> jax.Array:
  """out[r] = rows[r] @ w[e(r)] (or @ w[e(r)].T), one expert window at a time; other rows stay zero."""

  def body(m, e, out):
    x, first, mask = _window(rows_RD, plan, e, m, group_sizes_E)
    w = w_EDF[e]
    y = jnp.dot(x, w.T if transpose else w, preferred_element_type=rows_RD.dtype)
    return lax.dynamic_update_slice_in_dim(out, jnp.where(mask, y, lax.dynamic_slice_in_dim(out, first, m)), first, 0)

  out_dim = w_EDF.shape[1] if transpose else w_EDF.shape[2]
  return _per_expert(plan, body, jnp.zeros((rows_RD.shape[0], out_dim), rows_RD.dtype))


def _windows_weight_grad(rows_RD, grad_RF, group_sizes_E, plan: WindowPlan) -> jax.Array:
  """dW[e] = rows_e^T @ grad_e in f32: one product per expert, so no accumulation across tiles."""

  def body(m, e, dw):
    x, first, mask = _window(rows_RD, plan, e, m, group_sizes_E)
    g = lax.dynamic_slice_in_dim(grad_RF, first, m)
    upd = jnp.dot(jnp.where(mask, x, 0).T, g, preferred_element_type=jnp.float32)
    return lax.dynamic_update_index_in_dim(dw, upd, e, 0)

  num_experts = group_sizes_E.shape[0]
  return _per_expert(plan, body, jnp.zeros((num_experts, rows_RD.shape[1], grad_RF.shape[1]), jnp.float32))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _tiled(rows_RD: jax.Array, w_EDF: jax.Array, group_sizes_E: jax.Array, sizes: tuple[int, ...]) -> jax.Array:
  plan = window_plan(group_sizes_E, num_rows=rows_RD.shape[0], sizes=sizes)
  return _windows_matmul(rows_RD, w_EDF, group_sizes_E, plan, transpose=False)


def _tiled_fwd(rows_RD, w_EDF, group_sizes_E, sizes):
  return _tiled(rows_RD, w_EDF, group_sizes_E, sizes), (rows_RD, w_EDF, group_sizes_E)


def _tiled_bwd(sizes, res, grad_RF):
  rows_RD, w_EDF, group_sizes_E = res
  plan = window_plan(group_sizes_E, num_rows=rows_RD.shape[0], sizes=sizes)
  d_rows = _windows_matmul(grad_RF, w_EDF, group_sizes_E, plan, transpose=True)
  d_w = _windows_weight_grad(rows_RD, grad_RF, group_sizes_E, plan).astype(w_EDF.dtype)
  return d_rows, d_w, None


_tiled.defvjp(_tiled_fwd, _tiled_bwd)


def grouped_matmul(
  rows_RD: jax.Array,
  w_EDF: jax.Array,
  group_sizes_E: jax.Array,
  *,
  backend: GemmBackend | str = GemmBackend.AUTO,
  window_sizes_L: tuple[int, ...] | None = None,
  quantization: str = "none",
) -> jax.Array:
  """out[r] = rows[r] @ w[e(r)], where rows are sorted by expert and group_sizes_E[e] rows belong to e.

  Args:
    rows_RD: [R, D] rows sorted by expert; rows past sum(group_sizes_E) produce zeros.
    w_EDF: [E, D, F] expert weights.
    group_sizes_E: [E] int32 rows per expert.
    backend: a `GemmBackend`.
    window_sizes_L: the `tiled` backend's static window sizes, ascending (default
      `permute.window_sizes(R)`); sizes above R are dropped and R is always added.
    quantization: the `te` backend's number format (`settings.GemmQuantization`).

  Returns:
    [R, F] in rows_RD's dtype.
  """
  backend = resolve_backend(backend, platform=detect_platform())
  group_sizes_E = group_sizes_E.astype(jnp.int32)
  if backend == GemmBackend.RAGGED_DOT:
    return lax.ragged_dot(rows_RD, w_EDF, group_sizes_E)
  if backend == GemmBackend.TILED:
    num_rows = rows_RD.shape[0]
    if window_sizes_L is None:
      sizes = window_sizes(num_rows)
    else:
      sizes = tuple(sorted({m for m in window_sizes_L if 0 < m < num_rows} | {max(num_rows, 1)}))
    return _tiled(rows_RD, w_EDF, group_sizes_E, sizes)
  if backend == GemmBackend.TOKAMAX:
    if mosaic.compute_capability() >= (9, 0):
      return mosaic.grouped_matmul(rows_RD, w_EDF, group_sizes_E)
    import tokamax  # pylint: disable=import-outside-toplevel

    return tokamax.ragged_dot(rows_RD, w_EDF, group_sizes_E)
  if backend == GemmBackend.TE:
    from maxtext_moe.upstream.te import calls as te  # pylint: disable=import-outside-toplevel  # the TE seam, a leaf module: it imports nothing of ours

    return te.grouped_dense(rows_RD, w_EDF, group_sizes_E, quantization=str(quantization))
  raise ValueError(f"unknown grouped GEMM backend {backend!r}")
