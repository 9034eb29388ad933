"""Grouped GEMM backends against a plain per-expert loop, forward and gradients (f32)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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
