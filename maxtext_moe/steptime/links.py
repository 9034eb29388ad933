"""The links a GPU's transfers cross: its NIC (across NVLink domains) and its NVLink, and how long each is
busy in a step.

A collective's time (`model.transfer_seconds`) is the slower of the two links it crosses: a ring spanning
r domains of a group of g GPUs moves (g-1)/g of its data over NVLink and (r-1)/g of it out of each GPU's
NIC; an all-to-all sends (r-1)/r of its rows (or what NVLink forwarding leaves, `network_bytes`) over the
network and the rest of its group's share over NVLink; a send between stages takes one link.

The model runs the FSDP stream beside the compute and the expert exchange beside the GEMMs, each timed as
if it had its links to itself. They share them: every byte a step sends over the network leaves through
the same NIC, whichever stream it is on. So the step is at least each link's busy time, every transfer's
bytes on it at its bandwidth (NCCL's per-launch latency left out: it does not occupy the link). Where a
link's busy time is longer than the step the rest of the model gives, the difference is exposed
(`model.predict`). No constant: the links' bandwidths and efficiencies are the ones every transfer is
timed at (`constants.py`).
"""

from typing import Any

from maxtext_moe.config.hardware import GpuModel
from maxtext_moe.steptime.constants import constant

NETWORK = "network"
NVLINK = "NVLink"


def seconds(t: Any, gpu: GpuModel) -> dict[str, float]:
  """{link: seconds} that a step's worth of the transfer `t` (a `model.Transfer`) occupies the GPU's NIC and
  NVLink at their bandwidths; a host copy or a group of one occupies neither."""
  g, r = max(t.group, 1), max(t.domains, 1)
  if t.kind == "host" or g == 1:
    return {NETWORK: 0.0, NVLINK: 0.0}
  nvlink = gpu.nvlink_gbs * 1e9 * constant("nvlink_efficiency")
  net = gpu.network_gbs * 1e9 * constant("network_efficiency")
  if t.kind == "p2p":
    return {NETWORK: t.wire_bytes / net, NVLINK: 0.0} if r > 1 else {NETWORK: 0.0, NVLINK: t.wire_bytes / nvlink}
  if t.kind == "all-to-all":
    remote = (t.wire_bytes * (r - 1) / r if t.network_bytes is None else t.network_bytes) if r > 1 else 0.0
    return {NETWORK: remote / net, NVLINK: t.wire_bytes * (g / r - 1) / g / nvlink}
  passes = 2 if t.kind == "all-reduce" else 1  # a reduce-scatter then an all-gather
  over_net = passes * t.wire_bytes * (r - 1) / g / net if r > 1 else 0.0
  return {NETWORK: over_net, NVLINK: passes * t.wire_bytes * (g - 1) / g / nvlink}


def busy(transfers: list[Any], gpu: GpuModel) -> dict[str, float]:
  """{link: seconds} each link is busy in a step: every transfer's time on it, whichever stream it runs on
  and whether or not the compute hides it."""
  out = {NETWORK: 0.0, NVLINK: 0.0}
  for t in transfers:
    for link, s in seconds(t, gpu).items():
      out[link] += s
  return out


def lines(busy: dict[str, float], tokens: int) -> list[str]:
  """What `plan --time` prints under the step: each link's busy time, and the tokens/s per GPU no overlap
  gets past (the busier link's); nothing where no transfer crosses either."""
  if not any(busy.values()):
    return []
  link, longest = max(busy.items(), key=lambda kv: kv[1])
  return [
    f"  links busy a step: network {busy[NETWORK]:.3f} s, NVLink {busy[NVLINK]:.3f} s (every transfer's bytes "
    f"at its bandwidth): however well they overlap, at most {tokens / longest:,.0f} tokens/s per GPU ({link})"
  ]
