"""A collective's latency (its alpha, beside the bandwidth term of `model.transfer_seconds`): NCCL's own
tuning model, so many small messages in a large group cost what NCCL itself expects them to.

NCCL (src/graph/tuning.cc, v2.30.7-1) predicts a ring collective's latency as its base latency plus one
hardware latency per ring step: all-gather and reduce-scatter take g - 1 steps, all-reduce 2 (g - 1), of
which r - 1 (all-reduce: 2 (r - 1)) cross between the r NVLink domains at the network's step latency and
the rest stay on NVLink. The constants are its Ring / Simple protocol's (the protocol of large messages).
An all-to-all (and a point-to-point send) sends to its peers at once: one step, over the network when its
group spans domains. Host copies have none here (a DMA's start is microseconds against gigabytes).
"""

from maxtext_moe.steptime.constants import constant


def collective_latency_s(kind: str, group: int, domains: int) -> float:
  """Seconds of latency of one launch of a collective of `kind` over `group` GPUs in `domains` NVLink domains."""
  if kind == "host" or group <= 1:
    return 0.0
  base, nvlink, net = (constant(n) for n in ("nccl_base_latency_s", "nccl_nvlink_step_s", "nccl_net_step_s"))
  crossing = max(domains, 1) - 1
  if kind in ("all-to-all", "p2p"):
    return base + (net if crossing else nvlink)
  passes = 2 if kind == "all-reduce" else 1
  steps, inter = passes * (group - 1), passes * min(crossing, group - 1)
  return base + (steps - inter) * nvlink + inter * net
