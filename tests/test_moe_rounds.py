"""Bounded-memory EP's index math (`moe.rounds`), on its docstrings' worked examples. The block-level
parity (outputs and gradients against EP=1, rounds counted) is in test_moe_block.py."""

import jax.numpy as jnp

from maxtext_moe.moe import rounds
from maxtext_moe.moe.settings import DispatchKind, round_budget, routed_rows


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
  assert int(plan.unscheduled) == 0  # max_rounds: 4 x min(2, 2) / 2 = 4 rounds are scheduled


def test_repeated_ids_past_the_scheduled_rounds_are_counted_not_lost():
  """Every router's top-k ids are distinct; repeated ones can need more rounds than `max_rounds`, and
  those pairs are reported as unscheduled (dropped: a dropless run stops) rather than lost."""
  ids = jnp.array([[0, 0]] * 4)  # 2 pairs per token for rank 0 with one local expert
  plan = rounds.plan_rounds(ids, local_experts=1, num_ranks=2, budget=2, axis=None)
  assert rounds.max_rounds(4, 2, budget=2, local_experts=1) == 2 and int(plan.rounds) == 4
  assert int(plan.unscheduled) == 4  # tokens 2 and 3 fall in rounds 2 and 3


def test_planner_rows_are_one_rounds_pairs():
  """What the planner sizes: P x (G + K - 1) pairs in bounded mode, P x T x K worst-case."""
  kw = {"num_ranks": 8, "capacity_factor": 0.0, "num_experts": 64}
  assert routed_rows(DispatchKind.ALL_TO_ALL, 1024, 8, **kw, buffers="bounded", buffer_factor=1.5) == 8 * (1536 + 7)
  assert routed_rows(DispatchKind.ALL_TO_ALL, 1024, 8, **kw, buffers="worst_case") == 8 * 1024 * 8
  assert routed_rows(DispatchKind.TE_EP, 1024, 8, **kw, buffers="bounded") == 1024 * 8 * 8  # TE sizes its own
