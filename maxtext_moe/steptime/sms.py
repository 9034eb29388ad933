"""The SMs a communication kernel holds while it runs beside the compute (`model.predict`: "SMs held by
collectives beside the compute").

An NCCL collective is one CUDA kernel of one CTA per channel, each resident on its own SM for the whole
collective (NCCL 2.30.7-1, src/enqueue.cc:1756: the grid is the plan's channel count; a SIMPLE-protocol
CTA takes 544 threads and about 80 KB of shared memory, which a large GEMM's CTA, near the SM's 228 KiB,
cannot share). A large message uses every channel of its communicator (enqueue.cc:2070-2116 lowers the
count only below about 64 bytes per thread and channel). So while a collective runs beside the GEMMs on
the step's other stream, they run on the SMs it leaves: during t seconds of it, the compute loses
t x CTAs / SMs. XLA:GPU leaves the count to NCCL (`maxCTAs` unset but for Blackwell with NCCL >= 2.28,
where it caps it at 32: xla/backends/gpu/collectives/nccl_collectives.cc) and its latency estimators do not
price this; NCCL's copy-engine (zero-CTA) collectives need buffers registered in symmetric windows, which
XLA does not do by default (`xla_gpu_experimental_enable_nccl_symmetric_buffers` false). DeepSeek-V3's
report names the cost from the other side: its exchange kernels hold 20 of the H800's 132 SMs, "which will
limit the computational throughput" (arXiv 2412.19437, 3.5.1).

The channel count, as NCCL's topology search and its post-processing reach it for large messages
(src/graph/search.cc `ncclTopoCompute`, `ncclTopoDupChannels`; src/graph/connect.cc `ncclTopoPostset`):

- a ring collective (all-gather, reduce-scatter, all-reduce) inside one NVLink domain: channels at the
  first per-channel speed of the architecture's intra-node table that NVLink's total holds (H100: 6 at 60
  GB/s of 18 x 20.6; B200 and later: 8 at 90 of 18 x 40.1), doubled by the search and again by the
  post-processing: 24 on Hopper, 32 on Blackwell (NCCL's own logs: "24 coll channels" on 8 H100s, "32 coll
  channels" on 8 GB300s). NVLink SHARP is not chosen for large all-gathers and reduce-scatters by NCCL's
  tuning (its 16-24 channels would move less than the ring);
- across domains: one channel per NIC of the group's GPUs in a domain (each GPU its own NIC) at the
  inter-node table's speed the NIC allows, no more than carry NVLink's total (the search stops there),
  doubled by the search unless there are more than 4 under 50 GB/s each (`ncclTopoDupChannels`), doubled by
  the post-processing (connect.cc:460), and again on Hopper and later where fewer than 16 still run over
  45 GB/s each (connect.cc:480-483): 16 for eight H100s of a node, 4 for one;
- an all-to-all or a point-to-point send: NCCL's p2p channels, the ring's count rounded up to a power of 2
  (src/graph/paths.cc: `p2pnChannels = pow2Up(min(nChannels, ...))`): 32 on 8 H100s ("32 p2p channels").

Host copies run on the copy engines and hold no SM. Across domains the per-GPU count is inferred from the
source, not read off a log for every group size.
"""

import math
from typing import Any

from maxtext_moe.steptime.gemm import arch

# NCCL 2.30.7-1: a GPU's NVLink bandwidth as its search counts it, 18 links x SM90_NVLINK_BW 20.6 or
# SM100_NVLINK_BW 40.1 GB/s (src/graph/topo.h:22-24), the first per-channel speed of its intra-node table
# and the per-channel speeds (GB/s) its inter-node search tries (src/graph/search.cc:1051-1067)
NVLINK_TOTAL = {"hopper": 18 * 20.6, "blackwell": 18 * 40.1}
INTRA_FIRST_SPEED = {"hopper": 60.0, "blackwell": 90.0}
INTER_SPEEDS = {
  "hopper": (48.0, 45.0, 42.0, 40.0, 30.0, 24.0, 22.0, 20.0, 17.5, 15.0, 12.0, 6.0, 3.0),
  "blackwell": (96.0, 86.0, 80.0, 48.0, 45.1, 42.0, 40.0, 30.0, 24.0, 22.0, 20.0),
}
MAX_CHANNELS = 64  # NCCL's MAXCHANNELS (src/include/device.h:91)


def _inside(arch_name: str) -> int:
  """Ring channels inside one NVLink domain: as many at the first speed as NVLink's total holds, doubled by
  the search and by the post-processing (24 on Hopper, 32 on Blackwell)."""
  return 4 * int(NVLINK_TOTAL[arch_name] // INTRA_FIRST_SPEED[arch_name])


def _across(local: int, nic_gbs: float, arch_name: str) -> int:
  """Ring channels of a group with `local` GPUs in each of several domains, each GPU its own NIC: one per
  NIC at the speed it allows, until they carry NVLink's total (the search's stop)."""
  speeds = INTER_SPEEDS[arch_name]
  speed = max((s for s in speeds if s <= nic_gbs), default=speeds[-1])
  n = min(local, math.ceil(NVLINK_TOTAL[arch_name] / speed))
  if speed >= 25 and not (speed < 50 and n > 4):  # ncclTopoDupChannels
    n, speed = 2 * n, speed / 2
  n *= 2  # ncclTopoPostset
  if speed > 45 and n < 16:  # connect.cc:480-483, sm_90 and later over several nodes
    n *= 2
  return min(n, MAX_CHANNELS)


def ctas(kind: str, group: int, domains: int, gpu: Any) -> int:
  """The SMs one collective of `kind` over `group` GPUs in `domains` NVLink domains holds while it runs."""
  if kind == "host" or group <= 1:
    return 0
  a = arch(gpu)
  domains = max(1, min(domains, group))
  ring = _inside(a) if domains == 1 else _across(max(1, group // domains), gpu.network_gbs, a)
  if kind in ("all-to-all", "p2p"):
    return min(2 ** math.ceil(math.log2(ring)), MAX_CHANNELS)
  return ring
