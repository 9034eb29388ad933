"""The published training runs `bench timemodel` checks the step-time model against: sixteen points from 8
to 1,024 GPUs whose layouts are known, each read in its source (the figures as reported, TFLOP/s per GPU
unless said otherwise). Points 3-16 are PyTorch frameworks: they check what the hardware allows under a
known layout (`external.py` models their features), not our stack.

Megatron-Bridge's figures (docs/performance-summary.md and docs/performance-summary-archive.md of
NVIDIA-NeMo/Megatron-Bridge, one section per NeMo container) come with their layouts; the features each
row ran with are read in the recipe of that container's commit: scripts/performance/configs/qwen/
qwen3_workload_base_configs.py for 26.04.01 (commit 21d102f5e) and 26.06 (8f341b04f), src/megatron/
bridge/perf_recipes/<family>/<gpu>/ for 26.08 (4ab94dfad).

No constant of the model was fitted to these; a point outside 0.80-1.25 carries its reason, the cost the
model cannot see, in one sentence (`Point.reason`, written out in docs/step-time.md, "Outside the target").
"""

import dataclasses
from typing import Any

from maxtext_moe.steptime.external import Layout
from maxtext_moe.steptime.gemm import arch

# The 1,024-GPU run's layout is not published: FSDP 8 x 16 racks would split MLA's 512-wide kernels 1,024
# ways with the expert axis, so FSDP 64 x 2 data-parallel replicas across the racks, as our gb300x1024 does.
NVIDIA_AT_1024 = ["nodes=256", "dcn_fsdp_parallelism=8", "dcn_data_parallelism=2"]


@dataclasses.dataclass(frozen=True)
class Point:
  name: str
  reported: float
  source: str
  recipe: str  # the model's recipe (its MaxText config and parameter tree)
  overrides: tuple[str, ...] = ()
  layout: Layout | None = None  # None: our recipe itself (MaxText)
  scaling_of: str = ""  # a ratio to another point's TFLOP/s per GPU
  reason: str = ""  # why the model misses it, for a point outside the target (empty inside)


_DSV3 = "gb200-nvl72/deepseek3-671b"
_NO_MTP = ("override_model_config=true", "mtp_num_layers=0")
_QWEN = "h100x8/qwen3-30b-a3b"
_QWEN_235B = ("model_name=qwen3-235b-a22b",)
_MX = ("mxfp8", "mxfp8", "bf16")
# Megatron-Bridge's MXFP8 recipes from 26.06 on (`_enable_hybridep_full_iteration_mxfp8`): the whole
# iteration one CUDA graph, the expert exchange beside another micro-batch's compute, TE's fused grouped
# MLP (NVTE_CUTEDSL_FUSED_GROUPED_MLP=1) and FP8 attention.
_FULL = {"formats": ("mxfp8", "mxfp8", "fp8"), "graphs": True, "a2a_overlap": True, "fused_mlp": True}
POINTS = (
  Point("1 DeepSeek-V3, 128 GB300, MaxText + TE", 1068.0,
        "NVIDIA/JAX-Toolbox docs/frameworks/maxtext/deepseek-v3-moe/README.md: FSDP 16 x EP 8, FP8 dense + MXFP8 "
        "grouped, 6 x 4,096 per GPU", "gb300x128/deepseek3-671b-nvidia"),
  Point("2 the same at 1,024 GB300 (scaling)", 0.97, "the same: 97% weak scaling to 1,024 GB300",
        "gb300x128/deepseek3-671b-nvidia", tuple(NVIDIA_AT_1024), scaling_of="1"),
  Point("3 DeepSeek-V3, 256 GB200, Megatron-Core", 970.0,
        "NVIDIA/Megatron-LM docs/discussions/deepseek-v3-gb200-optimization: TP1 PP8 VPP4 EP32, MXFP8, MBS 1, "
        "GBS 2,048, recompute of the dense MLP, HybridEP, no MTP", _DSV3, _NO_MTP,
        Layout(256, "gb200", pp=8, vpp=4, ep=32, gbs=2048, formats=("mxfp8", "mxfp8", "bf16"), recompute=("mlp",))),
  Point("4 DeepSeek-V3, 256 GB300, Megatron-Bridge 26.08", 1635.0,
        "NVIDIA-NeMo/Megatron-Bridge docs/performance-summary.md (26.08): TP1 PP2 VPP8 EP32, MXFP8, MBS 1, GBS "
        "4,096, no recompute, full-iteration CUDA graph, HybridEP, FP8 attention, MTP, force-balanced; "
        "perf_recipes/deepseek/gb300/deepseek_v3.py (4ab94dfad): overlap_moe_expert_parallel_comm and the "
        "fused grouped MLP too", _DSV3, (),
        Layout(256, "gb300", pp=2, vpp=8, ep=32, gbs=4096, balanced=True, **_FULL)),
  Point("5 DeepSeek-V3, 256 B200, Megatron-Bridge 26.04.01", 864.0,
        "Megatron-Bridge docs/performance-summary.md (26.04.01): TP1 PP8 VPP2 EP32, MXFP8, GBS 4,096, recompute "
        "mla_up_proj + mlp, DeepEP, force-balanced", _DSV3, (),
        Layout(256, "b200", pp=8, vpp=2, ep=32, gbs=4096, formats=("mxfp8", "mxfp8", "bf16"),
               recompute=("mla_up_proj", "mlp"), balanced=True)),
  Point("6 Qwen3-30B-A3B, 8 B200, Megatron-Bridge 26.04.01", 619.0,
        "Megatron-Bridge docs/performance-summary.md (26.04.01): EP 8, MXFP8, seq 4,096, MBS 4, GBS 512, no "
        "recompute, HybridEP, force-balanced", _QWEN, (),
        Layout(8, "b200", ep=8, mbs=4, gbs=512, formats=("mxfp8", "mxfp8", "bf16"), balanced=True)),
  Point("7 Qwen3-30B-A3B, 8 H100, NeMo Automodel", 277.0,
        "NVIDIA-NeMo/Automodel docs/performance-summary.md: EP 8 x FSDP 8, bf16, seq 4,096, MBS 4, GBS 512, TE + "
        "DeepEP, balanced gate (21.77 s per step)", _QWEN, (),
        Layout(8, "h100", ep=8, fsdp=True, mbs=4, gbs=512, balanced=True),
        reason="host overhead with short kernels: Qwen3-30B-A3B activates 3B parameters, so PyTorch's per-op cost "
        "(about 2 us in the dispatcher) weighs on every kernel, and FSDP2 runs eagerly, without a CUDA graph"),
  Point("8 Qwen3-30B-A3B, 32 H100, Megatron-LM", 234.0,
        "NVIDIA/Megatron-LM examples/moe_recipes/README.md: EP 8 inside a node, bf16, seq 4,096, GBS 256 (MBS 1 "
        "assumed: not given)", _QWEN, (), Layout(32, "h100", ep=8, gbs=256),
        reason="point 7's model at micro-batch 1 (assumed; not published): the shortest kernels of the H100 runs, so "
        "the host's per-kernel cost weighs most (point 6, the same model at micro-batch 4, is inside)"),
  Point("9 Qwen3-235B-A22B, 256 H100, Megatron-Bridge 26.04.01", 253.0,
        "Megatron-Bridge docs/performance-summary.md (26.04.01): TP2 PP8 VPP4 EP32, FP8, GBS 8,192; "
        "QWEN3_235B_A22B_PRETRAIN_CONFIG_H100_FP8_CS_V2 (21d102f5e): moe_a2a_overlap, no CUDA graph", _QWEN,
        _QWEN_235B,
        Layout(256, "h100", tp=2, pp=8, vpp=4, ep=32, gbs=8192, formats=("fp8", "fp8", "bf16"), a2a_overlap=True),
        reason="the model credits moe_a2a_overlap with hiding the exchange beside the GEMMs, but it splits every "
        "layer into stages the host schedules, and this recipe runs without a CUDA graph: Megatron's GB200 guide "
        "measured that overlap's benefit negative while the host was the bottleneck"),
  Point("10 DeepSeek-V3, 256 H100, NeMo Automodel", 250.0,
        "NeMo Automodel docs/performance-summary.md: PP4 VPP8 EP64 FSDP64, bf16, GBS 512", _DSV3,
        _NO_MTP, Layout(256, "h100", pp=4, vpp=8, ep=64, fsdp=True, gbs=512),
        reason="DeepEP's kernels run on SMs the GEMMs then lack (24 of the H100's 132 in DeepEP's README) and "
        "NeMo Automodel runs FSDP2 eagerly; the model sees neither"),
  Point("11 Qwen3-30B-A3B, 8 B300, Megatron-Bridge 26.04.01", 704.0,
        "Megatron-Bridge docs/performance-summary-archive.md (26.04.01): EP 8, MXFP8, seq 4,096, MBS 8, GBS 512; "
        "QWEN3_30B_A3B_PRETRAIN_CONFIG_B300_FP8_MX_V1 (21d102f5e): HybridEP, CUDA graphs of the router and "
        "its preprocessing only, no recompute, force-balanced", _QWEN, (),
        Layout(8, "b300", ep=8, mbs=8, gbs=512, formats=_MX, balanced=True)),
  Point("12 Qwen3-30B-A3B, 8 B300, Megatron-Bridge 26.06", 938.0,
        "Megatron-Bridge docs/performance-summary-archive.md (26.06): EP 8, MXFP8, seq 4,096, MBS 8, GBS 512; "
        "QWEN3_30B_A3B_PRETRAIN_CONFIG_B300_FP8_MX_V1 (8f341b04f): point 11 with a full-iteration CUDA graph, "
        "moe_a2a_overlap, the fused grouped MLP and FP8 attention", _QWEN, (),
        Layout(8, "b300", ep=8, mbs=8, gbs=512, balanced=True, **_FULL),
        reason="the full-iteration CUDA graph needs static buffers: the experts' activations for the backward go "
        "through paged stash buffers (moe_paged_stash) and HybridEP dispatches into buffers of 1.5x the mean "
        "rows, copies the model does not count (point 13, the same recipe on GB300, is inside at 1.22)"),
  Point("13 Qwen3-30B-A3B, 8 GB300, Megatron-Bridge 26.08", 1029.0,
        "Megatron-Bridge docs/performance-summary.md (26.08): EP 8, MXFP8, seq 4,096, MBS 8, GBS 512; "
        "perf_recipes/qwen/gb300/qwen3_moe.py (4ab94dfad): as point 12", _QWEN, (),
        Layout(8, "gb300", ep=8, mbs=8, gbs=512, balanced=True, **_FULL)),
  Point("14 Qwen3-235B-A22B, 256 B300, Megatron-Bridge 26.04.01", 878.0,
        "Megatron-Bridge docs/performance-summary-archive.md (26.04.01): PP8 EP8, MXFP8, MBS 2, GBS 8,192; "
        "QWEN3_235B_A22B_PRETRAIN_CONFIG_B300_FP8_MX_V2 (21d102f5e): HybridEP, no CUDA graph, no "
        "moe_a2a_overlap, no recompute, force-balanced", _QWEN, _QWEN_235B,
        Layout(256, "b300", pp=8, ep=8, mbs=2, gbs=8192, formats=_MX, balanced=True)),
  Point("15 Qwen3-235B-A22B, 256 GB300, Megatron-Bridge 26.08", 1306.0,
        "Megatron-Bridge docs/performance-summary.md (26.08): PP4 VPP12 EP32, MXFP8, MBS 2, GBS 8,192; "
        "perf_recipes/qwen/gb300/qwen3_moe.py (4ab94dfad): the 26.06 features of point 12", _QWEN, _QWEN_235B,
        Layout(256, "gb300", pp=4, vpp=12, ep=32, mbs=2, gbs=8192, balanced=True, **_FULL)),
  Point("16 Qwen3-30B-A3B, 16 H100, Megatron-Bridge 26.04.01", 206.0,
        "Megatron-Bridge docs/performance-summary-archive.md (26.04.01): EP 16, FP8 current scaling, seq "
        "4,096, MBS 1, GBS 1,024; QWEN3_30B_A3B_PRETRAIN_CONFIG_H100_FP8_CS_V1 (21d102f5e): HybridEP, no CUDA "
        "graph, no moe_a2a_overlap, force-balanced", _QWEN, (),
        Layout(16, "h100", ep=16, gbs=1024, formats=("fp8", "fp8", "bf16"), balanced=True),
        reason="host overhead at its worst: no CUDA graph, a device-to-host sync per MoE layer and micro-batch, "
        "and 4,096-token micro-batches of a 3B-active model, so the host's per-kernel cost (CPU overhead halved "
        "Megatron's first GB200 DeepSeek-V3 run, by its guide) sets the pace, not the GPU"),
)  # fmt: skip


def predict_point(point: Point) -> Any:
  """The model's `Prediction` of `point`."""
  from maxtext_moe.config.hardware import GPUS  # pylint: disable=import-outside-toplevel
  from maxtext_moe.planner.planning import planning  # pylint: disable=import-outside-toplevel
  from maxtext_moe.steptime.external import external_workload  # pylint: disable=import-outside-toplevel
  from maxtext_moe.steptime.model import predict  # pylint: disable=import-outside-toplevel
  from maxtext_moe.steptime.recipe import for_recipe  # pylint: disable=import-outside-toplevel

  if point.layout is None:
    return for_recipe(point.recipe, list(point.overrides))
  lay = point.layout
  batch = [f"per_device_batch_size={lay.gbs / lay.gpus:g}", f"max_target_length={lay.seq}"]
  ctx, cfg = planning(point.recipe, [*point.overrides, *batch], None, None)
  gpu = GPUS[lay.gpu]
  return predict(external_workload(cfg, ctx.leaves, lay, gpu, point.name.split(",")[0]), gpu)


def published() -> list[dict[str, Any]]:
  """One row per point (`bench timemodel --json`'s "published"): predicted, reported, their ratio, the
  source, "reason" (why the model misses a point outside 0.80-1.25, one sentence; null for a point inside)
  and the prediction's parts."""
  rows, by_number = [], {}
  for point in POINTS:
    p = predict_point(point)
    number = point.name.split()[0]
    by_number[number] = p
    predicted = p.tflops_per_gpu / by_number[point.scaling_of].tflops_per_gpu if point.scaling_of else p.tflops_per_gpu
    row = {"point": point.name, "predicted": round(predicted, 3), "published": point.reported}
    row |= {"ratio": round(predicted / point.reported, 3), "source": point.source, "reason": point.reason or None}
    row["arch"] = arch(p.gpu)
    rows.append(row | p.as_dict())
  return rows
