"""Bounded-memory EP's index math (`moe.rounds`), on its docstrings' worked examples. The block-level
parity (outputs and gradients against EP=1, rounds counted) is in test_moe_block.py."""

import jax.numpy as jnp

from maxtext_moe.moe import rounds
from maxtext_moe.moe.buffers import EpBuffers, round_budget, routed_rows
from maxtext_moe.moe.settings import DispatchKind


def test_round_budget_example():
  assert round_budget(64, 4, num_ranks=8, buffer_factor=1.5, local_experts=2) == 48
  assert round_budget(64, 4, num_ranks=8, buffer_factor=0.01, local_experts=2) == 4  # one whole row fits
  assert round_budget(64, 4, num_ranks=2, buffer_factor=9.0, local_experts=2) == 128  # never past T x min(K, E_l)


def test_plan_rounds_example():
  ids = jnp.array([[0, 1], [0, 2], [1, 3], [0, 1]])
  plan = rounds.plan_rounds(ids, local_experts=2, num_ranks=2, budget=2, axis=None)
  assert plan.needs_TP.tolist() == [[True, False], [True, True], [True, True], [True, False]]
  assert plan.round_TP[:, 0].tolist() == [0, 1, 1, 2] and plan.slot_TP[:, 0].tolist() == [0, 0, 1, 0]
  assert plan.round_TP[1:3, 1].tolist() == [0, 0] and plan.slot_TP[1:3, 1].tolist() == [0, 1]
  assert int(plan.rounds) == 3 and float(plan.load_over_budget) == 3.0  # 6 pairs for rank 0, budget 2


def test_repeated_ids_take_the_rounds_they_need():
  """Every router's top-k ids are distinct; repeated ones (two pairs of one row for one expert) are
  scheduled like any other pairs: no static round count cuts them off."""
  ids = jnp.array([[0, 0]] * 4)  # 2 pairs per token for rank 0 with one local expert
  plan = rounds.plan_rounds(ids, local_experts=1, num_ranks=2, budget=2, axis=None)
  assert plan.round_TP[:, 0].tolist() == [0, 1, 2, 3] and int(plan.rounds) == 4


def test_planner_rows_are_one_rounds_pairs():
  """What the planner sizes: P x (G + K - 1) pairs in bounded mode, P x T x K worst-case."""
  kw = {"num_ranks": 8, "num_experts": 64}
  bounded = EpBuffers(DispatchKind.ALL_TO_ALL, "bounded", buffer_factor=1.5, **kw)
  assert routed_rows(bounded, 1024, 8) == 8 * (1536 + 7)
  assert routed_rows(EpBuffers(DispatchKind.ALL_TO_ALL, "worst_case", **kw), 1024, 8) == 8 * 1024 * 8
  assert routed_rows(EpBuffers(DispatchKind.TE_EP, "bounded", **kw), 1024, 8) == 1024 * 8 * 8  # TE sizes its own
