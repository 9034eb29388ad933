"""Whether a layout search candidate (`candidates.py`) fits, found with as few MaxText resolutions as the
answer needs (about a second each: the search's cost), and its time.

- An offload whose parameters, Adam state and gradients alone exceed the memory is not resolved
  (`_state_floor`: from the parameter tree and the base config's rules).
- After one estimate, the next offload tried is the first its arithmetic says may fit (`_offloaded_fits`:
  the presets move the optimizer state, then the parameters, to the host between steps; during the step
  the device loses the optimizer state and the parameters' re-laid-out copy, and nothing else).
- The schedules of a pipelined layout (repeats, microbatch counts) share one resolution (`_Schedule`).
"""

import dataclasses
import types
from typing import Any

from maxtext_moe.errors import UserError
from maxtext_moe.steptime.candidates import OFFLOADS, REPEATS, Layout, microbatch_counts, offloads


@dataclasses.dataclass(frozen=True)
class Found:
  layout: Layout
  device_gib: float
  global_batch: int
  prediction: Any  # steptime.model.Prediction

  def row(self) -> dict[str, Any]:
    return {
      "ep": self.layout.ep,
      "ep_across": self.layout.dcn_ep,
      "fsdp_per_domain": self.layout.fsdp,
      "tp": self.layout.tp,
      "fsdp_across": self.layout.dcn_fsdp,
      "data_across": self.layout.dcn_data,
      "stages": self.layout.stages,
      "repeats": self.layout.repeats,
      "microbatches": self.layout.microbatches or None,
      "pipeline_parallel_layers": self.layout.pipelined or None,
      "remat": self.layout.remat,
      "offload": self.layout.offload,
      "per_device_batch_size": self.layout.batch,
      "global_batch": self.global_batch,
      "device_gib": round(self.device_gib, 1),
      "tflops_per_gpu": round(self.prediction.tflops_per_gpu, 1),
      "tokens_per_s_per_gpu": round(self.prediction.tokens_per_s_per_gpu, 1),
      "gives_up": self.layout.gives_up(),
      "overrides": self.layout.overrides(),
    }


def pipelinable(cfg: Any) -> int:
  """Layers of a MoE decoder's stack it can run in pipeline stages (`planner.stages.stack_of`; 0 without
  experts: no stages searched)."""
  from maxtext_moe.planner.stages import stack_of  # pylint: disable=import-outside-toplevel

  return stack_of(cfg)[1] if int(cfg.num_experts) > 1 else 0


def first_fit(ctx: Any, cfg: Any, start: Layout, first: int, half: Any = None) -> tuple[tuple | None, int]:
  """((layout, config, estimate) at the first offload from OFFLOADS[first] on that fits, or None; how many
  MaxText resolved). An offload that cannot fit by its state alone (`_state_floor`), or by what the
  estimate at half the batch (`half`) says of this one (`_doubled`), is not resolved; after one estimate,
  the next offload tried is the first its arithmetic says fits (`_offloaded_fits`). A pipelined layout is
  judged at its least memory, its most microbatches (`_least_memory_schedule`): the timing then tries the
  others (`timed`); its floor from half the batch is left out, since a larger batch can take more of them."""
  from maxtext_moe.moe.layout import mesh_sizes  # pylint: disable=import-outside-toplevel
  from maxtext_moe.planner import divisibility  # pylint: disable=import-outside-toplevel
  from maxtext_moe.planner.planning import estimate_of, resolved  # pylint: disable=import-outside-toplevel

  doubled = half is not None and start.stages == 1
  floors = [_state_floor(ctx, cfg, start), *([_doubled(half)] if doubled else [])]
  levels = len(offloads(loads_weights=ctx.loads_weights))  # OFFLOADS' first ones: those the recipe can take
  level = next((k for k in range(first, levels) if all(_offloaded_fits(ctx, f, k) for f in floors)), None)
  count = 0
  while level is not None:
    layout = dataclasses.replace(start, offload=OFFLOADS[level])
    count += 1
    try:
      cand = resolved(ctx.path, [*ctx.base_overrides, *layout.overrides()])
    except UserError:
      return None, count  # this model cannot take this layout (a check of ours or MaxText's)
    if divisibility.indivisible(ctx.leaves, divisibility.rules_of(cand), mesh_sizes(cand, ctx.num_devices)):
      return None, count
    est, _ = estimate_of(ctx, cand, [])
    if not est.fits and layout.stages > 1:
      layout, cand, est = _least_memory_schedule(ctx, layout, cand, est)
    if est.fits:
      return (layout, cand, est), count
    level = next((k for k in range(level + 1, levels) if _offloaded_fits(ctx, est, k)), None)
  return None, count


def _least_memory_schedule(ctx: Any, layout: Layout, cand: Any, est: Any) -> tuple[Layout, Any, Any]:
  """A pipelined layout at the schedule of least memory among those it can run (`_schedules`: repeats and
  microbatch counts): more microbatches make its activations and loop buffers smaller, more repeats an
  iteration's stage weights (gh200x4/qwen3-30b-a3b's layout at batch 4: 85.0 GiB with 2 microbatches, 77.4
  with 8 and 4 repeats); the layout as given where none takes less."""
  from maxtext_moe.planner.planning import estimate_of  # pylint: disable=import-outside-toplevel

  best = (layout, cand, est)
  for other in _schedules(ctx, layout, cand):
    wrapped = _Schedule(cand, other.microbatches, other.repeats, other.pipelined)
    e = estimate_of(ctx, wrapped, [])[0]
    if e.device_total < best[2].device_total:
      best = (other, wrapped, e)
  return best


def _offloaded_fits(ctx: Any, est: Any, level: int) -> bool:
  """Whether `est` (an estimate, or `_state_floor`'s part of one) may fit with OFFLOADS[level]: the optimizer
  state, then the parameters move to the host. The device keeps the parameters during the step (MaxText
  moves them back for it, `planner/estimate.py`) and loses the optimizer state and, with the parameters
  offloaded, the scanned weights' re-laid-out copy (the preset sets param_scan_axis=0); the update phase
  the offloaded optimizer state adds is left out, so this is a floor. Nothing else in the plan depends on
  the preset (`config/offload.py`)."""
  # what the offload adds to the host: the optimizer state on the device, the parameters not yet offloaded
  to_host = est.optimizer * (level >= 1) + est.params * (level >= 2) * (not getattr(est, "params_from_host", False))
  device = est.device_total - est.optimizer * (level >= 1) - est.scan_copy * (level >= 2)
  hbm_ok = ctx.hbm_gib is None or device <= ctx.hbm_gib * 2**30
  return hbm_ok and (ctx.host_gib is None or est.host + to_host <= ctx.host_gib * 2**30)


def _state_floor(ctx: Any, cfg: Any, layout: Layout) -> Any:
  """The parameters, Adam state and gradients of `layout` without offload, from the parameter tree and
  the base config's rules alone (no resolution): a floor of its estimate (`estimate._state_bytes`)."""
  from maxtext_moe.planner import divisibility, stages  # pylint: disable=import-outside-toplevel
  from maxtext_moe.planner.estimate import _state_bytes  # pylint: disable=import-outside-toplevel

  ep = layout.ep * layout.dcn_ep
  sizes = {"expert": ep, "fsdp": layout.fsdp * layout.dcn_fsdp, "data": layout.dcn_data, "stage": layout.stages}
  sizes["tensor"] = layout.tp
  pipe = None
  if layout.stages > 1:
    lay = (layout.stages, layout.microbatches, layout.repeats, 1, layout.per_stage, layout.pipelined)
    pipe = stages.Stages(*lay, *stages.stack_of(cfg))
  params, optimizer, grads, _ = _state_bytes(cfg, ctx.leaves, divisibility.rules_of(cfg), sizes, pipe)
  total = params + optimizer + grads
  return types.SimpleNamespace(params=params, optimizer=optimizer, device_total=total, scan_copy=0, host=0)


def _doubled(est: Any) -> Any:
  """A floor of the estimate of the same layout and offload at twice the batch: the saved activations and
  the logits are linear in the tokens (`planner/estimate.py`: the search's remat policies keep no MoE
  rows, and a pipelined layout's microbatches hold whole sequences), nothing else shrinks."""
  peak = max(2 * est.logits_phase, est.layer_phase) - max(est.logits_phase, est.layer_phase)
  saved_host = est.host - est.host_state
  return types.SimpleNamespace(
    params=est.params,
    optimizer=est.optimizer,
    scan_copy=est.scan_copy,
    device_total=max(est.step_total + est.saved_activations + peak, est.update_phase),
    host=est.host + saved_host,
    params_from_host=est.params_from_host,
  )


class _Schedule:
  """A resolved config at another pipeline schedule: microbatches, repeats and the layers they pipeline.
  MaxText derives nothing else from them (configs/types.py checks the microbatches: a multiple of the
  stages dividing the micro batch, which `candidates.microbatch_counts` keeps; and that the pipelined
  layers split into stages x layers per stage x repeats, which `_schedules` keeps), so each is planned and
  timed without resolving again."""

  def __init__(self, cfg: Any, microbatches: int, repeats: int, pipelined: int):
    self._cfg = cfg
    self.num_pipeline_microbatches = microbatches
    self.num_pipeline_repeats = repeats
    self.pipeline_parallel_layers = pipelined
    stages = int(cfg.ici_pipeline_parallelism) * int(cfg.dcn_pipeline_parallelism)
    self.num_layers_per_pipeline_stage = pipelined // (stages * repeats)

  def __getattr__(self, name: str) -> Any:
    return getattr(self._cfg, name)


def _schedules(ctx: Any, layout: Layout, cand: Any) -> list[Layout]:
  """The staged `layout` in each of REPEATS (the largest multiple of stages x repeats pipelined) at each
  microbatch count, but the one already timed."""
  layers, counts = pipelinable(cand), microbatch_counts(layout.stages, _sequences_per_shard(ctx, cand))
  out = []
  for r in REPEATS:
    pipelined = layers // (layout.stages * r) * layout.stages * r
    for m in counts if pipelined else ():
      if (m, r) != (layout.microbatches, layout.repeats):
        out.append(dataclasses.replace(layout, microbatches=m, repeats=r, pipelined=pipelined))
  return out


def timed(ctx: Any, layout: Layout, cand: Any, est: Any) -> "Found":
  """The layout timed; a pipelined one at its fastest schedule (repeats, microbatches) that fits."""
  from maxtext_moe.config.nodes import global_batch  # pylint: disable=import-outside-toplevel
  from maxtext_moe.planner.planning import estimate_of  # pylint: disable=import-outside-toplevel
  from maxtext_moe.steptime.recipe import predict_config  # pylint: disable=import-outside-toplevel

  label = f"EP {layout.ep} x FSDP {layout.fsdp}" + (f" x EP {layout.dcn_ep} across" if layout.dcn_ep > 1 else "")
  label += f" x TP {layout.tp}" * (layout.tp > 1) + (f", {layout.stages} stages" if layout.stages > 1 else "")
  batch_total = global_batch(layout.batch, ctx.num_devices, int(cand.gradient_accumulation_steps))
  best = Found(layout, est.device_total / 2**30, batch_total, predict_config(ctx, cand, label, est=est))
  for other in _schedules(ctx, layout, cand) if layout.stages > 1 else ():
    wrapped = _Schedule(cand, other.microbatches, other.repeats, other.pipelined)
    e, _ = estimate_of(ctx, wrapped, [])
    pred = predict_config(ctx, wrapped, label, est=e) if e.fits else None
    if pred is not None and pred.tokens_per_s_per_gpu > best.prediction.tokens_per_s_per_gpu:
      best = Found(other, e.device_total / 2**30, batch_total, pred)
  return best


def _sequences_per_shard(ctx: Any, cfg: Any) -> int:
  """Sequences of the micro batch per shard of the activations' batch axes (no `stage`)."""
  from maxtext_moe.moe.layout import mesh_sizes  # pylint: disable=import-outside-toplevel
  from maxtext_moe.planner import divisibility  # pylint: disable=import-outside-toplevel
  from maxtext_moe.planner.estimate import batch_tokens  # pylint: disable=import-outside-toplevel
  from maxtext_moe.planner.shards import tensor_ways  # pylint: disable=import-outside-toplevel

  sizes = mesh_sizes(cfg, ctx.num_devices)  # the batch is whole over tensor parallelism: its tokens x tp
  tokens = batch_tokens(cfg, sizes, divisibility.rules_of(cfg), ctx.num_devices) * tensor_ways(sizes)
  return tokens // int(cfg.max_target_length)
