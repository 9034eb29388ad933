"""Expert parallelism across nodes (`moe.levels`): the two-level exchange on 8 fake CPU devices standing
for 2 or 4 nodes, against EP=1 and the plain loop; its dedup by node, its rounds, its chunks."""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from maxtext_moe.moe import levels, rounds
from maxtext_moe.moe.block import moe_block
from maxtext_moe.moe.buffers import EpBuffers, received_rows, routed_rows
from maxtext_moe.moe.settings import BufferMode, DispatchKind, MoESettings

T, D, F, E, K = 64, 16, 24, 8, 3
TOL = {"rtol": 1e-5, "atol": 1e-5}


def test_groups_worked_examples():
  assert levels.network_groups(2, 3) == ((0, 3), (1, 4), (2, 5))
  assert levels.nvlink_groups(2, 3) == ((0, 1, 2), (3, 4, 5))


def test_expected_nodes_with_each_group_over_several_nodes():
  """16 nodes, DeepSeek-V3's 8 groups (2 nodes each), top-4 groups then 8 of their 128 experts: the formula
  against a count over random draws of that routing."""
  want = 8 * (1 - math.comb(112, 8) / math.comb(128, 8))
  got = levels.expected_nodes(num_experts=256, top_k=8, nodes=16, routing_groups=(8, 4))
  assert got == pytest.approx(want) and got == pytest.approx(5.339, abs=1e-3)
  rng = np.random.default_rng(0)
  draws = []
  for _ in range(4000):
    groups = rng.choice(8, 4, replace=False)
    experts = rng.choice((groups[:, None] * 32 + np.arange(32)).ravel(), 8, replace=False)
    draws.append(len(set(experts // 16)))
  assert np.mean(draws) == pytest.approx(want, abs=0.05)


def test_expected_nodes_worked_examples():
  assert levels.expected_nodes(num_experts=256, top_k=8, nodes=8, routing_groups=(8, 4)) == pytest.approx(4.0)
  exact = 8 * (1 - math.comb(224, 8) / math.comb(256, 8))
  assert levels.expected_nodes(num_experts=256, top_k=8, nodes=8) == pytest.approx(exact)
  assert exact == pytest.approx(5.29, abs=0.01)
  assert levels.expected_nodes(num_experts=256, top_k=8, nodes=1) == 1.0
  # 16 groups on 8 nodes, 2 a node: a token's 4 groups on fewer than 4 nodes at times
  assert levels.expected_nodes(num_experts=256, top_k=8, nodes=8, routing_groups=(16, 4)) < 4.0


def test_round_levels_worked_example():
  (one,) = levels.round_levels(1024, 8, num_experts=64, ranks=8, buffer_factor=1.5)
  assert (one.budget, one.send_rows, one.recv_rows, one.counts_rows) == (1536, 1024, 8192, False)
  # DeepSeek-V3 at EP 64 over 8 nodes: the network level carries 1.5 x 4 rows per token (4 of 8 nodes),
  # the NVLink level 1.5 x K / 8 pairs per token and destination.
  net, nvl = levels.round_levels(4096, 8, num_experts=256, ranks=64, nodes=8, buffer_factor=1.5, routing_groups=(8, 4))
  assert (net.ranks, net.local_experts, net.counts_rows, net.budget) == (8, 32, True, 3072)
  assert (nvl.ranks, nvl.local_experts, nvl.counts_rows, nvl.budget, nvl.send_rows) == (8, 4, False, 6144, 6144)
  assert levels.gemm_rows((net, nvl), 8) == 8 * (6144 + 7)
  worst = levels.round_levels(4096, 8, num_experts=256, ranks=64, nodes=8, buffer_factor=1.5, worst_case=True)
  assert worst[0].budget == 4096 and worst[1].recv_rows == 64 * 4096  # every token of every rank, once


def test_sizes_the_planner_reads_are_the_dispatchers():
  kw = dict(num_ranks=64, num_experts=256, nodes=8, routing_groups=(8, 4))
  bounded = EpBuffers(DispatchKind.ALL_TO_ALL, BufferMode.BOUNDED, **kw)
  assert routed_rows(bounded, 4096, 8) == 8 * (6144 + 7)
  assert received_rows(bounded, 4096, 8) == 8 * 3072 + 8 * 6144
  halves = EpBuffers(DispatchKind.ALL_TO_ALL, BufferMode.BOUNDED, **kw, chunks=2)
  assert routed_rows(halves, 4096, 8) == 8 * (3072 + 7)  # one half's: the halves' backwards run in turn


def test_plan_rounds_counting_rows():
  ids = jnp.array([[0, 1], [0, 2], [1, 3], [0, 1]])
  plan = rounds.plan_rounds(ids, local_experts=2, num_ranks=2, budget=2, axis=None, count_rows=True)
  assert plan.round_TP[:, 0].tolist() == [0, 0, 1, 1] and plan.slot_TP[:, 0].tolist() == [0, 1, 0, 1]
  assert int(plan.rounds) == 2 and float(plan.load_over_budget) == 2.0


def _mesh():
  return Mesh(np.array(jax.devices()[:8]).reshape(1, 8), ("data", "expert"))


def _weights(seed=0):
  k = jax.random.split(jax.random.PRNGKey(seed), 3)
  shapes = ((E, D, F), (E, D, F), (E, F, D))
  return tuple(jax.random.normal(kk, s) / 4 for kk, s in zip(k, shapes, strict=True))


def _tokens(routing: str, seed: int = 1):
  kx, ki, kw = jax.random.split(jax.random.PRNGKey(seed), 3)
  x = jax.random.normal(kx, (T, D))
  if routing == "random":
    ids = jnp.argsort(jax.random.uniform(ki, (T, E)), axis=-1)[:, :K]
  elif routing == "grouped":  # one group of 4 experts per token (2 groups, top-1 group): one node of 2
    group = jax.random.bernoulli(ki, 0.5, (T,)).astype(jnp.int32)
    ids = group[:, None] * 4 + jnp.argsort(jax.random.uniform(kw, (T, 4)), axis=-1)[:, :K]
  else:  # every token to the last rank's experts: one node, one rank
    ids = jnp.stack([jnp.full((T,), 6), jnp.full((T,), 7), jnp.where(jnp.arange(T) % 2 == 0, 6, 7)], -1)
  weights = jax.nn.softmax(jax.random.normal(kw, (T, K)), axis=-1)
  return x, ids.astype(jnp.int32), weights


@functools.cache
def _block(ep_nodes: int, buffers: BufferMode, bf: float, chunks: int = 1, dispatch=DispatchKind.ALL_TO_ALL):
  settings = MoESettings(
    dispatch=dispatch if ep_nodes else DispatchKind.LOCAL,
    buffers=buffers,
    buffer_factor=bf,
    window_sizes=(2, 8),
    ep_nodes=max(ep_nodes, 1),
    exchange_chunks=chunks,
  )
  axis = "expert" if ep_nodes else None
  return jax.jit(functools.partial(moe_block, mesh=_mesh(), expert_axis=axis, settings=settings))


def _loss(block, ids):
  def f(x, weights, w0, w1, wo):
    return jnp.sum(block(x, ids, weights, w0, w1, wo)[0] * jnp.cos(jnp.arange(D)))

  return jax.jit(jax.grad(f, argnums=(0, 1, 2, 3, 4)))


def _distinct(ids, per: int) -> np.ndarray:
  """Distinct (ranks or nodes) each token's experts live on, with `per` experts each."""
  return np.array([len({int(e) // per for e in row}) for row in np.asarray(ids)])


def _network_rows(ids, *, nodes: int) -> int:
  """Rows that must cross the network: each token to each other node hosting one of its experts."""
  own = np.arange(T) // (T // 8) // (8 // nodes)  # tokens split over the 8 devices in order
  return sum(len({int(e) // (E // nodes) for e in row} - {int(n)}) for row, n in zip(np.asarray(ids), own, strict=True))


_CASES = [
  pytest.param(2, "random", BufferMode.BOUNDED, 2.0, id="2nodes-random-bounded"),
  pytest.param(2, "one_rank", BufferMode.BOUNDED, 1.0, id="2nodes-one_rank-bounded"),
  pytest.param(4, "random", BufferMode.BOUNDED, 0.5, id="4nodes-random-tight"),
  pytest.param(2, "random", BufferMode.WORST_CASE, 1.5, id="2nodes-random-worst_case"),
  pytest.param(4, "one_rank", BufferMode.WORST_CASE, 1.5, marks=pytest.mark.extended, id="4nodes-one_rank-worst"),
]


@pytest.mark.parametrize(("nodes", "routing", "buffers", "bf"), _CASES)
def test_cross_node_exchange_matches_ep1_forward_and_gradients(nodes, routing, buffers, bf):
  """EP 8 over 2 or 4 nodes in two levels gives EP=1's outputs and gradients, dropless, deduplicated by
  rank (rows delivered) and by node (rows on the network); adversarial routing takes more rounds."""
  x, ids, weights = _tokens(routing)
  w = _weights()
  ref, _ = _block(0, BufferMode.WORST_CASE, 1.0)(x, ids, weights, *w)
  got, stats = _block(nodes, buffers, bf)(x, ids, weights, *w)
  np.testing.assert_allclose(got, ref, **TOL)
  got_grads = _loss(_block(nodes, buffers, bf), ids)(x, weights, *w)
  for a, b in zip(got_grads, _loss(_block(0, buffers, bf), ids)(x, weights, *w), strict=True):
    np.testing.assert_allclose(a, b, **TOL)
  assert float(stats["dropped"]) == 0.0
  assert float(stats["rows_sent"]) == _distinct(ids, E // 8).sum()  # once per (token, rank)
  assert float(stats["rows_sent_network"]) == _network_rows(ids, nodes=nodes)
  assert float(stats["nodes_per_token"]) == _distinct(ids, E // nodes).max()
  if buffers == BufferMode.WORST_CASE:
    assert float(stats["rounds"]) == 1.0
  elif routing == "one_rank" or bf < 1:
    assert float(stats["rounds"]) > 1, "the adversarial and tight cases must take more than one round"


def test_cross_node_group_limited_routing_crosses_to_at_most_its_groups_nodes():
  """Two groups of 4 experts, one chosen per token, one group per node of 4 ranks: each token reaches one
  node; the network carries a row only for the tokens whose group lives on the other node."""
  x, ids, weights = _tokens("grouped")
  w = _weights()
  ref, _ = _block(0, BufferMode.WORST_CASE, 1.0)(x, ids, weights, *w)
  got, stats = _block(2, BufferMode.BOUNDED, 1.5)(x, ids, weights, *w)
  np.testing.assert_allclose(got, ref, **TOL)
  assert float(stats["nodes_per_token"]) == 1.0
  assert float(stats["rows_sent_network"]) == _network_rows(ids, nodes=2) <= T


_CHUNK_CASES = [
  pytest.param(2, "random", 1.5, 2, id="2nodes-2chunks"),
  pytest.param(1, "random", 1.5, 2, id="1node-2chunks"),  # one level: the chain at the only level
  pytest.param(2, "one_rank", 1.0, 2, id="2nodes-2chunks-more_rounds"),  # further rounds beside the chain
  pytest.param(1, "one_rank", 0.5, 2, id="1node-2chunks-more_rounds"),
  pytest.param(2, "one_rank", 1.0, 4, id="2nodes-4chunks-more_rounds"),
  pytest.param(4, "random", 0.5, 4, marks=pytest.mark.ci, id="4nodes-4chunks-tight"),
]


@pytest.mark.parametrize(("nodes", "routing", "bf", "chunks"), _CHUNK_CASES)
def test_chunks_give_the_same_outputs_gradients_and_counts(nodes, routing, bf, chunks):
  """The tokens in chunks (each its own rounds, round 0 of every chunk first, the chunks chained by
  optimization barriers, for overlap) change nothing but the schedule: the outputs, every gradient and the
  exchange's counts are those of one chunk."""
  x, ids, weights = _tokens(routing)
  w = _weights()
  one, s1 = _block(nodes, BufferMode.BOUNDED, bf)(x, ids, weights, *w)
  got, s2 = _block(nodes, BufferMode.BOUNDED, bf, chunks)(x, ids, weights, *w)
  np.testing.assert_allclose(got, one, **TOL)
  for key in ("rows_sent", "rows_sent_network", "nodes_per_token", "dropped"):
    assert float(s2[key]) == float(s1[key]), key
  if routing == "one_rank":  # the chunks really ran further rounds
    assert float(s2["rounds"]) > 1
  grads = _loss(_block(nodes, BufferMode.BOUNDED, bf, chunks), ids)(x, weights, *w)
  for a, b in zip(grads, _loss(_block(nodes, BufferMode.BOUNDED, bf), ids)(x, weights, *w), strict=True):
    np.testing.assert_allclose(a, b, **TOL)


@pytest.mark.ci  # kept out of the README suite's 10 minutes; CI runs the ci tier
def test_cross_node_rounds_under_the_stages_vmap_match_each_stage_alone():
  """Under MaxText's pipeline stages (`vmap(spmd_axis_name="stage")`) the two levels' grouped all-to-alls
  run mapped (JAX batches no all_to_all with groups; `collectives` maps them itself): each stage's
  outputs, gradients and rounds are those of the block on that stage alone."""
  mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("stage", "expert"))
  sub = Mesh(np.array(jax.devices()[:4]), ("expert",))
  settings = MoESettings(dispatch=DispatchKind.ALL_TO_ALL, buffer_factor=1.0, window_sizes=(2, 8), ep_nodes=2)
  stages = [_tokens("random"), _tokens("one_rank")]
  x, ids, weights = (jnp.stack(a) for a in zip(*stages, strict=True))
  w = tuple(jnp.stack([a, a * 0.5]) for a in _weights())

  def stage(x, ids, weights, *w):
    return moe_block(x, ids, weights, *w, mesh=mesh, expert_axis="expert", settings=settings, vmapped_axes=("stage",))

  def grads_of(fn, ids):
    def f(x, weights, *w):
      return jnp.sum(fn(x, ids, weights, *w)[0] * jnp.cos(jnp.arange(D)))

    return jax.jit(jax.grad(f, argnums=(0, 1, 2, 3, 4)))

  vmapped = jax.vmap(stage, spmd_axis_name="stage")
  with jax.set_mesh(mesh):
    y, stats = jax.jit(vmapped)(x, ids, weights, *w)
    grads = grads_of(vmapped, ids)(x, weights, *w)
  assert float(stats["rounds"][1]) > 1.0
  one = functools.partial(moe_block, mesh=sub, expert_axis="expert", settings=settings)
  for s in range(2):
    want, want_stats = jax.jit(one)(x[s], ids[s], weights[s], *(a[s] for a in w))
    np.testing.assert_allclose(y[s], want, **TOL)
    assert float(want_stats["rounds"]) == float(stats["rounds"][s])
    want_grads = grads_of(one, ids[s])(x[s], weights[s], *(a[s] for a in w))
    for a, b in zip(grads, want_grads, strict=True):
      np.testing.assert_allclose(a[s], b, **TOL)
