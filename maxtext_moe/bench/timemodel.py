"""`maxtext-moe bench timemodel`: the step-time model against published DeepSeek-V3 training figures, then
used to find the fastest layout of our block on GB300.

Published points whose configuration is known:
- NVIDIA's MaxText + Transformer Engine run (NVIDIA/JAX-Toolbox, docs/frameworks/maxtext/deepseek-v3-moe;
  the "Accelerating Dropless MoE Training in JAX with NVIDIA Transformer Engine" post): 1,068 TFLOP/s per
  GPU on 128 GB300s, our recipe `gb300x128/deepseek3-671b-nvidia`; and its 97% scaling efficiency at 1,024
  GB300s (the same per-GPU config over 16 racks, FSDP 8 and 2 data-parallel replicas across them: the
  article does not give its layout, and FSDP 16 across would not divide MLA's kernels).
- Megatron-Core's DeepSeek-V3 on 256 GB200s (NVIDIA/Megatron-LM, docs/discussions/deepseek-v3-gb200-
  optimization): TP1 / PP8 / VPP4 / EP32, MBS 1, GBS 2,048, sequence 4,096, MXFP8 on every linear layer,
  recompute of the dense layers' MLP, HybridEP: 970 TFLOP/s per GPU. Another framework: modelled with its
  own layout (pipeline stages resident, no FSDP gathers, data-parallel gradients once per step, the
  pipeline's bubble and point-to-point sends), the same FLOP count.

Every ratio is predicted / published; the target is 0.75-1.33. No constant of the model is fitted to these.
The layout search then ranks our block's layouts (EP x FSDP splits, micro-batch, the experts' remat:
recomputed, gated outputs saved or offloaded, full remat; dense GEMMs in bf16 or FP8) on 128 and 1,024
GB300s by predicted TFLOP/s per GPU among those the planner says fit.
"""

import dataclasses
import math
from typing import IO, Any

from maxtext_moe.bench.report import emit

NVIDIA_1068 = 1068.0
NVIDIA_SCALING = 0.97
MEGATRON_GB200 = 970.0
MEGATRON_GB300_BEST = (1635.0, 1670.0)  # Megatron-Bridge's DeepSeek-V3 GB300 MXFP8 figures (force-balanced)

RECIPE = "gb300x128/deepseek3-671b"  # ours: te MXFP8 + te_ep, dropless, the bias update kept
# FSDP 8 x 16 racks would split MLA's 512-wide kernels 1,024 ways (with the expert axis): FSDP 64 x 2
# data-parallel replicas across the racks, as our gb300x1024 recipe does; the article does not say its layout.
NVIDIA_AT_1024 = ["nodes=256", "dcn_fsdp_parallelism=8", "dcn_data_parallelism=2"]


@dataclasses.dataclass(frozen=True)
class Megatron:
  """A Megatron-Core layout: tensor, pipeline (and virtual), expert parallel; micro and global batch."""

  gpus: int
  tp: int
  pp: int
  vpp: int
  ep: int
  mbs: int
  gbs: int
  seq: int
  gpus_per_domain: int


MEGATRON_256_GB200 = Megatron(gpus=256, tp=1, pp=8, vpp=4, ep=32, mbs=1, gbs=2048, seq=4096, gpus_per_domain=64)


def megatron_workload(cfg: Any, leaves: list, m: Megatron) -> Any:
  """The step-time `Workload` of one GPU of a Megatron-Core DeepSeek-V3 layout (see the module docstring);
  `cfg` is the model's MaxText config with per_device_batch_size = gbs x seq / gpus tokens per GPU."""
  from maxtext_moe.planner.step_counts import memory_bytes_per_token  # pylint: disable=import-outside-toplevel
  from maxtext_moe.planner.step_time import Transfer, Workload, unique_ranks  # pylint: disable=import-outside-toplevel
  from maxtext_moe.upstream.compile import (  # pylint: disable=import-outside-toplevel
    expert_tflops_per_device,
    train_tflops_per_device,
  )

  total, weights, attention = train_tflops_per_device(cfg)
  routed, shared = expert_tflops_per_device(cfg)
  tokens = m.gbs * m.seq // m.gpus  # per GPU, as if every GPU ran every layer (same products)
  layers = int(cfg.num_decoder_layers) + int(cfg.mtp_num_layers or 0)
  dense_layers = int(cfg.first_num_dense_layers)
  moe_layers = layers - dense_layers
  recompute_dense = 6 * int(cfg.emb_dim) * int(cfg.mlp_dim) * tokens * dense_layers / 1e12  # recompute mlp
  flops = {
    "dense": (weights - routed + recompute_dense) * 1e12,
    "grouped": routed * 1e12,
    "attention": attention * 1e12,
  }
  emb = int(cfg.emb_dim)
  k, experts = int(cfg.num_experts_per_tok), int(cfg.num_experts)
  rows = tokens * unique_ranks(experts, k, m.ep)
  dp = m.gpus // (m.tp * m.pp)
  stage_params = sum(math.prod(s) for p, s, n in leaves if p[0] == "params" and not any("exp" in str(x) for x in n))
  stage_params /= m.pp * m.tp
  per_microbatch = m.mbs * m.seq * emb * 2
  microbatches = m.gbs // (dp * m.mbs)
  transfers = [
    Transfer(f"expert dispatch/combine x{m.ep}", "all-to-all", rows * emb * 2 * 4 * moe_layers, m.ep, 1, False),
    Transfer(
      f"gradient reduce-scatter x{dp} (fp32)",
      "reduce-scatter",
      stage_params * 4,
      dp,
      -(-dp * m.pp // m.gpus_per_domain),
      True,
    ),
    Transfer(
      f"parameter all-gather x{dp} (bf16)", "all-gather", stage_params * 2, dp, -(-dp * m.pp // m.gpus_per_domain), True
    ),
    Transfer("pipeline sends", "p2p", 2 * m.vpp * microbatches * per_microbatch, 2, 2, True),
  ]
  fmts = {"dense": "mxfp8", "grouped": "mxfp8", "attention": "bf16"}
  moe_bytes, dense_bytes = memory_bytes_per_token(cfg, rows / tokens, fmts)
  memory = 3 * tokens * (moe_bytes * moe_layers + dense_bytes * dense_layers)
  return Workload(
    label=f"Megatron-Core TP{m.tp}/PP{m.pp}/VPP{m.vpp}/EP{m.ep} on {m.gpus} GPUs",
    tokens=tokens,
    model_tflops=total,
    flops=flops,
    formats=fmts,
    memory_bytes=memory,
    transfers=transfers,
    hideable_flops=shared * 1e12,
    pipeline=(m.pp, m.vpp, microbatches),
    sources={"FLOPs": f"MaxText's count of the same model and tokens ({total:,.0f} TFLOP) + the dense MLP recompute"},
  )


def _megatron(m: Megatron) -> Any:
  from maxtext_moe.config.hardware import GPUS  # pylint: disable=import-outside-toplevel
  from maxtext_moe.planner.memory_plan import _context  # pylint: disable=import-outside-toplevel
  from maxtext_moe.planner.step_time import predict  # pylint: disable=import-outside-toplevel

  overrides = [f"per_device_batch_size={m.gbs * m.seq // m.gpus // m.seq}", f"max_target_length={m.seq}"]
  ctx, cfg = _context("gb200-nvl72/deepseek3-671b", overrides, None, None)
  return predict(megatron_workload(cfg, ctx.leaves, m), GPUS["gb200"])


def published() -> list[dict[str, Any]]:
  """Predicted against published, one row per point."""
  from maxtext_moe.planner.step_plan import for_recipe  # pylint: disable=import-outside-toplevel

  nvidia = for_recipe("gb300x128/deepseek3-671b-nvidia", [])
  nvidia_1024 = for_recipe("gb300x128/deepseek3-671b-nvidia", NVIDIA_AT_1024)
  megatron = _megatron(MEGATRON_256_GB200)
  scaling = nvidia_1024.tflops_per_gpu / nvidia.tflops_per_gpu
  rows = [
    ("NVIDIA MaxText+TE, 128 GB300 (TFLOP/s/GPU)", nvidia.tflops_per_gpu, NVIDIA_1068, nvidia),
    ("NVIDIA MaxText+TE, 1,024 vs 128 GB300 (scaling)", scaling, NVIDIA_SCALING, nvidia_1024),
    ("Megatron-Core, 256 GB200 (TFLOP/s/GPU)", megatron.tflops_per_gpu, MEGATRON_GB200, megatron),
  ]
  return [
    {"point": name, "predicted": round(pred, 3), "published": pub, "ratio": round(pred / pub, 3), **p.as_dict()}
    for name, pred, pub, p in rows
  ]


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


def search(devices: int) -> list[dict[str, Any]]:
  """Every layout of `_layouts(devices)` the planner says fits (with the optimizer and parameters on the
  host when it fits only so), fastest first. The parameter tree is traced once: its shapes do not depend
  on the layout."""
  from maxtext_moe.config.layout import mesh_sizes  # pylint: disable=import-outside-toplevel
  from maxtext_moe.errors import UserError  # pylint: disable=import-outside-toplevel
  from maxtext_moe.planner import divisibility  # pylint: disable=import-outside-toplevel
  from maxtext_moe.planner.memory_plan import _context, _estimate  # pylint: disable=import-outside-toplevel
  from maxtext_moe.planner.step_plan import predict_config  # pylint: disable=import-outside-toplevel
  from maxtext_moe.upstream import config as upstream_config  # pylint: disable=import-outside-toplevel

  base, _ = _context(RECIPE, [], None, None)
  rows = []
  for label, overrides in _layouts(devices):
    for offload in ([], ["offload=optimizer_params"]):
      try:
        cfg = upstream_config.resolved(base.path, [*base.base_overrides, *overrides, *offload])
      except UserError:
        break
      ctx = dataclasses.replace(base, num_devices=int(cfg.recipe_num_devices))
      if divisibility.indivisible(ctx.leaves, divisibility.rules_of(cfg), mesh_sizes(cfg, ctx.num_devices)):
        break
      est, _ = _estimate(ctx, cfg, [])
      if not est.fits:
        continue
      p = predict_config(ctx, cfg, label + (", optimizer+params on host" if offload else ""))
      row = {
        "layout": label + (", optimizer+params on host" if offload else ""),
        "overrides": [*overrides, *offload],
        "device_gib": round(est.device_total / 2**30, 1),
      }
      rows.append(row | p.as_dict())
      break  # the cheaper placement that fits
  return sorted(rows, key=lambda r: -r["tflops_per_gpu"])


def _constants() -> dict[str, Any]:
  from maxtext_moe.planner.step_time import CONSTANTS, HOST_LINK_GBS  # pylint: disable=import-outside-toplevel

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

  points = published()
  result: dict[str, Any] = {"published": points}
  table = Table(title="Step-time model vs published DeepSeek-V3 training (predicted / published; target 0.75-1.33)")
  for col in ("point", "predicted", "published", "ratio", "largest exposed costs (s)"):
    table.add_column(col, justify="left" if col in ("point", "largest exposed costs (s)") else "right")
  for r in points:
    exposed = "; ".join(f"{k} {v:.2f}" for k, v in r["exposed_s"])
    table.add_row(r["point"], f"{r['predicted']:,.2f}", f"{r['published']:,.2f}", f"{r['ratio']:.2f}", exposed)
  if not as_json:
    emit(table, result, as_json=False, out=out, width=160)
    emit(_constants_table(), {}, as_json=False, out=out, width=160)
  result["constants"] = {k: {"value": c.value, "source": c.source} for k, c in _constants().items()}
  if not quick:
    for devices in (128, 1024):
      found = search(devices)
      result[f"layouts_gb300x{devices}"] = found
      t = Table(title=f"Our block on {devices} GB300s (te MXFP8 + te_ep, dropless, bias update): fastest that fit")
      for col in ("layout", "GiB/GPU", "TFLOP/s/GPU", "vs 1,068", "vs 1,635", "largest exposed costs (s)"):
        t.add_column(col, justify="left" if col in ("layout", "largest exposed costs (s)") else "right")
      for r in found[:8]:
        exposed = "; ".join(f"{k} {v:.2f}" for k, v in r["exposed_s"])
        t.add_row(
          r["layout"], f"{r['device_gib']:.0f}", f"{r['tflops_per_gpu']:,.0f}",
          f"{r['tflops_per_gpu'] / NVIDIA_1068:.2f}", f"{r['tflops_per_gpu'] / MEGATRON_GB300_BEST[0]:.2f}", exposed,
        )  # fmt: skip
      if not as_json:
        emit(t, {}, as_json=False, out=out, width=160)
  if as_json:
    emit(table, result, as_json=True, out=out, width=160)
  return result
