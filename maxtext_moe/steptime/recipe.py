"""The step-time model for a recipe: `for_recipe` (what `plan --time` prints), `predict_config` for a
resolved config, and `with_compiled`, which puts the collectives of `compile`'s XLA:GPU report in place of
the analytic ones."""

import dataclasses
import math
from typing import Any

from maxtext_moe.moe.layout import mesh_sides
from maxtext_moe.steptime.imbalance import UNMEASURED, Imbalance, from_run
from maxtext_moe.steptime.model import Transfer, Workload
from maxtext_moe.steptime.workload import workload


def with_compiled(w: Workload, report: dict[str, Any], sides: dict[str, tuple[int, int]] | None = None) -> Workload:
  """`w` with its FSDP/gradient collectives and host syncs replaced by those of `compile`'s report of the
  XLA:GPU program (`compile --json`, or `compile.json` from `--hlo DIR`). The expert exchange's bytes stay
  analytic (without TE the compile runs all_to_all where the container runs TE's NCCL EP); where ours is
  the container's too (all_to_all), the share of it the program runs beside GEMMs is the program's. Tensor
  parallelism's activation collectives stay analytic and waited for (the program's groups of its size do
  not say which axis they span; its own are then counted again, beside the compute)."""
  kept = [t for t in w.transfers if t.kind in ("all-to-all", "host", "p2p") or t.name.startswith("tensor-parallel")]
  devices = int(report["devices"])
  partitions = max(int(report.get("partitions", 1)), 1)
  per_domain = max(devices // partitions, 1)
  for key, row in sorted(report["collectives"].items()):
    if row["kind"] in ("all-to-all", "ragged-all-to-all", "collective-permute") or "(in a branch)" in key:
      continue
    group = int(row["group_size"])
    named = [a for a in row.get("axes", ()) if sides and a in sides]
    if named and len(named) == len(row.get("axes", ())):  # the mesh axes it spans: their DCN degrees
      domains = math.prod(sides[a][1] for a in named)
    else:  # groups by device id: consecutive devices fill a domain first
      domains = max(1, -(-group // per_domain)) if group > per_domain else 1
    nbytes = float(row["bytes"]) * (group if row["kind"] == "reduce-scatter" else 1)  # the report counts results
    kept.append(Transfer(f"XLA:GPU {key}", row["kind"], nbytes, group, domains, True, float(row["count"])))
  sources = dict(w.sources)
  sources["collectives"] = (
    "XLA:GPU's compiled program (all-gathers, reduce-scatters, all-reduces, host syncs); the expert exchange analytic"
  )
  host_syncs = float(report.get("host_syncs_per_step", w.host_syncs))
  beside = w.exchange_beside
  ours = any(t.kind == "all-to-all" and "(all_to_all" in t.name for t in w.transfers)  # not TE's NCCL EP
  if ours and report.get("exchange_bytes"):  # the share of our exchange the program runs beside GEMMs
    beside = float(report["exchange_beside_gemm_bytes"]) / float(report["exchange_bytes"])
    sources["expert exchange beside GEMMs"] = f"XLA:GPU's compiled program: {beside:.0%} of its bytes"
  return dataclasses.replace(w, transfers=kept, host_syncs=host_syncs, sources=sources, exchange_beside=beside)


_GAP_KINDS = ("all-gather", "reduce-scatter", "all-reduce")


def collective_gaps(analytic: Workload, compiled: Workload) -> str:
  """The analytic model's collectives beside the compiled program's, per kind: GiB per GPU and step each,
  and where they differ by more than 10%, by how much (what `--time --compiled` puts in place of the
  model's own count)."""
  parts = []
  for kind in _GAP_KINDS:
    model = sum(t.wire_bytes for t in analytic.transfers if t.kind == kind and not t.name.startswith("XLA:GPU"))
    program = sum(t.wire_bytes for t in compiled.transfers if t.kind == kind and t.name.startswith("XLA:GPU"))
    if not model and not program:
      continue
    gap = "" if abs(program - model) <= 0.1 * max(model, program) else f" ({(model - program) / 2**30:+,.1f} GiB)"
    parts.append(f"{kind} {model / 2**30:,.1f} by the model, {program / 2**30:,.1f} in the program{gap}")
  return "; ".join(parts) or "none"


def imbalance_of(cfg: Any, num_devices: int, run_dir: Any) -> Imbalance:
  """The routing imbalance `run_dir`'s moe_load.jsonl measured at `cfg`'s EP size (unmeasured without one)."""
  if run_dir is None:
    return UNMEASURED
  ep = math.prod(mesh_sides(cfg, num_devices).get("expert", (1, 1)))
  return from_run(run_dir, ep, int(cfg.num_experts))


def scheduler_room(cfg: Any, est: Any) -> tuple[int, int] | None:
  """(the temporaries the planner puts in the step's forward and backward, the memory XLA:GPU's scheduler
  works to), bytes; None without a device limit. The scheduler's is `GetSchedulerMemoryLimit`'s: the slop
  factor (`--xla_gpu_memory_limit_slop_factor` of the flag profile, XLA's 95 without one) x (the
  allocator's limit - the program's arguments); the arguments are the parameters and optimizer state kept
  on the device (offloaded ones are the host's, and the step's copy of offloaded parameters a temporary)."""
  from maxtext_moe.config import flags  # pylint: disable=import-outside-toplevel

  if est.hbm is None:
    return None
  xla_flags = flags.for_config(cfg, keep_process_flags=False).xla_flags
  slop = int(flags.flag_value(xla_flags, "--xla_gpu_memory_limit_slop_factor") or 95)
  arguments = est.params * (not est.params_from_host) + est.optimizer
  return est.step_total - arguments, int(slop / 100 * (est.hbm - arguments))


def within_room(w: Workload, room: tuple[int, int] | None) -> Workload:
  """`w` with the exchange's share beside GEMMs the one compiled over the scheduler's limit
  (`constants.EXCHANGE_BESIDE_OVER_LIMIT`) where `room` (`scheduler_room`) is over it, and a note why."""
  from maxtext_moe.steptime.constants import EXCHANGE_BESIDE_OVER_LIMIT  # pylint: disable=import-outside-toplevel

  if not w.exchange_beside or room is None or room[0] <= room[1]:
    return w
  beside = min(w.exchange_beside, EXCHANGE_BESIDE_OVER_LIMIT.value)
  note = (
    f"{beside:.0%}: the forward and backward's {room[0] / 2**30:,.1f} GiB of temporaries (planned) are over the "
    f"{room[1] / 2**30:,.1f} GiB XLA:GPU's scheduler works to, which then keeps the exchange from the GEMMs "
    "(docs/step-time.md)"
  )
  return dataclasses.replace(w, exchange_beside=beside, sources={**w.sources, "expert exchange beside GEMMs": note})


def predict_config(
  ctx: Any, cfg: Any, label: str, compiled: dict | None = None, imbalance: Imbalance = UNMEASURED, est: Any = None
) -> Any:
  """The `Prediction` of a resolved GPU config (`ctx`: the planner's `memory_plan.planning` of its recipe;
  `est`: its planner estimate where the caller has it)."""
  from maxtext_moe.config.hardware import gpu as gpu_model  # pylint: disable=import-outside-toplevel
  from maxtext_moe.errors import UserError  # pylint: disable=import-outside-toplevel
  from maxtext_moe.planner.planning import dispatch_kind, estimate_of  # pylint: disable=import-outside-toplevel
  from maxtext_moe.steptime.model import predict  # pylint: disable=import-outside-toplevel

  model = gpu_model(cfg.recipe_hardware)
  if model is None:
    raise UserError("plan --time models a GPU step; this recipe runs on CPU (pick a GPU recipe: 'maxtext-moe recipes')")
  table_gbs = model.network_gbs
  if ctx.network_gbs:
    model = dataclasses.replace(model, network_gbs=float(ctx.network_gbs))
  kind = dispatch_kind(ctx, cfg)
  est = est if est is not None else estimate_of(ctx, cfg, [])[0]
  w = within_room(
    workload(cfg, ctx.leaves, num_devices=ctx.num_devices, dispatch=kind, label=label, imbalance=imbalance),
    scheduler_room(cfg, est),
  )
  if compiled is not None:
    if int(compiled.get("devices", -1)) != ctx.num_devices or compiled.get("gpu") != str(cfg.recipe_hardware):
      raise UserError(
        f"the compile report is for {compiled.get('devices')} x {compiled.get('gpu')}, the plan for "
        f"{ctx.num_devices} x {cfg.recipe_hardware}: compile the same recipe and overrides"
      )
    analytic = w
    w = with_compiled(w, compiled, mesh_sides(cfg, ctx.num_devices))
    w.sources["collectives, the model beside the program (GiB per GPU and step)"] = collective_gaps(analytic, w)
  w.sources["network"] = (
    f"{model.network_gbs:,.0f} GB/s per GPU each way across NVLink domains"
    + (f" (--network-gbs; the table's {model.product}: {table_gbs:,.0f})" if ctx.network_gbs else
       f" ({model.product}'s NICs in the hardware table; plan --network-gbs N for your fabric)")
  )  # fmt: skip
  return predict(w, model)


def for_recipe(
  recipe: str,
  overrides: list[str],
  *,
  gpus: int | None = None,
  compiled: dict | None = None,
  run_dir: Any = None,
  name: str = "",
  planned: tuple[Any, Any] | None = None,
) -> Any:
  """The step-time `Prediction` of `recipe` + overrides on its GPUs (from `compile`'s report when given; at
  the routing imbalance `run_dir` measured when given), labelled `name` (default: the recipe); `planned`:
  the recipe's `memory_plan.planning` when the command has it already."""
  from maxtext_moe.planner import divisibility  # pylint: disable=import-outside-toplevel
  from maxtext_moe.planner.planning import planning  # pylint: disable=import-outside-toplevel

  ctx, cfg = planned or planning(recipe, overrides, gpus, None)
  divisibility.check(cfg, ctx.leaves, ctx.num_devices)  # a layout that cannot be built has no step time
  imbalance = imbalance_of(cfg, ctx.num_devices, run_dir)
  return predict_config(ctx, cfg, f"{name or recipe} on {ctx.num_devices} GPUs", compiled, imbalance)
