"""The step-time model: one training step's time on a GPU, from the work it does and the hardware table.

`predict(workload, gpu)` adds up, per GPU and step:

  compute      FLOPs per class (dense GEMMs, grouped expert GEMMs, attention; MaxText's own count plus what
               the remat policy recomputes) at the class's peak for its number format x an efficiency
               measured by a published microbenchmark (`CONSTANTS`), and the memory-bound ops' bytes at
               HBM bandwidth x its measured efficiency
  collectives  each from its bytes, its group size and whether its group stays inside one NVLink domain:
               a group of g GPUs spanning r domains moves (g-1)/g of its data over NVLink and (r-1)/g of it
               out of each GPU's own NIC (NCCL's rings cross a domain boundary once per chunk), at the
               slower of the two; all-to-all sends (r-1)/r of its rows over the network
  overlap      FSDP weight gathers, gradient reductions and host offload copies run on their own streams
               beside the compute (XLA's latency-hiding scheduler): only what exceeds the compute is exposed;
               the expert exchange (dispatch and combine) waits for the router and feeds the expert GEMMs, so
               only the shared experts' GEMMs hide it
  host         host syncs (a conditional outside a command buffer, `compile`'s count) at a launch latency
               each; pipeline bubbles (pp - 1) / (vpp x microbatches) of the compute

and prints step time, tokens/s, TFLOP/s per GPU (MaxText's count) and MFU against the bf16 peak, and the
three largest exposed costs. A `Workload` comes from a resolved MaxText config (`workload`: the
parameter tree's shardings give the FSDP traffic, the MoE settings the exchange), or from `compile`'s
report of the XLA:GPU program (`with_compiled`: its all-gathers, reduce-scatters and all-reduces replace
the analytic ones).

No constant here was fitted to a figure `bench timemodel` checks against.
"""

import dataclasses
from typing import Any

from maxtext_moe.config.hardware import GpuModel


@dataclasses.dataclass(frozen=True)
class Constant:
  value: float
  source: str


CONSTANTS: dict[str, Constant] = {
  "gemm_efficiency_blackwell": Constant(
    2672 / 5000,
    "Megatron-Core, 'Optimizing DeepSeek-V3 Training Performance on NVIDIA GB200 NVL72' (2025-11): an MXFP8 "
    "grouped GEMM at K=7,168, N=2,048 runs at 2,672 TFLOP/s on a GB200 (L2 flushed), of 5,000 dense; applied "
    "to every GEMM format (no published bf16 Blackwell GEMM microbenchmark was found)",
  ),
  "gemm_efficiency_hopper": Constant(
    1350 / 1979,
    "DeepGEMM README (deepseek-ai, 2025-02): FP8 GEMMs, dense and grouped, up to 1,350+ TFLOP/s on H800, "
    "of 1,979 dense; applied to every GEMM format",
  ),
  "attention_efficiency_blackwell": Constant(
    1613 / 1.3 / 2250,
    "FlashAttention-4 (Dao et al., 2026): 1,613 TFLOP/s BF16 on B200, 1.3x cuDNN 9.13, so cuDNN at about "
    "1,241 of 2,250 dense",
  ),
  "attention_efficiency_hopper": Constant(
    740 / 989, "FlashAttention-3 (Shah et al., 2024): BF16 forward up to 740 TFLOP/s on H100, of 989 dense"
  ),
  "hbm_efficiency": Constant(
    6000 / 8000,
    "CUDA samples bandwidthTest on B200 (newmind.ai, 2025-04): over 6,000 GB/s device-to-device of 8,000",
  ),
  "nvlink_efficiency": Constant(
    811 / 900,
    "nccl-tests over multi-node NVLink on GB200 NVL72 (lixueduan.com, 2025): 811 GB/s bus bandwidth of "
    "900 GB/s per direction",
  ),
  "network_efficiency": Constant(1.0, "the NIC's line rate (data sheet; an upper bound: no measurement used)"),
  "host_sync_s": Constant(
    20e-6, "one kernel launch after the host waited for the stream (CUDA launch latency, order 5-20 us)"
  ),
}

HOST_LINK_GBS = {  # one direction, per GPU
  "pcie5": Constant(64.0, "PCIe 5.0 x16: 64 GB/s per direction (PCI-SIG)"),
  "c2c": Constant(
    225.0, "NVLink-C2C: 900 GB/s bidirectional per Grace CPU and its 2 Blackwell GPUs (NVIDIA GB200/GB300 data sheet)"
  ),
}


def constant(name: str) -> float:
  return CONSTANTS[name].value


def _arch(gpu: GpuModel) -> str:
  return "blackwell" if gpu.compute_capability[0] >= 10 else "hopper"


def host_link_gbs(gpu: GpuModel) -> float:
  return HOST_LINK_GBS["c2c" if gpu.nvlink_domain > 8 else "pcie5"].value


@dataclasses.dataclass(frozen=True)
class Transfer:
  """One kind of communication per GPU and step."""

  name: str
  kind: str  # all-gather, reduce-scatter, all-reduce, all-to-all, p2p, host
  wire_bytes: float  # bytes one GPU moves (result size for a gather, input for a reduce-scatter)
  group: int  # GPUs in its group
  domains: int  # NVLink domains the group spans
  overlappable: bool  # runs beside the compute (FSDP, gradients, offload) or waits for it (EP)
  count: float = 1.0  # launches per step


@dataclasses.dataclass
class Workload:
  """What one GPU does in one training step."""

  label: str
  tokens: int  # tokens per GPU per step
  model_tflops: float  # MaxText's count per GPU per step (no recompute): the TFLOP/s reported
  flops: dict[str, float]  # per class: dense, grouped, attention (recompute included)
  formats: dict[str, str]  # class -> bf16 / fp8 / mxfp8
  memory_bytes: float  # memory-bound ops' HBM traffic
  transfers: list[Transfer]
  hideable_flops: float  # FLOPs that can hide the expert exchange (the shared experts')
  host_syncs: float = 0.0
  pipeline: tuple[int, int, int] = (1, 1, 1)  # stages, virtual stages, microbatches
  sources: dict[str, str] = dataclasses.field(default_factory=dict)  # where each part came from


@dataclasses.dataclass
class Prediction:
  workload: Workload
  gpu: GpuModel
  step_s: float
  parts: dict[str, float]  # compute parts and exposed costs, seconds
  exposed: list[tuple[str, float]]  # largest exposed costs first

  @property
  def tokens_per_s_per_gpu(self) -> float:
    return self.workload.tokens / self.step_s

  @property
  def tflops_per_gpu(self) -> float:
    return self.workload.model_tflops / self.step_s

  @property
  def mfu(self) -> float:
    return self.tflops_per_gpu / self.gpu.peak_tflops["bf16"]

  def as_dict(self) -> dict[str, Any]:
    return {
      "label": self.workload.label,
      "step_s": round(self.step_s, 4),
      "tokens_per_s_per_gpu": round(self.tokens_per_s_per_gpu, 1),
      "tflops_per_gpu": round(self.tflops_per_gpu, 1),
      "mfu_bf16": round(self.mfu, 4),
      "parts_s": {k: round(v, 4) for k, v in self.parts.items()},
      "exposed_s": [[k, round(v, 4)] for k, v in self.exposed[:3]],
      "sources": self.workload.sources,
    }


def transfer_seconds(t: Transfer, gpu: GpuModel) -> float:
  """Time of one step's worth of `t` on `gpu` (see the module docstring)."""
  if t.kind == "host":
    return t.wire_bytes / (host_link_gbs(gpu) * 1e9)
  nvlink = gpu.nvlink_gbs * 1e9 * constant("nvlink_efficiency")
  net = gpu.network_gbs * 1e9 * constant("network_efficiency")
  g, r = max(t.group, 1), max(t.domains, 1)
  if g == 1:
    return 0.0
  if t.kind == "p2p":
    return t.wire_bytes / (net if r > 1 else nvlink)
  if t.kind == "all-to-all":
    local = t.wire_bytes * (g / r - 1) / g / nvlink
    remote = t.wire_bytes * (r - 1) / r / net if r > 1 else 0.0
    return max(local, remote)
  passes = 2 if t.kind == "all-reduce" else 1  # a reduce-scatter then an all-gather
  over_nvlink = passes * t.wire_bytes * (g - 1) / g / nvlink
  over_net = passes * t.wire_bytes * (r - 1) / g / net if r > 1 else 0.0
  return max(over_nvlink, over_net)


def predict(w: Workload, gpu: GpuModel) -> Prediction:
  """The step time of `w` on `gpu`."""
  arch = _arch(gpu)
  eff = {"dense": constant(f"gemm_efficiency_{arch}"), "grouped": constant(f"gemm_efficiency_{arch}")}
  eff["attention"] = constant(f"attention_efficiency_{arch}")
  parts: dict[str, float] = {}
  for cls, flops in w.flops.items():
    fmt = w.formats.get(cls, "bf16")
    peak = gpu.peak_tflops.get(fmt, gpu.peak_tflops["bf16"]) * 1e12
    label = {"attention": "attention (bf16)", "head": f"unembedding and router GEMMs ({fmt})"}.get(cls)
    parts[label or f"{cls} GEMMs ({fmt})"] = flops / (peak * eff.get(cls, eff["dense"]))
  parts["memory-bound ops"] = w.memory_bytes / (gpu.hbm_bandwidth * constant("hbm_efficiency"))
  compute = sum(parts.values())
  dense_rate = gpu.peak_tflops.get(w.formats.get("dense", "bf16"), gpu.peak_tflops["bf16"]) * 1e12 * eff["dense"]
  hide_ep = w.hideable_flops / dense_rate

  exposed: dict[str, float] = {}
  streams: dict[str, float] = {}
  for t in w.transfers:
    seconds = transfer_seconds(t, gpu)
    if t.overlappable:  # one stream for collectives, one for host copies
      stream = "host" if t.kind == "host" else "collectives"
      streams[stream] = streams.get(stream, 0.0) + seconds
      parts[f"{t.name} (overlapped)"] = seconds
    else:
      exposed[t.name] = exposed.get(t.name, 0.0) + seconds
  ep_total = sum(exposed.values())
  if ep_total > 0:  # the shared experts hide part of the exchange, in proportion
    hidden = min(hide_ep, ep_total)
    exposed = {k: v * (1 - hidden / ep_total) for k, v in exposed.items()}
  for stream, seconds in streams.items():
    if seconds > compute:
      exposed[f"{'host offload copies' if stream == 'host' else 'FSDP/gradient collectives'} beyond the compute"] = (
        seconds - compute
      )
  if w.host_syncs:
    exposed["host syncs"] = w.host_syncs * constant("host_sync_s")
  stages, virtual, micro = w.pipeline
  if stages > 1:
    exposed["pipeline bubble"] = compute * (stages - 1) / (virtual * micro)
  step = compute + sum(exposed.values())
  ranked = sorted(exposed.items(), key=lambda kv: -kv[1])
  parts |= {f"exposed: {k}": v for k, v in ranked}
  return Prediction(w, gpu, step, parts, ranked)


def format_prediction(p: Prediction) -> str:
  """The table `plan --time` prints."""
  w = p.workload
  lines = [
    f"step-time model: {w.label} on {p.gpu.product}",
    f"  {'per GPU and step':<68}{'seconds':>9}",
  ]
  lines += [f"  {name:<68}{s:>9.3f}" for name, s in p.parts.items()]
  lines += [
    f"  {'step':<68}{p.step_s:>9.3f}",
    "",
    f"  {p.tokens_per_s_per_gpu:,.0f} tokens/s per GPU; {p.tflops_per_gpu:,.0f} TFLOP/s per GPU (MaxText's count, "
    f"{w.model_tflops:,.0f} TFLOP per step); MFU {p.mfu:.1%} of the {p.gpu.peak_tflops['bf16']:,.0f} bf16 peak",
    "  largest exposed costs: " + ("; ".join(f"{k} {v:.3f} s" for k, v in p.exposed[:3]) or "none"),
  ]
  lines += [f"  {part}: {src}" for part, src in w.sources.items()]
  return "\n".join(lines)


def unique_ranks(num_experts: int, top_k: int, ranks: int) -> float:
  """Expected distinct ranks among a token's top-k experts (`moe.permute.expected_distinct_ranks`; 1 without
  EP): what an exchange that sends a token once per destination rank puts on the wire (TE's NCCL EP, ours)."""
  from maxtext_moe.moe.permute import expected_distinct_ranks  # pylint: disable=import-outside-toplevel

  return 1.0 if ranks <= 1 else expected_distinct_ranks(num_experts=num_experts, top_k=top_k, num_ranks=ranks)
