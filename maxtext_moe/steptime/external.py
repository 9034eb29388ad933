"""Another framework's published layout as a step-time `Workload`: what `bench timemodel` checks the model's
hardware side against (Megatron-Core, Megatron-Bridge and NeMo Automodel runs of DeepSeek-V3 and Qwen3-MoE).

The same model and tokens as MaxText counts them (`train_tflops_per_device` of the model's config at the
run's tokens per GPU), on the run's own layout:
- tensor parallelism with sequence parallelism: the dense GEMMs split over `tp` (N / tp), two all-gathers
  and two reduce-scatters of the activations per layer and pass, on the critical path;
- pipeline parallelism: each GPU runs layers / pp layers for every micro-batch; the bubble (pp - 1) /
  (vpp x micro-batches) of the compute; point-to-point sends of each micro-batch's activations;
- expert parallelism: dispatch and combine per MoE layer and pass, a token sent once per destination rank
  (DeepEP and HybridEP deduplicate as TE's NCCL EP does) and across the network once per destination NVLink
  domain (their NVLink forwarding), bf16 on the wire; inside a domain at no more than HybridEP's measured
  throughput (`ep_kernel_gbs`: its kernels, not NVLink 5, set the pace on Blackwell; H100's NVLink 4 is
  slower than they are);
- data parallelism: Megatron's distributed optimizer (gradients reduce-scattered in float32 and parameters
  all-gathered in bf16 once per step, over the data-parallel group; the experts' over the expert-data
  group) or FSDP (NeMo Automodel: the non-expert parameters gathered in the forward and the backward);
- recompute: Megatron's `mlp` (the dense layers' MLP) and `mla_up_proj` (MLA's up projections);
- launches: every kernel from the host (PyTorch eager) unless the whole iteration is one CUDA graph; a
  device-to-host sync per MoE layer and micro-batch (the grouped GEMM's sizes) unless it is;
- Megatron's expert-parallel overlap (`moe_a2a_overlap`, `overlap_moe_expert_parallel_comm`): one
  micro-batch's dispatch and combine run beside another's compute, hidden up to the GEMMs' time, the
  compute beside it on the SMs its kernels leave (`ep_kernel_sms` of the GPU's, `sms.py`);
- Transformer Engine's fused grouped MLP (`NVTE_CUTEDSL_FUSED_GROUPED_MLP`): the experts' gated activation
  and the quantization of their down projection's input in the first GEMM's epilogue (`counts.py`);
- routing: a forced balance at 1.0, otherwise unmeasured (1.0, said so).
What MaxText cannot express is modelled here as a feature, never as a MaxText layout.
"""

import dataclasses
import math
from typing import Any

from maxtext_moe.steptime import launch
from maxtext_moe.steptime.constants import constant
from maxtext_moe.steptime.counts import gemm_shapes, memory_bytes_per_token, projection_shapes
from maxtext_moe.steptime.imbalance import BALANCED, UNMEASURED
from maxtext_moe.steptime.model import Pipeline, Transfer, Workload, unique_ranks


@dataclasses.dataclass(frozen=True)
class Layout:
  """A published run's layout, batch, formats and features."""

  gpus: int
  gpu: str  # config.hardware.GPUS key
  tp: int = 1
  pp: int = 1
  vpp: int = 1
  ep: int = 1
  fsdp: bool = False  # FSDP over the data-parallel group, not a distributed optimizer
  mbs: int = 1
  gbs: int = 1
  seq: int = 4096
  formats: tuple[str, str, str] = ("bf16", "bf16", "bf16")  # dense, grouped, attention
  recompute: tuple[str, ...] = ()  # Megatron's recompute modules: "mlp", "mla_up_proj"
  graphs: bool = False  # the whole iteration one CUDA graph
  balanced: bool = False  # the router forced to a balance
  a2a_overlap: bool = False  # the expert exchange beside another micro-batch's compute
  fused_mlp: bool = False  # the experts' activation and quantization in the first GEMM's epilogue

  @property
  def dp(self) -> int:
    return self.gpus // (self.tp * self.pp)

  @property
  def microbatches(self) -> int:
    return self.gbs // (self.dp * self.mbs)

  def describe(self) -> str:
    parts = [f"TP{self.tp}"] * (self.tp > 1) + [f"PP{self.pp}"] * (self.pp > 1) + [f"VPP{self.vpp}"] * (self.vpp > 1)
    parts += [f"EP{self.ep}"] + ([f"FSDP{self.dp}"] if self.fsdp else [])
    features = [
      n for n, on in (("graph", self.graphs), ("EP overlap", self.a2a_overlap), ("fused MLP", self.fused_mlp)) if on
    ]
    return (
      "/".join(parts) + f", MBS {self.mbs}, GBS {self.gbs}, {self.formats[0]}" + "".join(f", {f}" for f in features)
    )


def _flops(cfg: Any, lay: Layout, tokens: int, layers: int, dense_layers: int) -> tuple[dict[str, float], float, float]:
  from maxtext_moe.upstream.maxtext.compile import expert_tflops_per_device, train_tflops_per_device  # pylint: disable=C0415

  total, weights, attention = train_tflops_per_device(cfg)
  routed, shared = expert_tflops_per_device(cfg)
  dense = weights - routed
  if "mlp" in lay.recompute:  # the dense layers' gated MLP forward again
    dense += 6 * int(cfg.emb_dim) * int(cfg.mlp_dim) * tokens * dense_layers / 1e12
  if "mla_up_proj" in lay.recompute:
    shapes = projection_shapes(cfg)
    dense += sum(2 * n * k for name, (n, k) in shapes.items() if name in ("query_proj", "key_proj", "value_proj")) * (
      tokens * layers / 1e12
    )
  return {"dense": dense * 1e12, "grouped": routed * 1e12, "attention": attention * 1e12}, total, shared


def _params(leaves: list) -> tuple[float, float]:
  """(non-expert, expert) parameter counts."""
  expert = sum(math.prod(s) for p, s, n in leaves if p[0] == "params" and "exp" in [str(x) for x in n])
  every = sum(math.prod(s) for p, s, _ in leaves if p[0] == "params")
  return every - expert, expert


def _ep_kernel_slowdown(gpu: Any, ep: int, domains: int) -> float:
  """How much longer the exchange's NVLink side takes than NVLink's rate gives (>= 1): the rows a GPU sends
  per second inside its domain at NVLink's rate (`model.transfer_seconds`: (g/r - 1)/g of them cross it)
  over HybridEP's measured `ep_kernel_gbs`."""
  local = ep / max(domains, 1)
  if local <= 1:
    return 1.0
  nvlink_rows_gbs = gpu.nvlink_gbs * constant("nvlink_efficiency") * local / (local - 1)
  return max(1.0, nvlink_rows_gbs / constant("ep_kernel_gbs"))


def _transfers(cfg: Any, leaves: list, lay: Layout, gpu: Any, tokens: int, layers: int, moe_layers: int) -> list:
  emb = int(cfg.emb_dim)
  per_domain = gpu.nvlink_domain
  # NVLink domains a group of `group` GPUs spaced `stride` apart spans (never more than its GPUs)
  span = lambda group, stride=1: min(group, max(1, -(-group * stride // per_domain)))  # noqa: E731
  experts, k = int(cfg.num_experts), int(cfg.num_experts_per_tok)
  rows = tokens * unique_ranks(experts, k, lay.ep)
  # Megatron's expert ranks: their own generator, tensor-context-expert-data-pipeline from the fastest, at
  # the expert tensor parallelism 1 Megatron-Bridge's MoE recipes set: an EP group is consecutive GPUs
  domains = span(lay.ep)
  # DeepEP and HybridEP send a token across the network once per destination NVLink domain and forward it
  # to its ranks there over NVLink (DeepEP's README: NVLink-to-RDMA forwarding).
  remote = tokens * unique_ranks(experts, k, domains) * (domains - 1) / domains * emb * 2 * 4 * moe_layers
  wire = rows * emb * 2 * 4 * moe_layers * _ep_kernel_slowdown(gpu, lay.ep, domains)
  out = [Transfer(f"expert dispatch/combine x{lay.ep}", "all-to-all", wire, lay.ep, domains, False,
                  4 * moe_layers * lay.microbatches / lay.pp, network_bytes=remote)]  # fmt: skip
  dense_p, expert_p = _params(leaves)
  stage_dense, stage_expert = dense_p / (lay.pp * lay.tp), expert_p / (lay.pp * lay.ep)
  edp = lay.gpus // (lay.pp * lay.ep)
  dp_span = span(lay.dp, lay.tp)  # Megatron's rank order tp-cp-ep-dp-pp: data-parallel peers tp apart
  if lay.fsdp:
    out.append(Transfer(f"FSDP parameter all-gathers x{lay.dp} (bf16)", "all-gather", 2 * stage_dense * 2, lay.dp,
                        dp_span, True, 2 * layers / lay.pp))  # fmt: skip
    out.append(Transfer(f"FSDP gradient reduce-scatter x{lay.dp} (fp32)", "reduce-scatter", stage_dense * 4, lay.dp,
                        dp_span, True, layers / lay.pp))  # fmt: skip
  else:
    out.append(Transfer(f"gradient reduce-scatter x{lay.dp} (fp32)", "reduce-scatter", stage_dense * 4, lay.dp,
                        dp_span, True))  # fmt: skip
    out.append(Transfer(f"parameter all-gather x{lay.dp} (bf16)", "all-gather", stage_dense * 2, lay.dp, dp_span, True))
  if edp > 1:
    peers = span(edp, lay.ep)  # expert-data peers EP apart
    out.append(Transfer(f"expert gradient reduce-scatter x{edp} (fp32)", "reduce-scatter", stage_expert * 4, edp,
                        peers, True))  # fmt: skip
  if lay.tp > 1:  # sequence parallel: 2 gathers and 2 reduce-scatters per layer, forward and backward
    act = tokens * lay.tp * emb * 2 * layers  # the tp group's tokens through every layer this GPU holds, x pp / pp
    launches = 4 * layers / lay.pp * lay.microbatches
    out.append(Transfer(f"TP all-gathers x{lay.tp}", "all-gather", 4 * act, lay.tp, 1, False, launches))
    out.append(Transfer(f"TP reduce-scatters x{lay.tp}", "reduce-scatter", 4 * act, lay.tp, 1, False, launches))
  if lay.pp > 1:
    per_micro = lay.mbs * lay.seq * emb * 2 / lay.tp
    sends = 2 * lay.vpp * lay.microbatches
    out.append(Transfer("pipeline sends", "p2p", sends * per_micro, 2, 2, True, sends))
  return out


def external_workload(cfg: Any, leaves: list, lay: Layout, gpu: Any, label: str) -> Workload:
  """The `Workload` of one GPU of `lay`; `cfg` is the model's MaxText config at per_device_batch_size =
  gbs / gpus sequences of `lay.seq` (tokens per GPU as if every GPU ran every layer: the same products)."""
  tokens = lay.gbs * lay.seq // lay.gpus
  layers = int(cfg.num_decoder_layers) + int(cfg.mtp_num_layers or 0)
  dense_layers = int(cfg.first_num_dense_layers or 0) if int(cfg.num_experts) > 1 else layers
  moe_layers = layers - dense_layers
  flops, total, shared = _flops(cfg, lay, tokens, layers, dense_layers)
  fmts = dict(zip(("dense", "grouped", "attention"), lay.formats, strict=True))
  k = int(cfg.num_experts_per_tok)
  rows = unique_ranks(int(cfg.num_experts), k, lay.ep)
  moe_b, dense_b = memory_bytes_per_token(cfg, rows, fmts, lay.fused_mlp)
  shapes = gemm_shapes(cfg, lay.mbs * lay.seq, dense_layers, moe_layers)
  shapes["dense"] = [(m, max(n // lay.tp, 1), kk, s) for m, n, kk, s in shapes["dense"] + shapes.pop("head")]
  micro, per_gpu = lay.microbatches, 1 / lay.pp
  kernels = sum(
    sum(launch.kernels_per_layer(cfg, fmts, moe=m).values()) * c for m, c in ((True, moe_layers), (False, dense_layers))
  )
  kernels *= 3 * micro * per_gpu  # forward and backward (2x) of every micro-batch through this GPU's layers
  return Workload(
    label=f"{label}: {lay.describe()} on {lay.gpus} GPUs",
    tokens=tokens,
    model_tflops=total,
    flops=flops,
    formats=fmts,
    memory_bytes=3 * tokens * (moe_b * moe_layers + dense_b * dense_layers),
    transfers=_transfers(cfg, leaves, lay, gpu, tokens, layers, moe_layers),
    hideable_flops=shared * 1e12,
    exchange_beside=1.0 if lay.a2a_overlap else 0.0,
    exchange_sms=constant("ep_kernel_sms"),
    host_syncs=0.0 if lay.graphs else moe_layers * micro * per_gpu,
    pipeline=Pipeline(lay.pp, lay.vpp, micro),
    attention_fwd_flops=flops["attention"] / 3,
    gemm_shapes=shapes,
    kernels=(0.0, kernels) if lay.graphs else (kernels, 0.0),
    imbalance=1.0,
    sources={
      "FLOPs": f"MaxText's count of the same model and tokens ({total:,.0f} TFLOP) + recompute {list(lay.recompute)}",
      "routing imbalance": (BALANCED if lay.balanced else UNMEASURED).source,
    },
  )
