"""The memory plan of a recipe: will it fit, what does it cost, and what is the cheapest change that fits.

`memory_plan(recipe, overrides, gpus=..., gpu_mem_gib=...)` estimates one device (`estimate.py`), and when
the recipe does not fit tries changes cheapest first (`_candidates`): offload presets, EP/FSDP splits of
the same devices, smaller micro-batches. MaxText's own FLOPs count gives FLOPs per token.
"""

import dataclasses
import math
from collections.abc import Iterable
from typing import Any

from maxtext_moe.config import hardware, offload
from maxtext_moe.config.hardware import Hardware
from maxtext_moe.config.nodes import global_batch
from maxtext_moe.config.offload import OffloadPreset
from maxtext_moe.errors import UserError
from maxtext_moe.moe.layout import mesh_sizes
from maxtext_moe.planner import divisibility, loss_phase
from maxtext_moe.planner.estimate import EDGE, GIB, Estimate
from maxtext_moe.planner.planning import Planning, estimate_of, planning, resolved


def _gib(n: int | None) -> str:
  return "-" if n is None else f"{n / GIB:,.1f}"


@dataclasses.dataclass
class MemoryPlan:
  """A recipe's estimate and, when it does not fit, the cheapest fix found."""

  recipe: str
  hardware: Hardware
  num_devices: int
  nodes: int
  global_batch: int  # sequences per step over the whole job (per_device_batch_size x devices)
  seq_len: int
  dispatch: str
  layout: dict[str, int]
  mfu: float
  base: Estimate
  fix: Estimate | None
  fix_kind: str | None
  tried: int

  @property
  def tokens_per_device(self) -> float:
    """Tokens per device and step, every gradient-accumulation micro-batch (MaxText's TFLOPs count's)."""
    return self.global_batch * self.seq_len / max(self.num_devices, 1)

  @property
  def peak_tflops(self) -> float | None:
    gpu = hardware.gpu(self.hardware)
    return gpu.peak_tflops["bf16"] if gpu else None

  def table(self, predicted: Any = None) -> str:
    """A readable report: layout, memory per device by component, verdict, fix, throughput (`_throughput`:
    two tokens/s figures side by side would read as two predictions)."""
    e = self.base
    layout = " x ".join(f"{a}={n}" for a, n in self.layout.items() if n > 1) or "1 device"
    where = f"{self.nodes} node(s), {self.num_devices} x {self.hardware.value}"
    lines = [
      f"{self.recipe}: {where}, {layout}, MoE dispatch {self.dispatch}",
      f"  global batch: {self.global_batch:,} sequences x {self.seq_len:,} = "
      f"{self.global_batch * self.seq_len:,} tokens per step",
      f"  tokens per device per step: {e.tokens_per_step:,}; MoE rows per device: {e.moe_rows:,}",
      *e.schedule_rows(),
      "",
      f"  {'per device':<44}{'GiB':>10}",
      f"  {'parameters' + (' (from the host, for the step)' if e.params_from_host else ''):<44}{_gib(e.params):>10}",
      f"  {'optimizer state (Adam mu, nu)':<44}{_gib(e.optimizer):>10}",
      f"  {'gradients':<44}{_gib(e.grads):>10}",
      f"  {'scanned weights re-laid out for backward':<44}{_gib(e.scan_copy):>10}",
      *([f"  {'  and the stage weights, re-laid out':<44}{_gib(e.stage_copy):>10}"] if e.stages > 1 else []),
      f"  {'saved activations (remat policy)':<44}{_gib(e.saved_activations):>10}",
      *([f"  {'  of which the pipeline loop keeps':<44}{_gib(e.pipeline_saved):>10}"] if e.stages > 1 else []),
      f"  {'loss phase: logits and their gradient':<44}{_gib(e.logits_phase):>10}",
      f"  {'layer phase: MoE dispatch buffers':<44}{_gib(e.moe_dispatch):>10}",
      f"  {'layer phase: attention':<44}{_gib(e.attention):>10}",
      f"  {'layer phase: layer weights and gradients':<44}{_gib(e.layer_weights):>10}",
      f"  {'layer phase: residual-stream temporaries':<44}{_gib(e.layer_activations):>10}",
      *([f"  {'layer phase: FP8 copies (dense GEMMs)':<44}{_gib(e.fp8_copies):>10}"] if e.fp8_copies else []),
      *([f"  {'layer phase: pipeline loop buffers':<44}{_gib(e.pipeline_buffers):>10}"] if e.stages > 1 else []),
      *(
        [f"  {'layer phase: the iteration stage weights':<44}{_gib(e.pipeline_iteration):>10}"] if e.stages > 1 else []
      ),
      *e.phase_rows(),
      f"  {'total on device (peak)':<44}{_gib(e.device_total):>10}",
      f"  {'usable HBM':<44}{_gib(e.hbm):>10}",
      f"  {'host memory (offloaded)':<44}{_gib(e.host):>10}",
      f"  {'host memory per GPU':<44}{_gib(e.host_capacity):>10}",
      "",
    ]
    flops_token = e.tflops_per_step * 1e12 / max(self.tokens_per_device, 1)
    lines.append(f"  training FLOPs per token: {flops_token / 1e9:,.2f} GFLOP (MaxText's count, 6N + attention)")
    lines += self._throughput(predicted)
    lines.append("")
    if e.hbm is None:
      lines.append("  verdict: no device memory limit on this hardware (pass --gpu-mem GiB to check one)")
    elif e.fits:
      lines.append(f"  verdict: FITS ({_gib(e.hbm - e.device_total)} GiB to spare on device{_edge(e)})")
    else:
      where = "device" if e.device_total > (e.hbm or 0) else "host"
      lines.append(f"  verdict: DOES NOT FIT ({where} memory)")
      if self.fix is not None:
        lines.append(
          f"  cheapest fix ({self.fix_kind}): {self.fix_words()} -> "
          f"{_gib(self.fix.device_total)} GiB on device, {_gib(self.fix.host)} GiB on host"
        )
      else:
        lines.append(f"  no offload preset, EP/FSDP split or smaller micro-batch makes it fit ({self.tried} tried)")
    return "\n".join(lines)

  def fix_words(self) -> str:
    """The cheapest fix as a user types it: key=value overrides, and more nodes as --nodes N."""
    words = [f"--nodes {o.split('=', 1)[1]}" if o.startswith("nodes=") else o for o in self.fix.overrides]
    return " ".join(words)

  def _throughput(self, predicted: Any) -> list[str]:
    """The step-time model's `predicted` tokens/s named as the prediction, else the assumed --mfu's what-if."""
    if predicted is not None:
      return [
        f"  throughput: the step-time model's prediction below, {predicted.tokens_per_s_per_gpu:,.0f} tokens/s per "
        f"GPU at {predicted.mfu:.1%} MFU (the fixed --mfu what-if is left out with --time)"
      ]
    if not self.peak_tflops:
      return []
    achieved = self.mfu * self.peak_tflops
    step = self.base.tflops_per_step / achieved
    return [
      f"  at an assumed {self.mfu:.0%} MFU (--mfu; not a prediction: plan --time models it) of "
      f"{self.peak_tflops:,.0f} dense bf16 TFLOP/s: {achieved:,.0f} TFLOP/s per GPU, "
      f"{step:.2f} s per step, {self.tokens_per_device / step:,.0f} tokens/s per GPU"
    ]

  def as_dict(self) -> dict:
    return {
      "recipe": self.recipe,
      "num_devices": self.num_devices,
      "nodes": self.nodes,
      "global_batch": self.global_batch,
      "tokens_per_step": self.global_batch * self.seq_len,
      "dispatch": self.dispatch,
      "layout": self.layout,
      "fits": self.base.fits,
      "estimate": dataclasses.asdict(self.base),
      "fix": None if self.fix is None else {"kind": self.fix_kind, "overrides": self.fix.overrides},
    }


def _candidates(cfg: Any, ctx: Planning) -> Iterable[tuple[str, list[str]]]:
  """Changes in the order we consider them cheapest, each one the recipe can take (a recipe that loads weights
  is never offered the presets that move the layer axis, `offload.takes`): offload presets, then EP/FSDP
  splits of the same devices (each axis kept within its ICI/DCN side), the forward recomputed (full remat
  for a custom policy), smaller micro-batches, then more nodes. First of all the loss untiled, where it is
  tiled: across nodes MaxText's vocab tiling gathers the whole batch's hidden states on each device
  (`loss_phase`)."""
  if loss_phase.tiles(cfg) > 1:
    yield "the loss untiled", ["num_vocab_tiling=1"]
  current = [p.value for p in OffloadPreset]
  start = current.index(cfg.offload.value) + 1 if cfg.offload else 0
  for preset in current[start:]:
    if offload.takes(preset, loads_weights=ctx.loads_weights):
      yield "offload preset", [f"offload={preset}"]
  ep, fsdp = int(cfg.ici_expert_parallelism), int(cfg.ici_fsdp_parallelism)
  if ep > 0 and fsdp > 0:
    ici = ep * fsdp
    # Nearest EP first: the smallest change to the recipe's communication pattern.
    for new_ep in sorted((d for d in range(1, ici + 1) if ici % d == 0), key=lambda d: (abs(math.log(d / ep)), -d)):
      if new_ep != ep and int(cfg.num_experts) % new_ep == 0:
        yield "EP/FSDP split", [f"ici_expert_parallelism={new_ep}", f"ici_fsdp_parallelism={ici // new_ep}"]
  if str(getattr(cfg.remat_policy, "value", cfg.remat_policy)) != "full":
    yield "full remat", ["remat_policy=full"]
  pdbs = float(cfg.per_device_batch_size)
  while pdbs > 1:
    pdbs = pdbs / 2
    if pdbs == int(pdbs):
      yield "smaller micro-batch", [f"per_device_batch_size={int(pdbs)}"]
  nodes = max(int(cfg.nodes), 1)
  if hardware.gpu(cfg.recipe_hardware) is not None:
    for more in (2 * nodes, 4 * nodes):
      yield "more nodes", [f"nodes={more}"]


def _cheapest_fix(ctx: Planning, cfg: Any) -> tuple[Estimate | None, str | None, int]:
  """(the first of `_candidates` that the planner says fits, its kind, how many were tried)."""
  tried = 0
  for kind, extra in _candidates(cfg, ctx):
    tried += 1
    try:
      cand_cfg = resolved(ctx.path, ctx.base_overrides + extra)
    except UserError:
      continue  # an invalid layout for this model (e.g. experts not divisible)
    devices = int(cand_cfg.recipe_num_devices) if kind == "more nodes" else ctx.num_devices
    sizes = mesh_sizes(cand_cfg, devices)
    if divisibility.indivisible(ctx.leaves, divisibility.rules_of(cand_cfg), sizes):
      continue
    cand, _ = estimate_of(dataclasses.replace(ctx, num_devices=devices), cand_cfg, extra)
    if cand.fits:
      return cand, kind, tried
  return None, None, tried


def memory_plan(
  recipe: str,
  overrides: list[str],
  *,
  gpus: int | None = None,
  gpu_mem_gib: float | None = None,
  mfu: float = 0.4,
  planned: tuple[Planning, Any] | None = None,
) -> MemoryPlan:
  """Estimates `recipe` + overrides and, when it does not fit, searches for the cheapest change that does;
  `planned`: its `planning` when the command has it already."""
  ctx, cfg = planned or planning(recipe, overrides, gpus, gpu_mem_gib)
  divisibility.check(cfg, ctx.leaves, ctx.num_devices)
  base, dispatch = estimate_of(ctx, cfg, [])
  fix, fix_kind, tried = None, None, 0
  if not base.fits:
    fix, fix_kind, tried = _cheapest_fix(ctx, cfg)
  layout = {a: s for a, s in mesh_sizes(cfg, ctx.num_devices).items() if s > 1}
  batch = global_batch(cfg.per_device_batch_size, ctx.num_devices, cfg.gradient_accumulation_steps)
  return MemoryPlan(
    recipe, Hardware(cfg.recipe_hardware), ctx.num_devices, max(int(cfg.nodes), 1), batch,
    int(cfg.max_target_length), dispatch, layout, mfu, base, fix, fix_kind, tried,
  )  # fmt: skip


def _edge(e: Estimate) -> str:
  """The verdict's note for a step planned within EDGE of the usable memory (`estimate.EDGE`)."""
  if e.device_total <= (1 - EDGE) * e.hbm:
    return ""
  return f"; within {EDGE:.0%} of it XLA's buffer packing decides: maxtext-moe compile checks it"
