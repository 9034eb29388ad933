"""The step-time model's costs beyond FLOPs and bytes (steptime/gemm, latency, launch, imbalance, attention's
backward, the external frameworks' expert exchange), each against its source worked by hand; the sixteen
published points; `plan --time --run RUN_DIR` on a real CPU run's moe_load.jsonl, bad input included."""

import dataclasses
import json
import math

import numpy as np
import pytest

from conftest import run_cli
from maxtext_moe.config.hardware import GPUS
from maxtext_moe.steptime import gemm, imbalance, launch, links
from maxtext_moe.steptime import model as st
from maxtext_moe.steptime.constants import constant
from maxtext_moe.steptime.latency import collective_latency_s


def _rows(arch: str, fmt: str) -> list[list[float]]:
  return json.loads(gemm.TABLE_PATH.read_text())["tflops"][arch][fmt]


@pytest.mark.parametrize("arch,fmt", [("blackwell", "bf16"), ("blackwell", "fp8"), ("hopper", "bf16")])
def test_the_gemm_table_is_reproduced_at_its_points_and_clamped_outside(arch, fmt):
  rows = _rows(arch, fmt)
  assert len(rows) == 125  # 5 x 5 x 5 sizes
  for m, n, k, tflops in rows:
    assert gemm.table_tflops(arch, fmt, m, n, k) == pytest.approx(tflops)
  largest = gemm.table_tflops(arch, fmt, 4096, 4096, 4096)
  assert gemm.table_tflops(arch, fmt, 65536, 16384, 7168) == pytest.approx(largest)
  # between grid points: between the neighbours (log-linear)
  low, high = gemm.table_tflops(arch, fmt, 1024, 2048, 2048), gemm.table_tflops(arch, fmt, 2048, 2048, 2048)
  assert min(low, high) <= gemm.table_tflops(arch, fmt, 1448, 2048, 2048) <= max(low, high)


@pytest.mark.parametrize("gpu", list(GPUS))
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "mxfp8"])
def test_no_gemm_runs_above_its_peak_and_the_anchors_hold(gpu, fmt):
  for m, n, k, _ in _rows("hopper", "bf16"):
    assert 0 < gemm.efficiency(GPUS[gpu], fmt, m, n, k) <= 1
  if fmt == "mxfp8" and gemm.arch(GPUS[gpu]) == "blackwell":  # Megatron's measured MXFP8 grouped GEMM
    assert gemm.efficiency(GPUS[gpu], fmt, *gemm._MX_ANCHOR) == pytest.approx(constant("gemm_mxfp8_blackwell"))
  if fmt == "fp8" and gemm.arch(GPUS[gpu]) == "hopper":  # DeepGEMM's, not XLA's sm_90 FP8 rows (above peak)
    assert gemm.efficiency(GPUS[gpu], fmt, 4096, 7168, 16384) == pytest.approx(constant("gemm_fp8_hopper"))


# DeepGEMM's dense FP8 GEMMs at M 4,096 on H800 (README at 327ec92f): (N, K) -> TFLOP/s
DEEPGEMM_H800 = {
  (7168, 16384): 1520,
  (4096, 7168): 1410,
  (2112, 7168): 1127,
  (7168, 2048): 1168,
  (24576, 1536): 1212,
  (32768, 512): 775,
}


def test_fp8_on_hopper_amortises_a_tile_as_bf16_at_half_the_k():
  """FP8's K loop runs at twice bf16's rate and a tile's fixed cost does not, so Hopper's FP8 efficiency
  follows the bf16 rows at half the K. Against DeepGEMM's own rows (each relative to its best shape): within
  2% where K is small (512, 1,536), never below what DeepGEMM measured, and closer at every row than the
  bf16 rows read at the same K (the model until December 2026)."""
  h100, best = GPUS["h100"], DEEPGEMM_H800[(7168, 16384)]
  top = gemm.efficiency(h100, "fp8", 4096, 7168, 16384)

  def same_k(n: int, k: int) -> float:
    return gemm.table_tflops("hopper", "bf16", 4096, n, k) / gemm.table_tflops("hopper", "bf16", 4096, 7168, 16384)

  for (n, k), tflops in DEEPGEMM_H800.items():
    measured, got = tflops / best, gemm.efficiency(h100, "fp8", 4096, n, k) / top
    assert got >= measured - 0.01, (n, k)
    assert abs(got - measured) <= abs(same_k(n, k) - measured) + 1e-9, (n, k)
    if k <= 1536:
      assert got == pytest.approx(measured, rel=0.02), (n, k)


@pytest.mark.parametrize("arch,fmt", [("blackwell", "bf16"), ("blackwell", "fp8"), ("hopper", "bf16")])
def test_rows_beyond_the_table_widen_the_output_as_its_columns_would(arch, fmt):
  """M beyond 4,096 is folded into N (M x N kept, the table being symmetric in them) before anything is
  clamped: a grouped GEMM of 131,072 rows and 768 columns (Qwen3-30B-A3B's experts at micro-batch 4) fills
  the GPU as a 4,096 x 4,096 output does, not as a 4,096 x 768 one."""
  t = lambda m, n, k: gemm.table_tflops(arch, fmt, m, n, k)  # noqa: E731
  assert t(8192, 512, 2048) == pytest.approx(t(4096, 1024, 2048))
  assert t(512, 8192, 2048) == pytest.approx(t(1024, 4096, 2048))
  assert t(131072, 768, 2048) == pytest.approx(t(4096, 4096, 2048)) == pytest.approx(t(768, 131072, 2048))
  assert t(131072, 768, 2048) > 1.15 * t(4096, 768, 2048)  # what the clamp alone gave
  assert gemm.fold(2048, 512, 4096) == (2048, 512)  # inside the table: untouched


def test_megatron_bridge_expert_exchange_runs_at_hybrideps_measured_throughput():
  """On NVLink 5 the exchange of a PyTorch framework is paced by HybridEP's kernels (533 GB/s of rows per
  GPU at EP 8), not by NVLink's 900 GB/s; on H100's NVLink 4 NVLink is the slower of the two. Run beside
  the compute (moe_a2a_overlap), it takes HybridEP's 16 SMs from it."""
  from maxtext_moe.steptime.external import _ep_kernel_slowdown

  nvlink_rows = 900 * constant("nvlink_efficiency") * 8 / 7  # GB/s of rows at NVLink's rate, EP 8 in a domain
  assert _ep_kernel_slowdown(GPUS["b300"], 8, 1) == pytest.approx(nvlink_rows / 533.5)
  assert _ep_kernel_slowdown(GPUS["gb300"], 32, 1) == pytest.approx(
    900 * constant("nvlink_efficiency") * 32 / 31 / 533.5
  )
  assert _ep_kernel_slowdown(GPUS["h100"], 8, 1) == 1.0 and _ep_kernel_slowdown(GPUS["b200"], 4, 4) == 1.0
  assert constant("ep_kernel_sms") == 16


def test_megatrons_expert_group_is_consecutive_gpus_beside_its_tensor_parallelism():
  """Megatron's expert ranks come from their own generator (tensor-context-expert-data-pipeline from the
  fastest) with Megatron-Bridge's expert tensor parallelism 1: an EP group is consecutive GPUs whatever the
  attention's TP, its expert-data peers EP apart; the dense data-parallel peers stay TP apart."""
  from maxtext_moe.planner.planning import planning
  from maxtext_moe.steptime.external import Layout, _transfers
  from maxtext_moe.steptime.points import POINTS

  points = {p.name.split()[0]: p for p in POINTS}
  nine = points["9"]  # Qwen3-235B on 256 H100s: TP 2, PP 8, EP 32: a stage's 32 GPUs, 4 nodes
  ctx, cfg = planning(nine.recipe, [*nine.overrides, "per_device_batch_size=32", "max_target_length=4096"], None, None)
  by_name = {t.name: t for t in _transfers(cfg, ctx.leaves, nine.layout, GPUS["h100"], 4096, 94, 94)}
  assert by_name["expert dispatch/combine x32"].domains == 4
  assert by_name["gradient reduce-scatter x16 (fp32)"].domains == 4  # 16 data peers 2 apart: 32 GPUs
  # expert-data peers EP apart: EP 8 x 4 replicas on 32 H100s (no stages) span the 4 nodes, EP 8 one
  lay = Layout(32, "h100", ep=8)
  by_name = {t.name: t for t in _transfers(cfg, ctx.leaves, lay, GPUS["h100"], 4096, 94, 94)}
  assert by_name["expert dispatch/combine x8"].domains == 1
  assert by_name["expert gradient reduce-scatter x4 (fp32)"].domains == 4
  lay = Layout(256, "gb300", pp=2, ep=32)  # 4 expert-data peers 32 apart in a stage of 128: 2 racks of 72
  by_name = {t.name: t for t in _transfers(cfg, ctx.leaves, lay, GPUS["gb300"], 4096, 94, 94)}
  assert by_name["expert gradient reduce-scatter x4 (fp32)"].domains == 2


def test_b300_is_blackwell_ultra_at_b200s_dense_peaks():
  """HGX B300 (NVIDIA's HGX page): B200's bf16 and FP8 peaks per GPU, 1.5x its dense NVFP4, 288 GB, NVLink
  5 in a board of 8, an 800 Gb/s NIC per GPU; B200's measured GEMM efficiencies (the table's sm_100)."""
  b300, b200 = GPUS["b300"], GPUS["b200"]
  assert {f: b300.peak_tflops[f] for f in ("bf16", "fp8", "mxfp8")} == {
    f: b200.peak_tflops[f] for f in ("bf16", "fp8", "mxfp8")
  }
  assert b300.peak_tflops["nvfp4"] == 1.5 * b200.peak_tflops["nvfp4"] == 13500
  assert 268 < b300.hbm_gib < 288 and b300.compute_capability == (10, 3) and gemm.arch(b300) == "blackwell"
  assert (b300.gpus_per_node, b300.nvlink_domain, b300.nvlink_gbs, b300.network_gbs) == (8, 8, 900, 100)


def test_a_class_efficiency_is_the_flop_weighted_harmonic_mean():
  gpu = GPUS["b200"]
  a, b = (4096, 4096, 4096), (256, 256, 256)
  ea, eb = gemm.efficiency(gpu, "bf16", *a), gemm.efficiency(gpu, "bf16", *b)
  got = gemm.class_efficiency(gpu, "bf16", [(*a, 3.0), (*b, 1.0)])
  assert got == pytest.approx(4 / (3 / ea + 1 / eb))


def test_the_shipped_gemm_table_is_the_pinned_xlas():
  """xla_matmul.json is what the installed jax-cuda12-plugin carries (scripts/xla_matmul_table.py rewrites it
  after a pin change)."""
  pytest.importorskip("jax_plugins.xla_cuda12")
  import importlib.util
  from pathlib import Path

  script = Path(__file__).resolve().parents[1] / "scripts" / "xla_matmul_table.py"
  spec = importlib.util.spec_from_file_location("xla_matmul_table", script)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  assert json.loads(gemm.TABLE_PATH.read_text()) == module.current()


def test_collective_latency_is_nccls_ring_model():
  us = 1e-6
  assert collective_latency_s("all-reduce", 8, 1) == pytest.approx((8.4 + 14 * 3.4) * us)  # 2 (g - 1) steps
  assert collective_latency_s("all-gather", 8, 1) == pytest.approx((8.4 + 7 * 3.4) * us)
  assert collective_latency_s("reduce-scatter", 16, 2) == pytest.approx((8.4 + 14 * 3.4 + 14.0) * us)  # one crossing
  assert collective_latency_s("all-to-all", 32, 4) == pytest.approx((8.4 + 14.0) * us)
  assert collective_latency_s("all-gather", 1, 1) == 0.0 and collective_latency_s("host", 8, 1) == 0.0


def test_a_small_collective_takes_the_protocol_nccl_predicts_fastest():
  """A large message keeps the Simple protocol's latency; a small one takes LL's (Ring: 6.6 us and 0.6 us a
  step, 2.7 over the network or 5.0 where the group has one GPU per node; an all-reduce's tree: 6.8 us and
  2 x (NVLink steps in a domain + log2 domains network levels at 5.0)), paying for LL's bandwidth (half the
  Simple ring's, 1/3.8 of it for the tree)."""
  us = 1e-6
  simple = collective_latency_s("all-reduce", 256, 32)
  assert simple == pytest.approx((8.4 + (510 - 62) * 3.4 + 62 * 14.0) * us)
  assert collective_latency_s("all-reduce", 256, 32, 1.0) == simple  # a second of bandwidth: Simple
  # MaxText's bias update: about 1 KB over 256 GPUs in 32 nodes, the tree at LL
  assert collective_latency_s("all-reduce", 256, 32, 0.0) == pytest.approx((6.8 + 2 * (7 * 0.6 + 5 * 5.0)) * us)
  assert collective_latency_s("all-gather", 16, 16, 0.0) == pytest.approx((6.6 + 15 * 5.0) * us)
  assert collective_latency_s("all-gather", 8, 1, 0.0) == pytest.approx((6.6 + 7 * 0.6) * us)
  assert collective_latency_s("reduce-scatter", 16, 2, 0.0) == pytest.approx((6.6 + 14 * 0.6 + 2.7) * us)
  # LL's bandwidth counted: 10 us of Simple bandwidth per launch costs the ring LL 10 us more
  ring_ll = (6.6 + 7 * 0.6) * us
  assert collective_latency_s("all-gather", 8, 1, 10 * us) == pytest.approx(
    min(ring_ll + 10 * us, (8.4 + 7 * 3.4) * us)
  )
  assert collective_latency_s("all-to-all", 32, 4, 0.0) == pytest.approx((8.4 + 14.0) * us)  # unchanged
  for kind, g, r in (("all-reduce", 8, 1), ("all-gather", 64, 8), ("reduce-scatter", 16, 16)):
    for bw in (0.0, 1e-5, 1e-3):
      assert collective_latency_s(kind, g, r, bw) <= collective_latency_s(kind, g, r)


def test_launch_gaps_follow_the_command_buffer_flag():
  assert launch.xla_command_types(["--xla_gpu_enable_command_buffer="]) == ()
  assert launch.xla_command_types(["--xla_foo=1"]) == launch.XLA_DEFAULT_COMMAND_TYPES
  types = launch.xla_command_types(["--xla_gpu_enable_command_buffer=", "--xla_gpu_enable_command_buffer=FUSION"])
  assert types == ("FUSION",)
  kernels = {"gemm": 10, "quantize": 4, "attention": 1, "elementwise": 11, "collective": 2}
  assert launch.xla_split(kernels, (), te_gemms=True) == (28, 0)
  # FUSION + CUSTOM_CALL (our Blackwell profile) with TE's GEMMs: only the collectives stay outside
  assert launch.xla_split(kernels, ("FUSION", "CUSTOM_CALL"), te_gemms=True) == (2, 26)
  # XLA's own GEMMs are cuBLAS calls: outside unless CUBLAS is listed
  assert launch.xla_split(kernels, ("FUSION", "CUSTOM_CALL"), te_gemms=False) == (12, 16)
  assert launch.seconds(1000, 1000) == pytest.approx(1000 * 0.9e-6 + 1000 * 0.5e-6)


def test_imbalance_is_the_busiest_ranks_rows_over_the_mean():
  load = np.array([[[4, 0, 2, 2]], [[1, 1, 1, 1]]])  # [steps, layers, experts]
  assert imbalance.factor(load, 2) == pytest.approx(1.0)  # ranks {4, 4} and {2, 2}
  assert imbalance.factor(load, 4) == pytest.approx((4 / 2 + 1) / 2)
  with pytest.raises(Exception, match="do not split over 3 EP ranks"):
    imbalance.factor(load, 3)


def _workload(**kw) -> st.Workload:
  base = {"label": "w", "tokens": 1, "model_tflops": 1.0, "flops": {}, "formats": {}, "memory_bytes": 0.0}
  return st.Workload(**(base | {"transfers": [], "hideable_flops": 0.0} | kw))


def test_nccls_channels_are_its_searchs_for_each_group():
  """The CTAs (one per channel, one SM each) NCCL's topology search and post-processing reach for a large
  collective (`sms.py`): 24 inside 8 H100s and 32 inside a Blackwell domain (NCCL's own logs), one per NIC
  of the group's GPUs in a node across nodes, doubled by the search when 4 or fewer or at 50 GB/s and more
  each, doubled again after; an all-to-all over the p2p channels, the ring's count rounded up to a power of
  2; host copies on the copy engines, none."""
  from maxtext_moe.steptime.sms import ctas

  h100, b200, gb300 = GPUS["h100"], GPUS["b200"], GPUS["gb300"]
  assert [ctas("all-gather", 8, 1, g) for g in (h100, b200, gb300)] == [24, 32, 32]
  # across nodes at 400 Gb/s per GPU: 8 GPUs of a node in the group 16 (NCCL's 2 x 8 H100 log), 1 GPU 4
  assert [ctas("reduce-scatter", n * 16, 16, h100) for n in (1, 2, 4, 8)] == [4, 8, 16, 16]
  assert ctas("all-gather", 128, 16, b200) == 16
  # GB300's 800 Gb/s NICs: 8 channels at 96 GB/s, doubled by the search and after
  assert ctas("all-gather", 256, 4, gb300) == 32
  assert [ctas("all-to-all", n, d, h100) for n, d in ((8, 1), (2, 2), (24, 3))] == [32, 4, 16]
  assert ctas("host", 1, 1, h100) == 0 and ctas("all-gather", 1, 1, h100) == 0


def test_collectives_beside_the_compute_take_its_sms_for_their_time():
  """While a collective runs beside the compute, the compute runs on the SMs its kernel leaves: t x CTAs /
  SMs more compute for t seconds beside it; the part of the stream beyond the compute runs alone, the
  exchange charges only what is hidden, with the workload's own kernels' SMs where it gives them."""
  gpu = GPUS["h100"]
  fsdp = st.Transfer("fsdp", "all-gather", 1e11, 16, 16, True)  # 16 nodes, one GPU each: 4 CTAs
  host = st.Transfer("offload", "host", 1e11, 1, 1, True)
  kw = {"flops": {"dense": 4e15}, "formats": {"dense": "bf16"}}
  p = st.predict(_workload(**kw, transfers=[fsdp, host]), gpu)
  compute = sum(v for k, v in p.parts.items() if "GEMMs (" in k)
  seconds = p.parts["fsdp (overlapped)"]
  assert seconds < compute
  assert dict(p.exposed)["SMs held by collectives beside the compute"] == pytest.approx(seconds * 4 / 132)
  assert p.step_s == pytest.approx(compute + seconds * 4 / 132)
  # a stream longer than the compute: only its part beside the compute holds SMs from it
  slow = st.Transfer("fsdp", "all-gather", 4e12, 16, 16, True)
  p = st.predict(_workload(**kw, transfers=[slow]), gpu)
  assert dict(p.exposed)["SMs held by collectives beside the compute"] == pytest.approx(compute * 4 / 132)
  # the exchange: what the shared experts hide, at NCCL's 32 p2p channels inside a node or the kernels' own
  ep = st.Transfer("ep", "all-to-all", 1e10, 8, 1, False)
  kw = {"flops": {"dense": 4e15}, "transfers": [ep], "hideable_flops": 1e18}
  for own, held in ((0.0, 32), (16.0, 16)):
    p = st.predict(_workload(**kw, exchange_sms=own), gpu)
    hidden = st.transfer_seconds(ep, gpu) + collective_latency_s("all-to-all", 8, 1)
    assert dict(p.exposed)["ep"] == 0.0
    assert dict(p.exposed)["SMs held by collectives beside the compute"] == pytest.approx(hidden * held / 132)
  # nothing beside the compute, nothing held
  p = st.predict(_workload(flops={"dense": 4e15}, transfers=[ep]), gpu)
  assert "SMs held by collectives beside the compute" not in dict(p.exposed)


def test_the_streams_share_the_nic_so_the_step_is_at_least_its_busy_time():
  """The FSDP stream hidden beside the compute and the exchange hidden beside the GEMMs each fit in the
  compute, but both leave through the one NIC: the step is at least the NIC's busy time (every transfer's
  network bytes at its bandwidth), the excess exposed; under it nothing changes."""
  gpu = GPUS["h100"]
  net = gpu.network_gbs * 1e9 * constant("network_efficiency")
  nvlink = gpu.nvlink_gbs * 1e9 * constant("nvlink_efficiency")
  line = "network busy beyond the rest of the step (every transfer on it at its bandwidth)"
  kw = {"flops": {"dense": 1e15}, "formats": {"dense": "bf16"}, "exchange_beside": 1.0}
  compute = st.predict(_workload(**kw), gpu).step_s

  def predict(on_nic: float):  # each stream `on_nic` seconds on the NIC
    fsdp = st.Transfer("fsdp", "all-gather", on_nic * 2 * net, 2, 2, True)  # (r-1)/g of it
    ep = st.Transfer("ep", "all-to-all", on_nic * 2 * net, 2, 2, False)  # (r-1)/r of its rows
    return st.predict(_workload(**kw, transfers=[fsdp, ep]), gpu), fsdp, ep

  p, fsdp, ep = predict(0.75 * compute)
  assert links.seconds(fsdp, gpu) == {
    "network": pytest.approx(0.75 * compute),
    "NVLink": pytest.approx(0.75 * compute * net / nvlink),
  }
  assert links.seconds(ep, gpu) == {"network": pytest.approx(0.75 * compute), "NVLink": 0.0}  # one GPU a domain
  assert dict(p.exposed)["ep"] == 0.0 and "FSDP/gradient collectives beyond the compute" not in dict(p.exposed)
  assert p.step_s == pytest.approx(1.5 * compute)  # the NIC's time, not the compute's
  rest = sum(v for k, v in p.parts.items() if "(overlapped)" not in k and k != f"exposed: {line}")
  assert compute < rest < 1.5 * compute and dict(p.exposed)[line] == pytest.approx(1.5 * compute - rest)
  assert sum(v for k, v in p.parts.items() if "(overlapped)" not in k) == pytest.approx(p.step_s)
  # a third of the bytes: the NIC busy half the compute, under the step, which is as before the links
  p, *_ = predict(0.25 * compute)
  assert line not in dict(p.exposed) and p.step_s > compute
  assert p.step_s == pytest.approx(sum(v for k, v in p.parts.items() if "(overlapped)" not in k))
  # each transfer's time is still the slower of its links
  assert st.transfer_seconds(fsdp, gpu) == pytest.approx(max(links.seconds(fsdp, gpu).values()))
  # what `plan --time` prints under the step: the busier link's floor on tokens/s
  p, *_ = predict(0.75 * compute)
  text = st.format_prediction(dataclasses.replace(p, workload=dataclasses.replace(p.workload, tokens=3000)))
  floor = 3000 / p.busy["network"]
  assert (
    f"  links busy a step: network {p.busy['network']:.3f} s, NVLink {p.busy['NVLink']:.3f} s (every transfer's "
    f"bytes at its bandwidth): however well they overlap, at most {floor:,.0f} tokens/s per GPU (network)"
  ) in text.splitlines()
  assert links.lines({"network": 0.0, "NVLink": 0.0}, 1) == []


def test_attention_backward_runs_at_its_own_efficiency_and_flop_count():
  gpu = GPUS["h100"]
  flops = 3e15  # MaxText's count: forward + 2 forwards of backward
  p = st.predict(_workload(flops={"attention": flops}, attention_fwd_flops=1e15), gpu)
  peak = gpu.peak_tflops["bf16"] * 1e12
  assert p.parts["attention forward (bf16)"] == pytest.approx(1e15 / (peak * constant("attention_efficiency_hopper")))
  bwd = 2e15 * 2.5 / 2 / (peak * constant("attention_bwd_efficiency_hopper"))
  assert p.parts["attention backward (bf16)"] == pytest.approx(bwd)


def test_imbalance_stretches_the_expert_gemms_and_the_exchange():
  gpu = GPUS["gb300"]
  ep = st.Transfer("ep", "all-to-all", 1e11, 8, 1, False, 10)
  kw = {"flops": {"grouped": 1e15}, "formats": {"grouped": "mxfp8"}, "transfers": [ep]}
  even, skewed = st.predict(_workload(**kw), gpu), st.predict(_workload(**kw, imbalance=1.5), gpu)
  grouped = next(v for k, v in even.parts.items() if k.startswith("grouped GEMMs"))
  assert skewed.step_s - even.step_s == pytest.approx(0.5 * (grouped + dict(even.exposed)["ep"]))


@pytest.mark.ci  # kept out of the README suite's 10 minutes; CI runs the ci tier
def test_the_sixteen_published_points_and_their_order():
  from maxtext_moe.steptime.points import POINTS, published

  rows = published()
  assert len(rows) == len(POINTS) == 16
  # the ratios plan --time prints the spread of are the model's own (scripts/published_ratios.py rewrites them)
  from maxtext_moe.steptime import spread

  assert spread.stored() == spread.of(rows), "run scripts/published_ratios.py"
  by = {r["point"].split()[0]: r for r in rows}
  for r in rows:
    assert r["ratio"] == pytest.approx(r["predicted"] / r["published"], rel=1e-2) and r["source"]
    assert len(r["largest_s"]) == 3 and math.isfinite(r["step_s"])
  # the published pairs' order: Megatron-Bridge's GB300 above the GB200 and B200 runs, B200 above H100
  assert by["4"]["predicted"] > max(by["3"]["predicted"], by["5"]["predicted"])
  assert by["6"]["predicted"] > by["7"]["predicted"]
  # B300 above B200 at the same model (its micro-batch 8 to 4); 26.06's features above 26.04.01's on the same
  # B300s; GB300 above B300; the 235B model's GB300 run (26.08) above its B300 one; H100 the slowest
  assert by["11"]["predicted"] > by["6"]["predicted"] and by["12"]["predicted"] > by["11"]["predicted"]
  assert by["13"]["predicted"] > by["12"]["predicted"] and by["15"]["predicted"] > by["14"]["predicted"]
  assert by["16"]["predicted"] < by["6"]["predicted"] / 2
  # the 26.06 features are in the parts: the exchange beside the GEMMs, which run on the SMs HybridEP's
  # kernels leave (16) and the data-parallel collectives' NCCL kernels leave (32 inside the B300s' domain),
  # the fused MLP's activation and quantization gone from the memory-bound bytes, FP8 attention
  parts_11, parts_12 = by["11"]["parts_s"], by["12"]["parts_s"]
  beside = next(k for k in parts_12 if k.startswith("expert exchange beside GEMMs"))
  exchange = next(k for k in parts_11 if k.startswith("exposed: expert dispatch/combine"))
  gemms_12 = sum(v for k, v in parts_12.items() if "GEMMs (" in k)
  assert parts_12[beside] == pytest.approx(min(parts_11[exchange], gemms_12), rel=1e-3)
  data_parallel = sum(v for k, v in parts_12.items() if k.endswith("(overlapped)") and k != beside)
  held = (parts_12[beside] * 16 + data_parallel * 32) / GPUS["b300"].sm_count
  assert parts_12["exposed: SMs held by collectives beside the compute"] == pytest.approx(held, rel=1e-3)
  assert parts_12["memory-bound ops"] < 0.9 * parts_11["memory-bound ops"]
  assert "attention forward (fp8)" in parts_12 and "attention forward (bf16)" in parts_11
  # every point outside the target carries its reason in its row (bench timemodel --json), one sentence,
  # written out in docs/step-time.md; a point inside carries none
  from pathlib import Path

  from maxtext_moe.bench.timemodel import TARGET

  docs = (Path(__file__).resolve().parents[1] / "docs" / "step-time.md").read_text()
  written = docs.split("## Outside the target", 1)[1].split("\n## ", 1)[0]
  outside = {r["point"]: r["reason"] for r in rows if not TARGET[0] <= r["ratio"] <= TARGET[1]}
  assert {p: bool(reason and reason.strip()) for p, reason in outside.items()} == dict.fromkeys(outside, True)
  assert all(f"point {p.split()[0]}:" in written for p in outside), written
  assert [r["point"] for r in rows if r["reason"] is not None] == list(outside)


@pytest.mark.ci
def test_plan_time_reads_a_runs_imbalance(tmp_path):
  """A short CPU train writes moe_load.jsonl; `plan --time --run` at the GPU recipe of the same model (the
  proxy recipe with the tiny model: 16 experts over EP 8) prints the imbalance it measured there."""
  train = ["train", "steps=6", "run_name=imb", "per_device_batch_size=1", "max_target_length=128"]
  r = run_cli([*train, "moe_load_every=1", "progress=plain"], cwd=tmp_path, devices=4)
  assert r.returncode == 0, r.stderr[-3000:]
  run = tmp_path / "runs" / "imb"
  rows = [json.loads(line) for line in (run / "moe_load.jsonl").read_text().splitlines()]
  load = np.array([row["load"] for row in rows[len(rows) // 2 :]], np.float64)
  ranks = load.reshape(*load.shape[:2], 8, 2).sum(-1)  # EP 8: experts 2r, 2r+1 on rank r
  want = float((ranks.max(-1) / ranks.mean(-1)).mean())
  plan = ["plan", "h200x8/deepseek3-proxy-16b", "--time", "--json", "model_name=deepseek3-tiny"]
  plan += ["ici_expert_parallelism=8", "ici_fsdp_parallelism=1"]
  with_run, without = run_cli([*plan, "--run", str(run)], cwd=tmp_path), run_cli(plan, cwd=tmp_path)
  assert with_run.returncode in (0, 1) and without.returncode in (0, 1), with_run.stderr[-2000:]
  timed = json.loads(with_run.stdout.strip().splitlines()[-1])["time"]
  assert timed["sources"]["routing imbalance"].startswith(f"{want:.3f}: measured by {run}")
  line = next(k for k in timed["parts_s"] if k.startswith("exposed: routing imbalance"))
  assert f"{want:.2f}x the mean" in line and want > 1.0
  base = json.loads(without.stdout.strip().splitlines()[-1])["time"]
  assert timed["step_s"] > base["step_s"] and "unmeasured" in base["sources"]["routing imbalance"]
  # bad input: one line, exit 2
  for args, says in [
    ([*plan[:3], "--run", str(run)], None),  # the proxy's own 64 experts: another model
    ([*plan, "--run", str(tmp_path / "nowhere")], "not a directory"),
    ([*plan, "--run", str(tmp_path)], "no moe_load.jsonl"),
    (["plan", "h200x8/deepseek3-proxy-16b", "--run", str(run)], "pass --time with it"),
  ]:
    bad = run_cli(args, cwd=tmp_path)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1, bad.stderr[-2000:]
    assert (says or "routed 16 experts, the recipe has 64") in bad.stderr


def test_a_group_never_spans_more_domains_than_it_has_gpus():
  """NCCL's latency never counts more network steps than ring steps (a 16-GPU group over '32' domains was
  once priced with a negative NVLink term)."""
  assert collective_latency_s("reduce-scatter", 16, 32) == pytest.approx(collective_latency_s("reduce-scatter", 16, 16))
  assert collective_latency_s("reduce-scatter", 16, 16) == pytest.approx((8.4 + 15 * 14.0) * 1e-6)


def test_only_the_expert_exchange_is_hidden_by_the_shared_experts_and_stretched_by_imbalance():
  gpu = GPUS["h100"]
  tp = st.Transfer("tp", "all-gather", 1e10, 2, 1, False, 1)
  ep = st.Transfer("ep", "all-to-all", 1e10, 8, 1, False, 1)
  kw = {"flops": {"dense": 1e14, "grouped": 1e14}, "transfers": [tp, ep], "hideable_flops": 1e18}
  p = st.predict(_workload(**kw, imbalance=2.0), gpu)
  exposed = dict(p.exposed)
  assert exposed["ep"] == 0.0  # hidden whole by the (huge) shared experts
  assert exposed["tp"] == pytest.approx(st.transfer_seconds(tp, gpu) + collective_latency_s("all-gather", 2, 1))
  grouped = next(v for k, v in p.parts.items() if k.startswith("grouped GEMMs"))
  assert exposed["routing imbalance (busiest EP rank 2.00x the mean)"] == pytest.approx(grouped)


def test_a_load_file_of_another_shape_is_one_line(tmp_path):
  (tmp_path / "moe_load.jsonl").write_text('{"step": 1, "loads": []}\n')
  with pytest.raises(Exception, match="is not a maxtext-moe load file"):
    imbalance.from_run(tmp_path, 2, 16)


def test_plan_time_prints_the_spread_of_the_published_ratios_and_the_range_to_plan_on():
  """The lines under `plan --time`: every stored ratio's range and median, then the same GPU generation's,
  and the figure divided by that generation's highest and lowest ratio."""
  import statistics

  from maxtext_moe.steptime import spread

  rows = spread.stored()
  hopper = [r["ratio"] for r in rows if r["arch"] == "hopper"]
  every = [r["ratio"] for r in rows]
  assert len(rows) == 16 and len(hopper) == 5 and {r["arch"] for r in rows} == {"hopper", "blackwell"}
  out = spread.lines(1000.0, "hopper")
  assert out == [
    f"  published runs: the model read {min(every):.2f}-{max(every):.2f}x what 16 of them measured (median "
    f"{statistics.median(every):.2f}; bench timemodel)",
    f"  on Hopper (H100, H200, GH200): {min(hopper):.2f}-{max(hopper):.2f}x over 5 runs (median "
    f"{statistics.median(hopper):.2f}): plan on {1000 / max(hopper):,.0f}-{1000 / min(hopper):,.0f} tokens/s per "
    "GPU, this figure over those ratios",
  ]


def test_custom_remat_counts_the_dense_layers_mlp_and_never_the_down_projection():
  """`remat_policy: custom`: a dense MLP's down projection is never run again (its output is no residual of
  the backward), and mlpwi_0/1 set to remat rerun in DeepSeek's dense layers (18,432 wide) as well as in the
  MoE layers' shared expert."""
  from types import SimpleNamespace

  from maxtext_moe.steptime.counts import recompute_tflops

  cfg = SimpleNamespace(
    remat_policy="custom", emb_dim=7168, num_query_heads=128, moe_mlp_dim=2048, shared_experts=1,
    attention_type="mla", qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, q_lora_rank=1536,
    kv_lora_rank=512, num_experts_per_tok=8, max_target_length=4096, mlp_dim=18432,
  )  # fmt: skip
  tokens, layers, moe_layers = 1000, 61, 58

  def dense(**keys):
    return recompute_tflops(SimpleNamespace(**vars(cfg), **keys), tokens, layers, moe_layers)[0]["dense"]

  assert dense(mlpwo="remat") == 0.0
  shared = 2 * 2048 * 7168 * tokens * moe_layers / 1e12  # one gated projection of the shared expert
  dense_layers = 2 * 18432 * 7168 * tokens * 3 / 1e12
  assert dense(mlpwi_0="remat") == pytest.approx(shared + dense_layers)
  assert dense(mlpwi_0="remat", mlpwi_1="remat", mlpwo="remat") == pytest.approx(2 * (shared + dense_layers))
