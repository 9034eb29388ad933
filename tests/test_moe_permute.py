"""Worked examples of the routing index math (the docstrings' examples, checked)."""

import itertools

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


def test_tile_plan_worked_example():
  big, small = permute.tile_plan(jnp.array([5, 0, 2]), num_rows=7, tile_sizes=(4, 2))
  assert (big.tile_rows, int(big.count)) == (4, 1)
  assert (big.expert_N[:1].tolist(), big.start_N[:1].tolist(), big.valid_N[:1].tolist()) == ([0], [0], [4])
  assert (small.tile_rows, int(small.count)) == (2, 2)
  assert small.expert_N[:2].tolist() == [0, 2]
  assert small.start_N[:2].tolist() == [4, 5]
  assert small.valid_N[:2].tolist() == [1, 2]


@pytest.mark.parametrize("sizes", [[0, 0, 9], [9, 0, 0], [1, 1, 1], [4, 4, 1], [0, 0, 0], [33, 2, 70]])
def test_tile_plan_covers_every_row_once(sizes):
  sizes_E = jnp.array(sizes)
  total = int(sizes_E.sum())
  hits = np.zeros(total + 64, int)
  expert_of_row = np.repeat(np.arange(3), sizes)
  for plan in permute.tile_plan(sizes_E, num_rows=max(total, 1), tile_sizes=(16, 4)):
    for i in range(int(plan.count)):
      s, v, e = int(plan.start_N[i]), int(plan.valid_N[i]), int(plan.expert_N[i])
      assert v >= 1
      hits[s : s + v] += 1
      assert (expert_of_row[s : s + v] == e).all()
  assert hits[:total].tolist() == [1] * total and hits[total:].sum() == 0
