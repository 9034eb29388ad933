"""The published training runs `bench timemodel` checks the step-time model against: ten points from 8 to
1,024 GPUs whose layouts are known, each read in its source (the figures as reported, TFLOP/s per GPU
unless said otherwise). Points 3-10 are PyTorch frameworks: they check what the hardware allows under a
known layout (`external.py` models their features), not our stack.

No constant of the model was fitted to these; a point outside 0.80-1.25 carries its reason, the cost the
model cannot see, in one sentence (`Point.reason`, written out in docs/step-time.md, "Outside the target").
"""

import dataclasses
from typing import Any

from maxtext_moe.steptime.external import Layout

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
POINTS = (
  Point("1 DeepSeek-V3, 128 GB300, MaxText + TE", 1068.0,
        "NVIDIA/JAX-Toolbox docs/frameworks/maxtext/deepseek-v3-moe/README.md: FSDP 16 x EP 8, FP8 dense + MXFP8 "
        "grouped, 6 x 4,096 per GPU", "gb300x128/deepseek3-671b-nvidia"),
  Point("2 the same at 1,024 GB300 (scaling)", 0.97, "the same: 97% weak scaling to 1,024 GB300",
        "gb300x128/deepseek3-671b-nvidia", tuple(NVIDIA_AT_1024), scaling_of="1"),
  Point("3 DeepSeek-V3, 256 GB200, Megatron-Core", 970.0,
        "NVIDIA/Megatron-LM docs/discussions/deepseek-v3-gb200-optimization: TP1 PP8 VPP4 EP32, MXFP8, MBS 1, "
        "GBS 2,048, recompute of the dense MLP, HybridEP, no MTP", _DSV3, _NO_MTP,
        Layout(256, "gb200", pp=8, vpp=4, ep=32, gbs=2048, formats=("mxfp8", "mxfp8", "bf16"), recompute=("mlp",)),
        reason="host overhead: Megatron-Core's routed experts are host-bound (a device-to-host sync per MoE layer "
        "costs 10% or more, by its own guide) and HybridEP's kernels take SMs from the GEMMs; the model prices "
        "only the GPU's side of launches"),
  Point("4 DeepSeek-V3, 256 GB300, Megatron-Bridge 26.08", 1635.0,
        "NVIDIA-NeMo/Megatron-Bridge docs/performance-summary.md (26.08): TP1 PP2 VPP8 EP32, MXFP8, MBS 1, GBS "
        "4,096, no recompute, full-iteration CUDA graph, HybridEP, FP8 attention, MTP, force-balanced", _DSV3,
        (), Layout(256, "gb300", pp=2, vpp=8, ep=32, gbs=4096, formats=("mxfp8", "mxfp8", "fp8"),
                                      graphs=True, balanced=True)),
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
        reason="point 7's model at micro-batch 1 (assumed; not published): the shortest kernels of the ten, so "
        "the host's per-kernel cost weighs most (point 6, the same model at micro-batch 4, is inside)"),
  Point("9 Qwen3-235B-A22B, 256 H100, Megatron-Bridge 26.04.01", 253.0,
        "Megatron-Bridge docs/performance-summary.md (26.04.01): TP2 PP8 VPP4 EP32, FP8, GBS 8,192", _QWEN,
        ("model_name=qwen3-235b-a22b",),
        Layout(256, "h100", tp=2, pp=8, vpp=4, ep=32, gbs=8192, formats=("fp8", "fp8", "bf16"))),
  Point("10 DeepSeek-V3, 256 H100, NeMo Automodel", 250.0,
        "NeMo Automodel docs/performance-summary.md: PP4 VPP8 EP64 FSDP64, bf16, GBS 512", _DSV3,
        _NO_MTP, Layout(256, "h100", pp=4, vpp=8, ep=64, fsdp=True, gbs=512),
        reason="DeepEP's kernels run on SMs the GEMMs then lack (24 of the H100's 132 in DeepEP's README) and "
        "NeMo Automodel runs FSDP2 eagerly; the model sees neither"),
)  # fmt: skip


def predict_point(point: Point) -> Any:
  """The model's `Prediction` of `point`."""
  from maxtext_moe.config.hardware import GPUS  # pylint: disable=import-outside-toplevel
  from maxtext_moe.planner.memory_plan import _context  # pylint: disable=import-outside-toplevel
  from maxtext_moe.steptime.external import external_workload  # pylint: disable=import-outside-toplevel
  from maxtext_moe.steptime.model import predict  # pylint: disable=import-outside-toplevel
  from maxtext_moe.steptime.recipe import for_recipe  # pylint: disable=import-outside-toplevel

  if point.layout is None:
    return for_recipe(point.recipe, list(point.overrides))
  lay = point.layout
  batch = [f"per_device_batch_size={lay.gbs / lay.gpus:g}", f"max_target_length={lay.seq}"]
  ctx, cfg = _context(point.recipe, [*point.overrides, *batch], None, None)
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
    rows.append(row | p.as_dict())
  return rows
