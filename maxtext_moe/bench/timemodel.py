"""`maxtext-moe bench timemodel`: the step-time model against sixteen published MoE training runs from 8 to
1,024 GPUs on H100, B200, B300, GB200 and GB300 (`steptime/points.py`: NVIDIA's MaxText + TE DeepSeek-V3
run and its scaling, Megatron-Core, Megatron-Bridge, Megatron-LM and NeMo Automodel runs of DeepSeek-V3
and Qwen3-MoE, each modelled on its own layout by `steptime/external.py`), then used to find the fastest
layout of our block on GB300.

Every ratio is predicted / published; the target is 0.80-1.25, and a point outside carries its reason
(the JSON's "reason", printed under the table; in full in docs/step-time.md). No constant of the model is
fitted to these. The layout search then ranks our block's layouts (EP x FSDP splits, micro-batch, the
experts' remat: recomputed, gated outputs saved or offloaded, full remat; dense GEMMs in bf16 or FP8) on
128 and 1,024 GB300s by predicted TFLOP/s per GPU among those the planner says fit.
"""

import dataclasses
from typing import IO, Any

from maxtext_moe.bench.report import emit

NVIDIA_1068 = 1068.0
MEGATRON_GB300_BEST = (1635.0, 1670.0)  # Megatron-Bridge's DeepSeek-V3 GB300 MXFP8 figures (force-balanced)
TARGET = (0.80, 1.25)

RECIPE = "gb300x128/deepseek3-671b"  # ours: te MXFP8 + te_ep, dropless, the bias update kept


# The experts' three GEMM outputs (our block's remat names) under the custom policy: recomputed in the
# backward (with the exchange they need), the gated pair saved and the down projection recomputed, or the
# gated pair offloaded to host memory; or the whole layer recomputed (full remat).
_EXPERT_REMAT = {
  "experts recomputed": ["moe_mlpwi_0=remat", "moe_mlpwi_1=remat", "moe_mlpwo=remat"],
  "experts' wi saved": ["moe_mlpwi_0=device", "moe_mlpwi_1=device", "moe_mlpwo=remat"],
  "experts' wi offloaded": ["moe_mlpwi_0=offload", "moe_mlpwi_1=offload", "moe_mlpwo=remat"],
  "full": ["remat_policy=full"],
}
_DENSE = {"dense bf16": ["quantization="], "dense FP8": ["quantization=te_fp8_currentscaling"]}


def _layouts(devices: int) -> list[tuple[str, list[str]]]:
  """Our block's layouts on `devices` GB300s: EP x FSDP inside each rack of 64, FSDP (or data) across, the
  micro-batch, the experts' remat and the dense GEMMs' format."""
  racks = devices // 64
  across = [[f"dcn_fsdp_parallelism={racks}", "dcn_data_parallelism=1"]]
  if racks > 2:
    across.append([f"dcn_fsdp_parallelism={racks // 2}", "dcn_data_parallelism=2"])
  base = [f"nodes={devices // 4}"]  # 4 GB300s per node; the racks follow
  out = []
  for ep in (4, 8, 16, 32, 64):
    for dcn in across:
      label = f"EP{ep} x FSDP{64 // ep * int(dcn[0].split('=')[1])}" + (
        " x DP2" if "dcn_data_parallelism=2" in dcn else ""
      )
      layout = [f"ici_expert_parallelism={ep}", f"ici_fsdp_parallelism={64 // ep}", *dcn]
      remats = _EXPERT_REMAT
      if "dcn_data_parallelism=2" in dcn:  # data x fsdp: TE's EP cannot split it (mesh_axes.te_ep_layout_problem)
        label += ", all_to_all bounded, grouped FP8"  # MXFP8 needs te_ep's aligned groups
        layout += ["moe_dispatch=all_to_all", "moe_gemm_quantization=fp8"]
        remats = {k: v for k, v in _EXPERT_REMAT.items() if k in ("experts recomputed", "full")}  # rounds recompute
      for pdbs in (2, 4, 6):
        for remat_name, remat in remats.items():
          for dense_name, dense in _DENSE.items():
            name = f"{label}, batch {pdbs}, {remat_name if remat_name != 'full' else 'remat full'}, {dense_name}"
            out.append((name, [*base, *layout, f"per_device_batch_size={pdbs}", *remat, *dense]))
  return out


def search(devices: int, imbalance: float = 1.0) -> list[dict[str, Any]]:
  """Every layout of `_layouts(devices)` the planner says fits (with the optimizer and parameters on the
  host when it fits only so), fastest first. The parameter tree is traced once: its shapes do not depend
  on the layout."""
  from maxtext_moe.errors import UserError  # pylint: disable=import-outside-toplevel
  from maxtext_moe.moe.layout import mesh_sizes  # pylint: disable=import-outside-toplevel
  from maxtext_moe.planner import divisibility  # pylint: disable=import-outside-toplevel
  from maxtext_moe.planner.planning import estimate_of, planning  # pylint: disable=import-outside-toplevel
  from maxtext_moe.steptime.model import predict  # pylint: disable=import-outside-toplevel
  from maxtext_moe.steptime.recipe import predict_config  # pylint: disable=import-outside-toplevel
  from maxtext_moe.upstream import resolution  # pylint: disable=import-outside-toplevel

  base, _ = planning(RECIPE, [], None, None)
  rows = []
  for label, overrides in _layouts(devices):
    for offload in ([], ["offload=optimizer_params"]):
      try:
        cfg = resolution.resolved(base.path, [*base.base_overrides, *overrides, *offload])
      except UserError:
        break
      ctx = dataclasses.replace(base, num_devices=int(cfg.recipe_num_devices))
      if divisibility.indivisible(ctx.leaves, divisibility.rules_of(cfg), mesh_sizes(cfg, ctx.num_devices)):
        break
      est, _ = estimate_of(ctx, cfg, [])
      if not est.fits:
        continue
      name = label + (", optimizer+params on host" if offload else "")
      p = predict_config(ctx, cfg, name)
      skewed = predict(dataclasses.replace(p.workload, imbalance=imbalance), p.gpu)  # the same work, skewed
      row = {
        "layout": name,
        "overrides": [*overrides, *offload],
        "device_gib": round(est.device_total / 2**30, 1),
        "tflops_per_gpu_at_cpu_imbalance": round(skewed.tflops_per_gpu, 1),
      }
      rows.append(row | p.as_dict())
      break  # the cheaper placement that fits
  return sorted(rows, key=lambda r: -r["tflops_per_gpu"])


# The routing imbalance our CPU runs measure: `maxtext-moe train steps=200 moe_load_every=10` of cpu/deepseek3-tiny
# on 4 CPU devices (16 experts, top-4, the bias update), its second half grouped into 4 EP ranks as
# `plan --time --run` does: 1.374 (EP 2: 1.145, EP 8: 1.605). Four experts per rank: a rank holding 64 of
# DeepSeek-V3's 256 averages over more experts, so this overstates the imbalance at EP 4 (docs/step-time.md).
CPU_RUN_IMBALANCE = 1.374


def node_predictions() -> list[dict[str, Any]]:
  """Every 8-GPU pretraining recipe's predicted tokens/s on one node: what a user checks against the tok/s
  `maxtext-moe train RECIPE` prints on their own node."""
  from maxtext_moe.config.recipes import list_recipes  # pylint: disable=import-outside-toplevel
  from maxtext_moe.steptime.recipe import for_recipe  # pylint: disable=import-outside-toplevel

  rows = []
  for recipe in list_recipes():
    if not recipe.split("/")[0].endswith("x8") or recipe.endswith(("-finetune", "-sft")):
      continue
    p = for_recipe(recipe, [])
    rows.append({"recipe": recipe, "tokens_per_s_per_node": round(8 * p.tokens_per_s_per_gpu), **p.as_dict()})
  return rows


def _constants() -> dict[str, Any]:
  from maxtext_moe.steptime.constants import CONSTANTS, HOST_LINK_GBS  # pylint: disable=import-outside-toplevel

  return CONSTANTS | {f"host_link_gbs_{k}": c for k, c in HOST_LINK_GBS.items()}


def _constants_table() -> Any:
  from rich.table import Table  # pylint: disable=import-outside-toplevel

  table = Table(title="The model's constants (none fitted to the figures above)")
  for col in ("constant", "value", "source"):
    table.add_column(col, justify="right" if col == "value" else "left")
  for name, c in _constants().items():
    table.add_row(name, f"{c.value:.4g}", c.source)
  return table


def run(*, out: IO[str], as_json: bool = False, quick: bool = False) -> dict[str, Any]:
  """The published comparison and (unless quick) the layout search, as tables and one JSON object."""
  from rich.table import Table  # pylint: disable=import-outside-toplevel

  from maxtext_moe.steptime.points import published  # pylint: disable=import-outside-toplevel

  points = published()
  inside = sum(TARGET[0] <= r["ratio"] <= TARGET[1] for r in points)
  result: dict[str, Any] = {"published": points, "target": TARGET, "within_target": inside}
  title = (
    f"Step-time model vs published MoE training (predicted / published; target {TARGET[0]:.2f}-{TARGET[1]:.2f}: "
    f"{inside} of {len(points)} within)"
  )
  reasons = [f"point {r['point'].split()[0]}, outside the target: {r['reason']}" for r in points if r["reason"]]
  table = Table(title=title, caption="\n".join(reasons), caption_justify="left")
  for col in ("point", "predicted", "published", "ratio", "three largest costs (s)"):
    table.add_column(col, justify="left" if col in ("point", "three largest costs (s)") else "right")
  for r in points:
    largest = "; ".join(f"{k} {v:.2f}" for k, v in r["largest_s"])
    table.add_row(r["point"], f"{r['predicted']:,.2f}", f"{r['published']:,.2f}", f"{r['ratio']:.2f}", largest)
  if not as_json:
    emit(table, result, as_json=False, out=out, width=160)
    emit(_constants_table(), {}, as_json=False, out=out, width=160)
  result["constants"] = {k: {"value": c.value, "source": c.source} for k, c in _constants().items()}
  if not quick:
    nodes = node_predictions()
    result["one_node"] = nodes
    t = Table(title="8-GPU recipes on one node: predicted tokens/s (check against 'maxtext-moe train RECIPE')")
    for col in ("recipe", "tokens/s per node", "TFLOP/s/GPU", "step (s)", "largest costs (s)"):
      t.add_column(col, justify="left" if col in ("recipe", "largest costs (s)") else "right")
    for r in nodes:
      largest = "; ".join(f"{k} {v:.2f}" for k, v in r["largest_s"])
      t.add_row(
        r["recipe"], f"{r['tokens_per_s_per_node']:,}", f"{r['tflops_per_gpu']:,.0f}", f"{r['step_s']:.2f}", largest
      )
    if not as_json:
      emit(t, {}, as_json=False, out=out, width=160)
    for devices in (128, 1024):
      found = search(devices, CPU_RUN_IMBALANCE)
      result[f"layouts_gb300x{devices}"] = found
      t = Table(title=f"Our block on {devices} GB300s (te MXFP8 + te_ep, dropless, bias update): fastest that fit")
      at = f"at imbalance {CPU_RUN_IMBALANCE:.2f}"
      for col in ("layout", "GiB/GPU", "TFLOP/s/GPU", at, "vs 1,068", "vs 1,635", "largest exposed costs (s)"):
        t.add_column(col, justify="left" if col in ("layout", "largest exposed costs (s)") else "right")
      for r in found[:8]:
        exposed = "; ".join(f"{k} {v:.2f}" for k, v in r["exposed_s"])
        t.add_row(
          r["layout"], f"{r['device_gib']:.0f}", f"{r['tflops_per_gpu']:,.0f}",
          f"{r['tflops_per_gpu_at_cpu_imbalance']:,.0f}",
          f"{r['tflops_per_gpu'] / NVIDIA_1068:.2f}", f"{r['tflops_per_gpu'] / MEGATRON_GB300_BEST[0]:.2f}", exposed,
        )  # fmt: skip
      if not as_json:
        emit(t, {}, as_json=False, out=out, width=160)
  if as_json:
    emit(table, result, as_json=True, out=out, width=160)
  return result
