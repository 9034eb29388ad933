"""The memory plan of a recipe: will it fit, what does it cost, and what is the cheapest change that fits.

`memory_plan(recipe, overrides, gpus=..., gpu_mem_gib=...)` estimates one device (`estimate.py`), and when
the recipe does not fit tries changes cheapest first (`_candidates`): offload presets, EP/FSDP splits of
the same devices, smaller micro-batches. MaxText's own FLOPs count gives FLOPs per token.
"""

import dataclasses
import functools
import math
from collections.abc import Iterable
from typing import Any

from maxtext_moe.config import hardware, offload
from maxtext_moe.config.hardware import Hardware
from maxtext_moe.config.nodes import global_batch
from maxtext_moe.config.offload import OffloadPreset
from maxtext_moe.errors import UserError
from maxtext_moe.moe.layout import check_resolved_dispatch, dispatch_for, mesh_sizes
from maxtext_moe.planner import divisibility
from maxtext_moe.planner.estimate import GIB, Estimate, estimate


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
      f"  {'saved activations (remat policy)':<44}{_gib(e.saved_activations):>10}",
      *([f"  {'  of which the pipeline loop keeps':<44}{_gib(e.pipeline_saved):>10}"] if e.stages > 1 else []),
      f"  {'loss phase: logits and their gradient':<44}{_gib(e.logits_phase):>10}",
      f"  {'layer phase: MoE dispatch buffers':<44}{_gib(e.moe_dispatch):>10}",
      f"  {'layer phase: attention':<44}{_gib(e.attention):>10}",
      f"  {'layer phase: layer weights and gradients':<44}{_gib(e.layer_weights):>10}",
      f"  {'layer phase: residual-stream temporaries':<44}{_gib(e.layer_activations):>10}",
      *([f"  {'layer phase: FP8 copies (dense GEMMs)':<44}{_gib(e.fp8_copies):>10}"] if e.fp8_copies else []),
      *([f"  {'layer phase: pipeline loop buffers':<44}{_gib(e.pipeline_buffers):>10}"] if e.stages > 1 else []),
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
      lines.append(f"  verdict: FITS ({_gib(e.hbm - e.device_total)} GiB to spare on device)")
    else:
      where = "device" if e.device_total > (e.hbm or 0) else "host"
      lines.append(f"  verdict: DOES NOT FIT ({where} memory)")
      if self.fix is not None:
        lines.append(
          f"  cheapest fix ({self.fix_kind}): {' '.join(self.fix.overrides)} -> "
          f"{_gib(self.fix.device_total)} GiB on device, {_gib(self.fix.host)} GiB on host"
        )
      else:
        lines.append(f"  no offload preset, EP/FSDP split or smaller micro-batch makes it fit ({self.tried} tried)")
    return "\n".join(lines)

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


def _candidates(cfg: Any, ctx: "_Context") -> Iterable[tuple[str, list[str]]]:
  """Changes in the order we consider them cheapest, each one the recipe can take (a recipe that loads weights
  is never offered the presets that move the layer axis, `offload.takes`): offload presets, then EP/FSDP
  splits of the same devices (each axis kept within its ICI/DCN side), the forward recomputed (full remat
  for a custom policy), smaller micro-batches, then more nodes."""
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


@dataclasses.dataclass(frozen=True)
class _Context:
  """What every candidate of one plan shares: the recipe, devices, memory limits and parameter tree."""

  path: Any
  base_overrides: list[str]
  num_devices: int
  hbm_gib: float | None
  host_gib: float | None
  leaves: list
  platform: Any  # moe.settings.Platform
  loads_weights: bool = False  # the recipe starts from a checkpoint (a fine-tune): `offload.takes`


def _context(recipe: str, overrides: list[str], gpus: int | None, gpu_mem_gib: float | None) -> tuple[_Context, Any]:
  from maxtext_moe.config import flags  # pylint: disable=import-outside-toplevel
  from maxtext_moe.config.recipes import recipe_path  # pylint: disable=import-outside-toplevel
  from maxtext_moe.upstream import resolution  # pylint: disable=import-outside-toplevel

  path = recipe_path(recipe)
  keys = resolution.layer_keys(path, overrides)
  loads = bool(keys.plugin.finetune or keys.maxtext["load_parameters_path"] or keys.maxtext["load_full_state_path"])
  # A fine-tuning recipe's weights do not change its memory: plan it without them.
  base_overrides = ["finetune=false", *overrides, *(_gpus_as_nodes(path, overrides, gpus) if gpus else [])]
  cfg = resolved(path, base_overrides)
  n = int(cfg.recipe_num_devices)
  if n <= 0:
    import jax  # pylint: disable=import-outside-toplevel

    n = jax.device_count()
  spec = hardware.gpu(cfg.recipe_hardware)
  mem_fraction = float(flags.for_config(cfg).env.get("XLA_PYTHON_CLIENT_MEM_FRACTION", 0.75 if spec else 1.0))
  hbm = gpu_mem_gib if gpu_mem_gib is not None else (spec.hbm_gib * mem_fraction if spec else None)
  leaves = _leaves(str(path), tuple(base_overrides))
  host = spec.host_gb * 1e9 / GIB if spec else None
  return _Context(path, base_overrides, n, hbm, host, leaves, _target(cfg), loads), cfg


def resolved(path: Any, overrides: list[str]) -> Any:
  """MaxText's resolution of a recipe for its own devices. MaxText checks a pipeline's microbatches against
  per_device_batch_size x the devices it counts (`micro_batch_size_to_train_on`, configs/types.py), which
  are this machine's unless `internal_compile_num_devices` names them (as `compile` does): a plan names
  the job's, so a layout is judged for the cluster it is planned for, not the laptop planning it."""
  from maxtext_moe.upstream import resolution  # pylint: disable=import-outside-toplevel

  keys = resolution.layer_keys(path, overrides)
  n = keys.layout.devices
  job = resolution.job_devices(n) if n > 0 else []
  return resolution.hyperparameters(resolution.resolve(path, [*overrides, *job], keys=keys))


def _gpus_as_nodes(path: Any, overrides: list[str], gpus: int) -> list[str]:
  """`plan --gpus N` as the override it means: N / GPUs-per-node nodes (on CPU, N devices)."""
  from maxtext_moe.upstream import resolution  # pylint: disable=import-outside-toplevel

  per_node = resolution.layer_keys(path, overrides).layout.gpus_per_node
  if per_node is None:
    return [f"recipe_num_devices={gpus}"]
  if gpus % per_node:
    raise UserError(f"--gpus {gpus} is not a whole number of {per_node}-GPU nodes; pass --nodes N instead")
  return [f"nodes={gpus // per_node}"]


@functools.lru_cache(maxsize=8)
def _leaves(path: str, overrides: tuple[str, ...]) -> list:
  """The parameter tree's leaves: their shapes do not depend on the layout, so it is traced once, on one
  device, per recipe and overrides (`plan --time` and the layout search ask again)."""
  from maxtext_moe.upstream import resolution  # pylint: disable=import-outside-toplevel
  from maxtext_moe.upstream.maxtext import model as upstream_model  # pylint: disable=import-outside-toplevel

  one_device = resolution.resolved(path, [*overrides, *upstream_model.ONE_DEVICE_OVERRIDES])
  return upstream_model.param_leaves(one_device)


def _target(cfg: Any) -> Any:
  """The platform a recipe is planned for: a GPU recipe runs in our container (TE imports) with one process
  per GPU (our launchers), so `auto` there means te / te_ep, whatever this machine has."""
  from maxtext_moe.moe.settings import Platform  # pylint: disable=import-outside-toplevel

  if str(cfg.hardware) == "cpu":
    return Platform("cpu")
  return Platform("gpu", te_gemm=True, te_ep=True)


def dispatch_kind(ctx: _Context, cfg: Any) -> str:
  """What `moe_dispatch` resolves to for `cfg` on the platform it is planned for, refused (UserError) where
  the run's own checks would refuse it at launch (`auto` turned te_ep with a capacity factor below 1, say)."""
  kind = dispatch_for(cfg, num_devices=ctx.num_devices, platform=ctx.platform)
  try:
    check_resolved_dispatch(cfg, kind, num_devices=ctx.num_devices)
  except ValueError as e:
    raise UserError(f"{e} (moe_dispatch={cfg.moe_dispatch} resolves to {kind.value} here)") from e
  return kind.value


def _estimate(ctx: _Context, cfg: Any, extra: list[str]) -> tuple[Estimate, str]:
  from maxtext_moe.upstream.maxtext.compile import train_tflops_per_device  # pylint: disable=import-outside-toplevel

  kind = dispatch_kind(ctx, cfg)
  total, _, _ = train_tflops_per_device(cfg)
  est = estimate(
    cfg,
    ctx.leaves,
    num_devices=ctx.num_devices,
    dispatch=kind,
    hbm_gib=ctx.hbm_gib,
    host_gib=ctx.host_gib,
    tflops=total,
  )
  est.overrides = extra
  return est, kind


def _cheapest_fix(ctx: _Context, cfg: Any) -> tuple[Estimate | None, str | None, int]:
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
    cand, _ = _estimate(dataclasses.replace(ctx, num_devices=devices), cand_cfg, extra)
    if cand.fits:
      return cand, kind, tried
  return None, None, tried


def memory_plan(
  recipe: str, overrides: list[str], *, gpus: int | None = None, gpu_mem_gib: float | None = None, mfu: float = 0.4
) -> MemoryPlan:
  """Estimates `recipe` + overrides and, when it does not fit, searches for the cheapest change that does."""
  ctx, cfg = _context(recipe, overrides, gpus, gpu_mem_gib)
  divisibility.check(cfg, ctx.leaves, ctx.num_devices)
  base, dispatch = _estimate(ctx, cfg, [])
  fix, fix_kind, tried = None, None, 0
  if not base.fits:
    fix, fix_kind, tried = _cheapest_fix(ctx, cfg)
  layout = {a: s for a, s in mesh_sizes(cfg, ctx.num_devices).items() if s > 1}
  batch = global_batch(cfg.per_device_batch_size, ctx.num_devices, cfg.gradient_accumulation_steps)
  return MemoryPlan(
    recipe, Hardware(cfg.recipe_hardware), ctx.num_devices, max(int(cfg.nodes), 1), batch,
    int(cfg.max_target_length), dispatch, layout, mfu, base, fix, fix_kind, tried,
  )  # fmt: skip
