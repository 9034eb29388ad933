"""Expert parallelism across nodes: the exchange in two levels, and the buffer sizes of every bounded exchange.

The expert axis of P = N x L ranks spans N nodes (NVLink domains) of L ranks each, rank p = n x L + l
(MaxText's mesh puts an axis's DCN degree outside its ICI degree). Experts are split evenly and in order,
so node n holds experts [n x E / N, (n + 1) x E / N). The exchange runs in two levels (DeepEP's and NCCL
EP's shape, in portable collectives):

- network: the ranks with the same l on every node exchange (groups [l, L + l, ...]), each standing for
  its node's E / N experts. A token goes once to each node that hosts any of its top-k experts (dedup by
  node), to the rank of its own index there: GPU l of one node talks to GPU l of another, over its NIC.
- NVLink: the L ranks of one node exchange (groups [n L, ..., n L + L - 1]), E / P experts each: each row
  that arrived from the network goes once to each rank of the node that hosts one of its experts.

Combine retraces both: a rank's routing-weighted sum goes back over NVLink to the rank that forwarded the
row, which sums the node's results for the token before they cross the network, once, back to the token.

DeepSeek-V3's group-limited routing picks a token's experts from its top `topk_routing_group` of
`n_routing_groups` groups of contiguous experts: with the groups a multiple of the nodes, each node holds
whole groups and a token crosses the network to at most `topk_routing_group` nodes (4 of 8 for the 671B);
with the nodes a multiple of the groups, each group spans N / G whole nodes and a token reaches at most
`topk_routing_group` x N / G of them. Without group-limited routing a token reaches up to min(K, N) nodes
(`expected_nodes`).

Bounded buffers (`moe.rounds`): each level sends at most a budget per (source, destination) and round, the
overflow in further rounds. The network level counts rows (what crosses it), G1 = buffer_factor x the
mean rows per node; the last level counts (row, local expert) pairs (the grouped GEMM's rows), G =
buffer_factor x T x K / (its ranks), as the one-level rounds always have.

Shape legend: T tokens per device, K top-k, E experts, P ranks, N nodes, L ranks per node.
"""

import math
from dataclasses import dataclass


def network_groups(nodes: int, per_node: int) -> tuple[tuple[int, ...], ...]:
  """The network level's groups: rank l of every node. Example: (2, 3) -> ((0, 3), (1, 4), (2, 5))."""
  return tuple(tuple(n * per_node + i for n in range(nodes)) for i in range(per_node))


def nvlink_groups(nodes: int, per_node: int) -> tuple[tuple[int, ...], ...]:
  """The NVLink level's groups: the ranks of one node. Example: (2, 3) -> ((0, 1, 2), (3, 4, 5))."""
  return tuple(tuple(n * per_node + i for i in range(per_node)) for n in range(nodes))


def expected_nodes(*, num_experts: int, top_k: int, nodes: int, routing_groups: tuple[int, int] = (0, 0)) -> float:
  """Expected distinct nodes a token's top-k experts live on, its groups (or, without group-limited
  routing, its experts) a uniform random choice. With (n_routing_groups, topk_routing_group) and whole
  groups on each node: nodes x (1 - C(G - G/N, g) / C(G, g)), at most g. With each group over N/G whole
  nodes: the g chosen groups' g N / G nodes, each missed by all K experts drawn from the chosen groups'
  g E / G: g N / G x (1 - C(g E / G - E / N, K) / C(g E / G, K)).

  Example: 256 experts, top-8, 8 nodes, groups (8, 4) -> 8 x (1 - C(7, 4) / C(8, 4)) = 4.0; without
  groups -> 8 x (1 - C(224, 8) / C(256, 8)) = 5.29; 16 nodes, groups (8, 4) -> 8 x (1 - C(112, 8) /
  C(128, 8)) = 5.34.
  """
  if nodes <= 1:
    return 1.0
  groups, chosen = routing_groups
  if groups > 0 and groups % nodes == 0:
    return nodes * (1 - math.comb(groups - groups // nodes, chosen) / math.comb(groups, chosen))
  if groups > 0 and nodes % groups == 0:
    pool, per_node = chosen * num_experts // groups, num_experts // nodes
    return chosen * nodes // groups * (1 - math.comb(pool - per_node, top_k) / math.comb(pool, top_k))
  return nodes * (1 - math.comb(num_experts - num_experts // nodes, top_k) / math.comb(num_experts, top_k))


@dataclass(frozen=True)
class LevelSizes:
  """One level of a bounded exchange, per round: `ranks` destinations of `local_experts` experts each,
  at most `budget` rows (`counts_rows`) or (row, local expert) pairs per (source, destination), so
  `send_rows` rows per destination."""

  ranks: int
  local_experts: int
  budget: int
  counts_rows: bool
  send_rows: int

  @property
  def recv_rows(self) -> int:
    """Rows a rank receives per round: `send_rows` from each source."""
    return self.ranks * self.send_rows


def round_levels(
  num_tokens: int,
  top_k: int,
  *,
  num_experts: int,
  ranks: int,
  nodes: int = 1,
  buffer_factor: float,
  routing_groups: tuple[int, int] = (0, 0),
  worst_case: bool = False,
) -> tuple[LevelSizes, ...]:
  """The levels of the bounded exchange of `num_tokens` tokens per device (see the module docstring);
  `worst_case`: budgets that no routing exceeds (one round always).

  Example: 1,024 tokens, top-8, 64 experts on 8 ranks, one node, factor 1.5 -> one level, budget
    ceil(1.5 x 1024 x 8 / 8) = 1536 pairs, 1024 rows per destination.
  """
  per_rank = num_experts // ranks
  levels, tokens_in = [], num_tokens
  if nodes > 1:
    mean_rows = num_tokens * expected_nodes(
      num_experts=num_experts, top_k=top_k, nodes=nodes, routing_groups=routing_groups
    )
    g1 = num_tokens if worst_case else max(1, min(num_tokens, math.ceil(buffer_factor * mean_rows / nodes)))
    levels.append(LevelSizes(nodes, num_experts // nodes, g1, True, g1))
    tokens_in = nodes * g1
  last = ranks // max(nodes, 1)
  most = tokens_in * min(top_k, per_rank)
  g = most if worst_case else max(top_k, min(most, math.ceil(buffer_factor * num_tokens * top_k / last)))
  levels.append(LevelSizes(last, per_rank, g, False, min(g, tokens_in)))
  return tuple(levels)


def gemm_rows(levels: tuple[LevelSizes, ...], top_k: int) -> int:
  """Rows the grouped GEMM gets per round: the last level's P x (G + K - 1) pairs (a round's sorted pairs
  with the empty ones cut off), at most its received rows x K."""
  last = levels[-1]
  return min(last.ranks * (last.budget + top_k - 1), last.recv_rows * top_k)


def received_rows(levels: tuple[LevelSizes, ...]) -> int:
  """Rows of the exchange's receive buffers per round on one device, every level's (they are live at
  once: the network level's rows wait for their NVLink level's results)."""
  return sum(level.recv_rows for level in levels)
