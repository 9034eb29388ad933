"""The step-time model: one training step's time on a GPU, from the work it does and the hardware table.

`predict(workload, gpu)` adds up, per GPU and step:

  compute      FLOPs per class (dense GEMMs, grouped expert GEMMs, attention; MaxText's own count plus what
               the remat policy recomputes) at the class's peak for its number format x an efficiency:
               the GEMMs' by their shapes (`gemm.py`, XLA's measured matmul table), attention's forward
               and backward each its own (`constants.py`, published kernel benchmarks), and the
               memory-bound ops' bytes at HBM bandwidth x its measured efficiency
  imbalance    the grouped GEMMs and the expert exchange at the busiest EP rank's rows (`imbalance.py`)
  collectives  each from its bytes, its group size and whether its group stays inside one NVLink domain:
               a group of g GPUs spanning r domains moves (g-1)/g of its data over NVLink and (r-1)/g of it
               out of each GPU's own NIC (NCCL's rings cross a domain boundary once per chunk), at the
               slower of the two; all-to-all sends (r-1)/r of its rows over the network; plus NCCL's own
               latency per launch (`latency.py`)
  overlap      FSDP weight gathers, gradient reductions and host offload copies run on their own streams
               beside the compute (XLA's latency-hiding scheduler): only what exceeds the compute is exposed;
               the expert exchange (dispatch and combine) waits for the router and feeds the expert GEMMs:
               the share XLA:GPU schedules beside GEMMs (our rounds: measured in compiled programs by the
               tokens' chunks, or `compile`'s own figure) and the shared experts' GEMMs hide it; while a
               collective runs beside the compute its kernel holds SMs the compute then lacks (`sms.py`:
               NCCL's CTAs, t x CTAs / SMs of compute for t seconds beside it)
  host         host syncs (a conditional outside a command buffer, `compile`'s count) at a launch latency
               each; the gaps between kernels, in and outside command buffers (`launch.py`)
  bubble       pipeline stages (`Pipeline`): delay x (S - 1) / (virtual x microbatches) of the pipelined
               layers' useful time: Megatron's idle stages ((pp - 1) / (vpp x microbatches) of the compute),
               MaxText's bubble iterations, which run every stage's layers, expert exchange included, on
               filler (delay x (S - 1) of its M x R + delay x (S - 1) iterations; `stage_costs.py`)
  links        the step is at least as long as its NIC and its NVLink are busy: the streams above share
               them (every transfer's bytes on a link at its bandwidth, `links.py`); the excess is exposed

and prints step time, tokens/s, TFLOP/s per GPU (MaxText's count) and MFU against the bf16 peak, and the
three largest exposed costs. A `Workload` comes from a resolved MaxText config (`workload`: the
parameter tree's shardings give the FSDP traffic, the MoE settings the exchange), or from `compile`'s
report of the XLA:GPU program (`with_compiled`: its all-gathers, reduce-scatters and all-reduces replace
the analytic ones).

No constant here was fitted to a figure `bench timemodel` checks against.
"""

import dataclasses
import math
from typing import Any

from maxtext_moe.config.hardware import GpuModel
from maxtext_moe.steptime import gemm, launch, links, sms, spread
from maxtext_moe.steptime.constants import constant, host_link_gbs
from maxtext_moe.steptime.latency import collective_latency_s

Shape = tuple[int, int, int, float]  # one GEMM: M, N, K and its share of its class's FLOPs
Seconds = dict[str, float]  # seconds per line, stream or exchange


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
  network_bytes: float | None = None  # an all-to-all that forwards over NVLink: what crosses the network

  @property
  def exchange(self) -> bool:  # the expert exchange: an all-to-all the compute waits for
    return self.kind == "all-to-all" and not self.overlappable


@dataclasses.dataclass(frozen=True)
class Pipeline:
  """Pipeline stages: S stages, the virtual stages (Megatron) or circular repeats (MaxText) per stage, the
  microbatches, the activation delay (MaxText's pipeline_delay_activation_forwarding: 2), and the shares of
  the compute and of the expert exchange in the pipelined layers (1 and 0: Megatron's bubble is idle time
  of the whole compute)."""

  stages: int = 1
  virtual: int = 1
  micro: int = 1
  delay: int = 1
  share: float = 1.0
  exchange_share: float = 0.0

  @property
  def bubble(self) -> float:
    """The bubble over the pipelined layers' useful time: delay x (S - 1) / (virtual x microbatches), which
    is MaxText's delay x (S - 1) / (M x R + delay x (S - 1)) of their whole time."""
    return self.delay * (self.stages - 1) / (self.virtual * self.micro)


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
  attention_fwd_flops: float = 0.0  # of flops["attention"]: the forward's (the rest is backward, MaxText's 2x)
  gemm_shapes: dict[str, list[Shape]] = dataclasses.field(default_factory=dict)  # per class; none: a large GEMM
  kernels: tuple[float, float] = (0.0, 0.0)  # launched per step outside / inside command buffers or graphs
  imbalance: float = 1.0  # max/mean rows per EP rank (imbalance.py)
  host_syncs: float = 0.0
  exchange_beside: float = 0.0  # of the expert exchange, the share XLA:GPU runs beside GEMMs (`_beside_gemms`)
  exchange_sms: float = 0.0  # SMs the exchange's kernels hold beside the compute (0: NCCL's CTAs, `sms.ctas`)
  pipeline: Pipeline = Pipeline()
  sources: dict[str, str] = dataclasses.field(default_factory=dict)  # where each part came from


@dataclasses.dataclass
class Prediction:
  workload: Workload
  gpu: GpuModel
  step_s: float
  parts: dict[str, float]  # compute parts and exposed costs, seconds
  exposed: list[tuple[str, float]]  # largest exposed costs first
  busy: dict[str, float] = dataclasses.field(default_factory=dict)  # seconds each link is busy (`links.py`)

  @property
  def tokens_per_s_per_gpu(self) -> float:
    return self.workload.tokens / self.step_s

  @property
  def tflops_per_gpu(self) -> float:
    return self.workload.model_tflops / self.step_s

  @property
  def mfu(self) -> float:
    return self.tflops_per_gpu / self.gpu.peak_tflops["bf16"]

  def largest(self) -> list[tuple[str, float]]:
    """The costs on the step's critical path (compute lines and exposed costs), largest first."""
    return sorted(((k, v) for k, v in self.parts.items() if not k.endswith("(overlapped)")), key=lambda kv: -kv[1])

  def as_dict(self) -> dict[str, Any]:
    return {
      "label": self.workload.label,
      "step_s": round(self.step_s, 4),
      "tokens_per_s_per_gpu": round(self.tokens_per_s_per_gpu, 1),
      "tflops_per_gpu": round(self.tflops_per_gpu, 1),
      "mfu_bf16": round(self.mfu, 4),
      "parts_s": {k: round(v, 4) for k, v in self.parts.items()},
      "exposed_s": [[k, round(v, 4)] for k, v in self.exposed[:3]],
      "largest_s": [[k.removeprefix("exposed: "), round(v, 4)] for k, v in self.largest()[:3]],
      "links_busy_s": {k: round(v, 4) for k, v in self.busy.items()},
      "sources": self.workload.sources,
    }


def transfer_seconds(t: Transfer, gpu: GpuModel) -> float:
  """Time of one step's worth of `t` on `gpu`: the slower of the links it crosses (`links.py`), or the host
  link for a host copy."""
  if t.kind == "host":
    return t.wire_bytes / (host_link_gbs(gpu) * 1e9)
  return max(links.seconds(t, gpu).values())


def _compute(w: Workload, gpu: GpuModel) -> tuple[dict[str, float], float]:
  """({line: seconds} of the compute, the dense GEMMs' rate in FLOP/s): GEMMs at their shapes' efficiency,
  attention's forward and backward each at its own."""
  arch = gemm.arch(gpu)
  parts: dict[str, float] = {}
  dense_rate = 0.0
  for cls, flops in w.flops.items():
    fmt = w.formats.get(cls, "bf16")
    peak = gpu.peak_tflops.get(fmt, gpu.peak_tflops["bf16"]) * 1e12
    if cls == "attention":
      fwd = w.attention_fwd_flops or flops / 3
      bwd = (flops - fwd) * constant("attention_bwd_flops") / 2  # MaxText counts the backward as 2 forwards
      parts[f"attention forward ({fmt})"] = fwd / (peak * constant(f"attention_efficiency_{arch}"))
      parts[f"attention backward ({fmt})"] = bwd / (peak * constant(f"attention_bwd_efficiency_{arch}"))
      continue
    eff = gemm.class_efficiency(gpu, fmt, w.gemm_shapes.get(cls))
    name = {"head": "unembedding and router GEMMs"}.get(cls, f"{cls} GEMMs")
    parts[f"{name} ({fmt}, {eff:.0%} of peak at their shapes)"] = flops / (peak * eff)
    if cls == "dense":
      dense_rate = peak * eff
  parts["memory-bound ops"] = w.memory_bytes / (gpu.hbm_bandwidth * constant("hbm_efficiency"))
  return parts, dense_rate or gpu.peak_tflops["bf16"] * 1e12 * gemm.class_efficiency(gpu, "bf16", None)


def _transfers(w: Workload, gpu: GpuModel, parts: Seconds) -> tuple[Seconds, Seconds, Seconds]:
  """(waited for, beside the compute per stream, per stream or exchange the compute its kernels' SMs take
  if all of it ran beside it), NCCL's latency per launch included; the overlapped ones added to `parts`."""
  exposed: Seconds = {}
  streams: Seconds = {}
  held: Seconds = {}
  for t in w.transfers:
    bandwidth = transfer_seconds(t, gpu)
    launch = bandwidth / t.count if t.count else math.inf
    seconds = bandwidth + t.count * collective_latency_s(t.kind, t.group, t.domains, launch)
    if t.overlappable:  # one stream for collectives, one for host copies
      stream = "host" if t.kind == "host" else "collectives"
      streams[stream] = streams.get(stream, 0.0) + seconds
      parts[f"{t.name} (overlapped)"] = seconds
    else:
      exposed[t.name] = exposed.get(t.name, 0.0) + seconds
      stream = t.name
    ctas = w.exchange_sms if t.exchange and w.exchange_sms else sms.ctas(t.kind, t.group, t.domains, gpu)
    held[stream] = held.get(stream, 0.0) + seconds * ctas / gpu.sm_count
  return exposed, streams, held


def _beside_gemms(exchange_s: float, parts: dict[str, float], share: float) -> float:
  """The expert exchange hidden beside GEMMs: the share of its bytes XLA:GPU's program schedules with a GEMM
  between its start and done (`compile`'s report, or by chunks `constants.exchange_beside`), at most the
  GEMMs' own time."""
  gemms = sum(v for k, v in parts.items() if "GEMMs" in k)
  return min(exchange_s * share, gemms)


def predict(w: Workload, gpu: GpuModel) -> Prediction:
  """The step time of `w` on `gpu`."""
  parts, dense_rate = _compute(w, gpu)
  compute = sum(parts.values())
  exposed, streams, held = _transfers(w, gpu, parts)
  exchange = {t.name for t in w.transfers if t.exchange}
  ep_total = sum(v for k, v in exposed.items() if k in exchange)
  sms_held = 0.0  # of the compute, what the communication kernels beside it take (`sms.py`)
  if ep_total > 0:  # hidden: beside other chunks' expert GEMMs, then the shared experts'; in proportion
    beside = _beside_gemms(ep_total, parts, w.exchange_beside)
    if beside:
      parts[f"expert exchange beside GEMMs ({w.exchange_beside:.0%} of it) (overlapped)"] = beside
    hidden = beside + min(w.hideable_flops / dense_rate, ep_total - beside)
    exposed = {k: v * (1 - hidden / ep_total) if k in exchange else v for k, v in exposed.items()}
    sms_held += sum(held.get(k, 0.0) for k in exchange) * hidden / ep_total
  if w.flops.get("grouped"):  # the expert GEMMs and the exchange wait for the busiest rank
    grouped = sum(v for k, v in parts.items() if k.startswith("grouped GEMMs"))
    name = f"routing imbalance (busiest EP rank {w.imbalance:.2f}x the mean)"
    if w.imbalance > 1.0:
      exposed[name] = (w.imbalance - 1.0) * (grouped + sum(v for k, v in exposed.items() if k in exchange))
    else:  # shown, not ranked among the exposed costs
      parts[name] = 0.0
  if streams.get("collectives"):  # the part of the collectives' stream that runs beside the compute
    sms_held += held["collectives"] * min(1.0, compute / streams["collectives"])
  if sms_held:
    exposed["SMs held by collectives beside the compute"] = sms_held
  for stream, seconds in streams.items():
    if seconds > compute:
      exposed[f"{'host offload copies' if stream == 'host' else 'FSDP/gradient collectives'} beyond the compute"] = (
        seconds - compute
      )
  if w.host_syncs:
    exposed["host syncs"] = w.host_syncs * constant("host_sync_s")
  outside, inside = w.kernels
  if outside or inside:
    exposed[f"kernel launch gaps ({outside:,.0f} one by one, {inside:,.0f} from graphs)"] = launch.seconds(
      outside, inside
    )
  pipe = w.pipeline
  if pipe.stages > 1:  # the pipelined layers' compute and, where the bubble runs them, their exchange
    exchanged = sum(v for k, v in exposed.items() if k in exchange)
    exposed["pipeline bubble"] = pipe.bubble * (compute * pipe.share + exchanged * pipe.exchange_share)
  step = compute + sum(exposed.values())
  busy = links.busy(w.transfers, gpu)
  for link, seconds in busy.items():  # the streams share the NIC and NVLink (`links.py`)
    if seconds > step:
      exposed[f"{link} busy beyond the rest of the step (every transfer on it at its bandwidth)"] = seconds - step
      step = seconds
  ranked = sorted(exposed.items(), key=lambda kv: -kv[1])
  parts |= {f"exposed: {k}": v for k, v in ranked}
  return Prediction(w, gpu, step, parts, ranked, busy)


def format_prediction(p: Prediction) -> str:
  """The table `plan --time` prints, the model's spread over the published runs under it (`spread.py`)."""
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
  lines += links.lines(p.busy, w.tokens)
  lines += [f"  {part}: {src}" for part, src in w.sources.items()]
  lines += spread.lines(p.tokens_per_s_per_gpu, gemm.arch(p.gpu))
  return "\n".join(lines)


def unique_ranks(num_experts: int, top_k: int, ranks: int) -> float:
  """Expected distinct ranks among a token's top-k experts (`moe.permute.expected_distinct_ranks`; 1 without
  EP): what an exchange that sends a token once per destination rank puts on the wire (TE's NCCL EP, ours)."""
  from maxtext_moe.moe.permute import expected_distinct_ranks  # pylint: disable=import-outside-toplevel

  return 1.0 if ranks <= 1 else expected_distinct_ranks(num_experts=num_experts, top_k=top_k, num_ranks=ranks)
