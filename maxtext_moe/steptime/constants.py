"""The step-time model's constants, each with its source. None was fitted to a figure `bench timemodel`
checks against; GEMM efficiencies by shape are `gemm.py`'s table."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class Constant:
  value: float
  source: str


CONSTANTS: dict[str, Constant] = {
  "gemm_mxfp8_blackwell": Constant(
    2672 / 5000,
    "Megatron-Core, 'Optimizing DeepSeek-V3 Training Performance on NVIDIA GB200 NVL72' (2025-11): an MXFP8 "
    "grouped GEMM at K=7,168, N=2,048 runs at 2,672 TFLOP/s on a GB200 (L2 flushed), of 5,000 dense "
    "(`gemm.py` carries it to other shapes)",
  ),
  "gemm_fp8_hopper": Constant(
    1520 / 1979,
    "DeepGEMM README (deepseek-ai/DeepGEMM 327ec92f, 2025-04): dense FP8 GEMM M=4,096 N=7,168 K=16,384 at "
    "1,520 TFLOP/s on H800, of 1,979 dense (`gemm.py` carries it to other shapes)",
  ),
  "attention_efficiency_blackwell": Constant(
    1613 / 1.3 / 2250,
    "FlashAttention-4 (Dao et al., 2026): 1,613 TFLOP/s BF16 on B200, 1.3x cuDNN 9.13, so cuDNN at about "
    "1,241 of 2,250 dense",
  ),
  "attention_efficiency_hopper": Constant(
    740 / 989, "FlashAttention-3 (Shah et al., 2024): BF16 forward up to 740 TFLOP/s on H100, of 989 dense"
  ),
  "attention_bwd_efficiency_blackwell": Constant(
    1613 / 1.3 / 2250 * 1208.6 / 1418.1,
    "the forward's (above) x FlashAttention-4's backward/forward ratio on B200 (Dao-AILab/flash-attention PR "
    "#2280: causal, head dim 128, sequence 8,192, 2-CTA backward 1,208.6 vs forward 1,418.1 TFLOP/s); a "
    "backward counted as 2.5 forwards (`attention_bwd_flops`)",
  ),
  "attention_bwd_efficiency_hopper": Constant(
    542 / 989,
    "FlashAttention-3 (Shah et al., 2024, Fig. 6): BF16 backward 542 TFLOP/s on H100 at head dim 128, sequence "
    "4,096, of 989 dense; a backward counted as 2.5 forwards",
  ),
  "attention_bwd_flops": Constant(
    2.5,
    "FlashAttention's count of its backward, in forwards (the scores recomputed: 5 matmuls to the forward's 2; "
    "its benchmarks' convention, which the two backward efficiencies above use); MaxText counts 2",
  ),
  "nccl_base_latency_s": Constant(
    8.4e-6,
    "NCCL's tuning model (NVIDIA/nccl v2.30.7-1, src/graph/tuning.cc, baseLat): Ring, Simple protocol, 8.4 us "
    "per collective",
  ),
  "nccl_nvlink_step_s": Constant(
    3.4e-6, "NCCL's tuning model (tuning.cc, hwLat[NVLINK]): Ring, Simple, 3.4 us per ring step over NVLink"
  ),
  "nccl_net_step_s": Constant(
    14.0e-6, "NCCL's tuning model (tuning.cc, hwLat[NET]): Ring, Simple, 14.0 us per ring step over the network"
  ),
  "nccl_ll_base_latency_s": Constant(
    6.6e-6, "NCCL's tuning model (tuning.cc:151, baseLatencies): Ring, LL protocol, 6.6 us per collective"
  ),
  "nccl_ll_tree_base_latency_s": Constant(
    6.8e-6, "NCCL's tuning model (tuning.cc:151, baseLatencies): Tree, LL protocol, 6.8 us per all-reduce"
  ),
  "nccl_ll_nvlink_step_s": Constant(
    0.6e-6, "NCCL's tuning model (tuning.cc:158, hwLatencies[NVLINK]): Ring and Tree, LL, 0.6 us per step"
  ),
  "nccl_ll_net_step_s": Constant(
    2.7e-6, "NCCL's tuning model (tuning.cc:170, hwLatencies[NET]): Ring, LL, 2.7 us per step over the network"
  ),
  "nccl_ll_tree_net_step_s": Constant(
    5.0e-6,
    "NCCL's tuning model (tuning.cc:170, hwLatencies[NET]): Tree, LL, 5.0 us per level over the network (also "
    "a ring's step where the group has one GPU per node: tuning.cc:387)",
  ),
  "nccl_ll_bandwidth": Constant(
    0.5, "NCCL's tuning model (tuning.cc:327): the Ring LL protocol at half the Simple protocol's bus bandwidth"
  ),
  "nccl_ll_tree_bandwidth": Constant(
    1.0 / 3.8, "NCCL's tuning model (tuning.cc:332): the Tree LL protocol at 1/3.8 of the tree's bus bandwidth"
  ),
  "kernel_gap_stream_s": Constant(
    0.9e-6,
    "A. Gray, 'Getting Started with CUDA Graphs' (NVIDIA blog, 2019): back-to-back launches in a stream take "
    "3.8 us per kernel of 2.9 us: 0.9 us each",
  ),
  "kernel_gap_graph_s": Constant(
    0.5e-6, "the same blog: 3.4 us per kernel of 2.9 us when the kernels run as one CUDA graph: 0.5 us each"
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
  "ep_kernel_gbs": Constant(
    (536 + 531) / 2,
    "HybridEP's measured algorithm bandwidth per GPU on B200, EP 8 in one NVLink domain, 16 SMs, through its "
    "Torch API: BF16 dispatch 536 GB/s, combine 531 (deepseek-ai/DeepEP docs/README_Hybrid-EP.md, 17cfb81; "
    "DeepEP itself: 494 and 420 at 24 SMs): what a PyTorch framework's expert exchange reaches on NVLink 5, "
    "short of NVLink's 900 GB/s",
  ),
  "ep_kernel_sms": Constant(
    16,
    "the SMs HybridEP's kernels hold in that measurement (the same README): an exchange run beside the "
    "compute (Megatron's moe_a2a_overlap) takes them from it",
  ),
  "host_sync_s": Constant(
    20e-6, "one kernel launch after the host waited for the stream (CUDA launch latency, order 5-20 us)"
  ),
}

# Of our rounds' expert exchange, the share of its bytes XLA:GPU schedules beside a GEMM, by the tokens'
# chunks (`moe_exchange_chunks`): read off compiled programs (`compile`'s "expert exchange beside a GEMM"),
# not fitted to any time. Two and four chunks: the chained chunks (`moe.rounds`), compiled as a GPU
# schedules them (the scheduler given the allocator's limit, `hardware.target_config(schedules_for=)`),
# 7 December 2026 (four chunks compiled again later that day, MaxText's bias-update all-reduce tied before
# the exchange in `upstream.maxtext.moe_layer`; two chunks not compiled since); one chunk: an earlier
# compile whose scheduler had 80% of the memory (it gave two chunks 11% where the GPU's schedule gave 29%),
# the lower figure kept until it is compiled again.
EXCHANGE_BESIDE = {
  1: Constant(2.08 / 290.0, "compile h100x8/deepseek3-671b at EP 8 x 8 nodes, 1 chunk: 2.08 of 290.0 GiB per step"),
  2: Constant(
    107.15 / 451.23,
    "compile h100x8/deepseek3-671b (EP 8 x 2 nodes, batch 2) moe_exchange_chunks=2: 107.15 of 451.23 GiB per step",
  ),
  4: Constant(
    239.59 / 451.23,
    "compile h100x8/deepseek3-671b (EP 8 x 2 nodes, batch 2), 4 chunks, the bias update's all-reduce before the "
    "exchange: 239.59 of 451.23 GiB per step",
  ),
}
# The same share where the step's forward and backward plan more temporaries than XLA:GPU's scheduler works
# to (`scheduler_room`): the scheduler then orders the step to lower its memory, and the chunks' exchanges
# wait for their GEMMs. Read off the one program compiled so (its planned 63.9 GiB over the scheduler's
# 61.9); `h100x8/deepseek3-671b` compiled for the planner's figure, its temporaries over that limit too, put
# 29.53 of 451.23 GiB per step beside a GEMM (6.5%).
EXCHANGE_BESIDE_OVER_LIMIT = Constant(
  77.48 / 902.45,
  "compile h100x8/deepseek3-671b per_device_batch_size=4 offload=optimizer_params, 4 chunks: 77.48 of 902.45 GiB "
  "per step",
)
HOST_LINK_GBS = {  # one direction, per GPU
  "pcie5": Constant(64.0, "PCIe 5.0 x16: 64 GB/s per direction (PCI-SIG)"),
  "c2c": Constant(
    225.0, "NVLink-C2C: 900 GB/s bidirectional per Grace CPU and its 2 Blackwell GPUs (NVIDIA GB200/GB300 data sheet)"
  ),
  "c2c_one_gpu": Constant(
    450.0, "NVLink-C2C: 900 GB/s bidirectional per Grace CPU and its one GPU (NVIDIA GH200 data sheet)"
  ),
}


def constant(name: str) -> float:
  return CONSTANTS[name].value


def host_link_gbs(gpu) -> float:
  """The host link's bandwidth per GPU and direction, GB/s (the hardware table's `host_link`)."""
  return HOST_LINK_GBS[gpu.host_link].value


def exchange_beside(chunks: int) -> float:
  """`EXCHANGE_BESIDE` at the largest measured chunk count not above `chunks`."""
  return EXCHANGE_BESIDE[max(c for c in EXCHANGE_BESIDE if c <= max(chunks, 1))].value
