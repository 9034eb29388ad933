"""Grouped GEMM backends against a plain per-expert loop, forward and gradients (f32)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtext_moe.moe import mosaic
from maxtext_moe.moe.gemm import grouped_matmul
from maxtext_moe.moe.settings import GemmBackend, resolve_backend

BACKENDS = [GemmBackend.RAGGED_DOT, GemmBackend.TILED, GemmBackend.TOKAMAX]


def _loop_reference(rows, w, sizes):
  out, start = [], 0
  for e, n in enumerate(np.asarray(sizes).tolist()):
    out.append(rows[start : start + n] @ w[e])
    start += n
  out.append(jnp.zeros((rows.shape[0] - start, w.shape[2]), rows.dtype))
  return jnp.concatenate(out)


def _case(sizes, *, extra_rows=0, d=16, f=24, seed=0):
  k1, k2 = jax.random.split(jax.random.PRNGKey(seed))
  sizes = jnp.array(sizes, jnp.int32)
  rows = jax.random.normal(k1, (int(sizes.sum()) + extra_rows, d))
  w = jax.random.normal(k2, (len(sizes), d, f)) / 4
  return rows, w, sizes


CASES = {
  "uneven": ([5, 0, 17, 3], 0),
  "all_to_one_expert": ([0, 0, 40, 0], 0),
  "one_row_each": ([1, 1, 1, 1], 0),
  "trailing_unassigned_rows": ([3, 2, 0, 6], 5),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES)
def test_forward_matches_loop(backend, case):
  rows, w, sizes = _case(CASES[case][0], extra_rows=CASES[case][1])
  got = grouped_matmul(rows, w, sizes, backend=backend, window_sizes_L=(2, 8))
  np.testing.assert_allclose(got, _loop_reference(rows, w, sizes), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradients_match_loop(backend):
  rows, w, sizes = _case([5, 0, 17, 3], extra_rows=2)
  cot = jax.random.normal(jax.random.PRNGKey(3), (rows.shape[0], w.shape[2]))

  def loss(fn):
    return lambda r, ww: jnp.sum(fn(r, ww) * cot)

  ours = jax.grad(loss(lambda r, ww: grouped_matmul(r, ww, sizes, backend=backend, window_sizes_L=(2, 8))), (0, 1))(
    rows, w
  )
  ref = jax.grad(loss(lambda r, ww: _loop_reference(r, ww, sizes)), (0, 1))(rows, w)
  for a, b in zip(ours, ref, strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_tiled_under_jit_with_traced_group_sizes():
  rows, w, sizes = _case([7, 1, 0, 9])
  jitted = jax.jit(lambda r, ww, s: grouped_matmul(r, ww, s, backend="tiled", window_sizes_L=(4,)))
  np.testing.assert_allclose(jitted(rows, w, sizes), _loop_reference(rows, w, sizes), rtol=1e-5, atol=1e-5)


def test_auto_picks_tiled_on_cpu():
  assert resolve_backend("auto", platform="cpu") == GemmBackend.TILED
  with pytest.raises(ValueError):
    resolve_backend("nope", platform="cpu")


def test_tile_plan_worked_example():
  expert, start, end = mosaic.tile_plan(jnp.array([5, 0, 2]), num_rows=7, tile=4)
  assert expert.tolist() == [0, 0, 2, 0, 0]
  assert start.tolist() == [0, 4, 5, 0, 0] and end.tolist() == [4, 5, 7, 0, 0]


@pytest.mark.parametrize("case", CASES)
def test_blackwell_weight_gradient_matches_loop(case):
  """The dW of the Mosaic path on SM 10.x (tokamax has no Mosaic kernel for it): fixed tiles, a loop of
  known trip count, against the per-expert reference, with tiles smaller and larger than the groups."""
  rows, w, sizes = _case(CASES[case][0], extra_rows=CASES[case][1])
  grad = jax.random.normal(jax.random.PRNGKey(5), (rows.shape[0], w.shape[2]))
  ref = jax.grad(lambda ww: jnp.sum(_loop_reference(rows, ww, sizes) * grad))(w)
  for tile in (2, 4, 64):
    got = jax.jit(mosaic.tiled_weight_grad, static_argnames="tile")(rows, grad, sizes, tile=tile)
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_gpu_auto_never_picks_a_branching_gemm():
  """On a GPU without TE `auto` is the Mosaic path (one custom call per GEMM): tiled's per-expert switch is a
  host sync on XLA:GPU, and ragged_dot a dense dot (the compiled programs say so: tests/test_gpu_compile.py)."""
  from maxtext_moe.moe.settings import Platform

  assert resolve_backend("auto", platform=Platform("gpu")) == GemmBackend.TOKAMAX
