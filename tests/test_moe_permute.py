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


def test_tile_layout_worked_example():
  dest, tile_expert, n = permute.tile_layout(jnp.array([3, 0, 2]), num_rows=5, tile_rows=2)
  assert n == 6
  assert dest.tolist() == [0, 1, 2, 4, 5]
  assert tile_expert.tolist() == [0, 0, 2, 2, 2, 2]


@pytest.mark.parametrize("sizes", [[0, 0, 9], [9, 0, 0], [1, 1, 1], [4, 4, 1]])
def test_tile_layout_slots_are_unique_and_in_their_experts_tiles(sizes):
  sizes = jnp.array(sizes)
  dest, tile_expert, n = permute.tile_layout(sizes, num_rows=int(sizes.sum()), tile_rows=4)
  assert len(set(dest.tolist())) == int(sizes.sum())
  assert max(dest.tolist()) < n * 4
  expert_of_row = np.repeat(np.arange(3), np.asarray(sizes))
  assert np.asarray(tile_expert)[np.asarray(dest) // 4].tolist() == expert_of_row.tolist()
