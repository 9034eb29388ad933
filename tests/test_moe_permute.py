"""Worked examples of the routing index math (the docstrings' examples, checked)."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxtext_moe.moe import permute


def test_sort_by_expert_worked_example():
  order, sizes = permute.sort_by_expert(jnp.array([[2, 0], [0, 1]]), num_experts=3)
  assert order.tolist() == [1, 2, 3, 0]
  assert sizes.tolist() == [2, 1, 1]


def test_inverse_permutation_worked_example():
  inv = permute.inverse_permutation(jnp.array([1, 2, 3, 0]))
  assert inv.tolist() == [3, 0, 1, 2]


@pytest.mark.parametrize("seed", range(3))
def test_sort_then_inverse_is_identity(seed):
  ids = np.random.default_rng(seed).integers(0, 8, size=(37, 3))
  order, sizes = permute.sort_by_expert(jnp.asarray(ids), num_experts=8)
  flat = ids.reshape(-1)
  assert np.all(np.diff(flat[np.asarray(order)]) >= 0), "sorted by expert"
  assert np.asarray(flat[np.asarray(order)][np.asarray(permute.inverse_permutation(order))]).tolist() == flat.tolist()
  assert sizes.tolist() == np.bincount(flat, minlength=8).tolist()


def test_distinct_ranks_worked_example():
  needs = permute.distinct_ranks(jnp.array([[0, 1], [1, 6]]), experts_per_rank=2, num_ranks=4)
  assert needs.tolist() == [[True, False, False, False], [True, False, False, True]]


def test_expected_distinct_ranks_worked_example_and_enumeration():
  assert permute.expected_distinct_ranks(num_experts=4, top_k=2, num_ranks=2) == pytest.approx(5 / 3)
  e, k, p = 8, 3, 4
  subsets = list(itertools.combinations(range(e), k))
  exact = np.mean([len({x // (e // p) for x in s}) for s in subsets])
  assert permute.expected_distinct_ranks(num_experts=e, top_k=k, num_ranks=p) == pytest.approx(exact)


def test_window_sizes_worked_example_and_waste_bound():
  assert permute.window_sizes(100, smallest=16) == (16, 32, 48, 64, 80, 96, 100)
  sizes = permute.window_sizes(8192)
  assert sizes[-1] == 8192 and all(m % 16 == 0 for m in sizes)
  for n in range(1, 8193, 7):
    m = next(m for m in sizes if m >= n)
    assert m - n < max(16, 0.125 * n), (n, m)


def test_window_plan_worked_example():
  plan = permute.window_plan(jnp.array([5, 0, 2]), num_rows=7, sizes=(2, 4, 7))
  assert plan.level_E.tolist() == [2, -1, 0]
  assert plan.start_E.tolist() == [0, 5, 5]
  assert plan.window_start_E.tolist() == [0, 5, 5]


@pytest.mark.parametrize("sizes", [[0, 0, 9], [9, 0, 0], [1, 1, 1], [4, 4, 1], [0, 0, 0], [33, 2, 70], [3, 0, 1]])
def test_window_plan_windows_hold_each_expert_and_stay_in_bounds(sizes):
  sizes_E = jnp.array(sizes)
  num_rows = max(int(sizes_E.sum()) + 2, 1)
  ladder = permute.window_sizes(num_rows, smallest=4)
  plan = permute.window_plan(sizes_E, num_rows=num_rows, sizes=ladder)
  start = np.cumsum([0, *sizes[:-1]])
  for e, n in enumerate(sizes):
    level = int(plan.level_E[e])
    if n == 0:
      assert level == -1
      continue
    m, first = ladder[level], int(plan.window_start_E[e])
    assert m >= n and (level == 0 or ladder[level - 1] < n)  # the smallest window that holds e's rows
    assert 0 <= first and first + m <= num_rows
    assert first <= start[e] and start[e] + n <= first + m


def test_pack_for_ranks_worked_example():
  x = jnp.array([[1.0], [2.0]])
  ids, w = jnp.array([[0, 3], [2, 3]]), jnp.array([[0.5, 0.5], [0.3, 0.7]])
  send_x, send_ids, send_w = permute.pack_for_ranks(
    x, ids, w, jnp.array([[0, 2], [4, 1]]), num_rows=3, experts_per_rank=2
  )
  assert send_x.tolist() == [[1.0], [2.0], [1.0]]
  assert send_ids.tolist() == [[0, 2], [0, 1], [2, 1]]
  np.testing.assert_allclose(send_w, [[0.5, 0.0], [0.3, 0.7], [0.0, 0.5]])


def test_compact_ranks_worked_example():
  rank, dest = permute.compact_ranks(jnp.array([[4, 1, 4, 6], [0, 4, 4, 4]]), num_rows=4, max_ranks=2)
  assert rank.tolist() == [[1, 0], [0, 1]] and dest.tolist() == [[1, 4], [0, 4]]
  same = jnp.array([[0, 1], [2, 3]])
  assert permute.compact_ranks(same, num_rows=4, max_ranks=2)[1] is same  # J = P: unchanged


@pytest.mark.parametrize("seed", range(3))
def test_both_ways_through_the_compacted_ranks_equal_the_per_rank_layout(seed):
  """P = 8 ranks, top-2: each token's rows laid out for its <= 2 destinations send the same buffers and
  return the same sums as one column per rank, bit for bit."""
  t, k, p, e_local, n = 16, 2, 8, 2, 40
  key = jax.random.split(jax.random.key(seed), 3)
  ids = jax.vmap(lambda kk: jax.random.choice(kk, p * e_local, (k,), replace=False))(jax.random.split(key[0], t))
  w = jax.random.uniform(key[1], (t, k))
  x = jax.random.normal(key[2], (t, 3))
  needs = permute.distinct_ranks(ids, experts_per_rank=e_local, num_ranks=p)
  slot = jnp.cumsum(needs, axis=0) - 1
  dest = jnp.where(needs, jnp.arange(p) * (n // p) + slot, n)
  rank, dest_j = permute.compact_ranks(dest, num_rows=n, max_ranks=k)
  assert dest_j.shape == (t, k)
  wide = permute.pack_for_ranks(x, ids, w, dest, num_rows=n, experts_per_rank=e_local)
  narrow = permute.pack_for_ranks(x, ids, w, dest_j, num_rows=n, experts_per_rank=e_local, rank_TJ=rank)
  for a, b in zip(wide, narrow, strict=True):
    np.testing.assert_array_equal(a, b)
  back = jax.random.normal(key[0], (n, 3))
  np.testing.assert_array_equal(permute.gather_returned(back, dest), permute.gather_returned(back, dest_j))


def test_empty_rows_are_on_no_local_expert():
  x, ids, w = permute.empty_rows(2, jnp.ones((5, 3)), jnp.ones((5, 4), jnp.int32), jnp.ones((5, 4)), experts_per_rank=6)
  assert x.shape == (2, 3) and not x.any() and ids.tolist() == [[6] * 4] * 2 and not w.any()


def test_sort_received_worked_example():
  rows, sizes, order = permute.sort_received(jnp.array([[1.0], [2.0]]), jnp.array([[1, 2], [0, 1]]), experts_per_rank=2)
  assert rows.tolist() == [[2.0], [1.0], [2.0], [1.0]]
  assert sizes.tolist() == [1, 2] and order.tolist() == [2, 0, 3, 1]


def test_weighted_rows_worked_example():
  rows = jnp.array([[20.0], [10.0], [21.0], [11.0]])
  got = permute.weighted_rows(rows, jnp.array([2, 0, 3, 1]), jnp.array([[1.0, 0.0], [0.5, 0.5]]))
  assert got.tolist() == [[10.0], [20.5]]


def test_gather_returned_worked_example():
  back = jnp.array([[1.0], [2.0], [4.0]])
  got = permute.gather_returned(back, jnp.array([[0, 2], [3, 1]]))
  assert got.tolist() == [[5.0], [2.0]]
  # Its gradient reaches only the rows that returned: row 3 is past back's rows, so nothing is scattered there.
  grad = jax.grad(lambda b: permute.gather_returned(b, jnp.array([[0, 2], [3, 1]])).sum())(back)
  assert grad.tolist() == [[1.0], [1.0], [1.0]]


@pytest.mark.parametrize("seed", range(3))
def test_sort_received_then_weighted_rows_with_uniform_weights_is_identity(seed):
  """Megatron's dispatcher test: expanding rows to (row, expert) pairs and reducing them back with weights
  1/K returns the rows, gradients included."""
  rng = np.random.default_rng(seed)
  x, ids = jnp.asarray(rng.normal(size=(11, 4))), jnp.asarray(rng.integers(0, 3, size=(11, 2)))

  def roundtrip(x):
    rows, _, order = permute.sort_received(x, ids, experts_per_rank=3)
    return permute.weighted_rows(rows, order, jnp.full((11, 2), 0.5))

  np.testing.assert_allclose(roundtrip(x), x, rtol=1e-6)
  np.testing.assert_allclose(jax.grad(lambda x: jnp.sum(roundtrip(x) * 3.0))(x), jnp.full_like(x, 3.0), rtol=1e-6)
