"""A collective's latency (its alpha, beside the bandwidth term of `model.transfer_seconds`): NCCL's own
tuning model, so many small messages in a large group cost what NCCL itself expects them to.

NCCL (src/graph/tuning.cc, v2.30.7-1) predicts a ring collective's latency as its base latency plus one
hardware latency per ring step: all-gather and reduce-scatter take g - 1 steps, all-reduce 2 (g - 1), of
which r - 1 (all-reduce: 2 (r - 1)) cross between the r NVLink domains at the network's step latency and
the rest stay on NVLink. For each call it runs the algorithm and protocol its model predicts fastest
(latency + bytes / bandwidth). Large messages take the Simple protocol at full bandwidth (the model's
`transfer_seconds`, and its latencies here); a small one takes the LL protocol, a fraction of the
latency at half the bandwidth (a ring) or 1/3.8 of it (an all-reduce's tree, whose latency grows with
the log of the domains: 2 (ranks in a domain - 1) NVLink steps and 2 log2(domains) network levels). A
group of one GPU per domain crosses the network at the tree's LL step latency (tuning.cc:387). Left out:
LL128, NCCL's cap on LL's bandwidth (`llMaxBws`, which only matters where LL and Simple are close) and
its per-network overhead. An all-to-all (and a point-to-point send) sends to its peers at once: one step,
over the network when its group spans domains. Host copies have none here (a DMA's start is microseconds
against gigabytes).
"""

import math

from maxtext_moe.steptime.constants import constant


def collective_latency_s(kind: str, group: int, domains: int, launch_bandwidth_s: float = math.inf) -> float:
  """Seconds one launch of a collective of `kind` over `group` GPUs in `domains` NVLink domains takes beyond
  its Simple-protocol bandwidth time `launch_bandwidth_s` (unknown: a large message, the Simple protocol):
  the latency of the protocol NCCL picks, plus what that protocol's lower bandwidth adds."""
  if kind == "host" or group <= 1:
    return 0.0
  crossing = min(max(domains, 1), group) - 1
  if kind in ("all-to-all", "p2p"):
    return constant("nccl_base_latency_s") + constant("nccl_net_step_s" if crossing else "nccl_nvlink_step_s")
  passes = 2 if kind == "all-reduce" else 1
  steps, inter = passes * (group - 1), passes * crossing

  def ring(base: str, nvlink: str, net: str) -> float:
    return constant(base) + (steps - inter) * constant(nvlink) + inter * constant(net)

  simple = ring("nccl_base_latency_s", "nccl_nvlink_step_s", "nccl_net_step_s")
  if math.isinf(launch_bandwidth_s):
    return simple
  one_per_domain = crossing and group == crossing + 1
  ll_net = "nccl_ll_tree_net_step_s" if one_per_domain else "nccl_ll_net_step_s"
  options = [simple, ring("nccl_ll_base_latency_s", "nccl_ll_nvlink_step_s", ll_net)
             + launch_bandwidth_s * (1 / constant("nccl_ll_bandwidth") - 1)]  # fmt: skip
  if kind == "all-reduce":
    per_domain = group // (crossing + 1)
    tree = constant("nccl_ll_tree_base_latency_s") + 2 * (
      (per_domain - 1) * constant("nccl_ll_nvlink_step_s")
      + math.log2(crossing + 1) * constant("nccl_ll_tree_net_step_s")
    )
    options.append(tree + launch_bandwidth_s * (1 / constant("nccl_ll_tree_bandwidth") - 1))
  return min(options)
