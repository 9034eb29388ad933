"""`maxtext-moe plan`: memory per GPU, the fit verdict and the cheapest fix; with --time the step time."""

import argparse
import json
from pathlib import Path
from typing import IO

from maxtext_moe.cli import search_commands
from maxtext_moe.cli.run_commands import add_nodes_option, recipe_args, split_recipe
from maxtext_moe.errors import UserError


def _plan(ns: argparse.Namespace, out: IO[str]) -> int:
  from maxtext_moe.gpu_compile import verify
  from maxtext_moe.planner.memory_plan import memory_plan
  from maxtext_moe.planner.planning import planning

  verify.check_count(ns.verify, search=ns.search)
  if ns.network_gbs is not None and (ns.network_gbs <= 0 or not (ns.time or ns.search)):
    raise UserError(
      "--network-gbs N is the scale-out network's GB/s per GPU, each way, read by the step-time model: N > 0, "
      "with --time or --search"
    )
  if ns.search:
    return search_commands.run(ns, out)
  if ns.write or ns.top is not None or ns.tensor:
    raise UserError("--write, --top and --tensor belong to --search: plan MODEL --gpu GPU --nodes N --search")
  if ns.force:
    raise UserError("--force goes with --write FILE.yml: plan MODEL --gpu GPU --nodes N --search --write FILE.yml")
  recipe, overrides, name, planned = _recipe_of(ns)
  if recipe is None:
    raise UserError("plan needs a RECIPE (see 'maxtext-moe recipes')")
  if ns.gpus is not None and ns.gpus < 1:
    raise UserError(f"--gpus must be >= 1, got {ns.gpus}")
  if ns.gpu_mem is not None and ns.gpu_mem <= 0:
    raise UserError(f"--gpu-mem must be > 0 GiB, got {ns.gpu_mem}")
  if not 0 < ns.mfu <= 1:
    raise UserError(f"--mfu must be in (0, 1], got {ns.mfu}")
  if ns.compiled and not ns.time:
    raise UserError("--compiled is read by the step-time model: pass --time with it")
  if ns.run and not ns.time:
    raise UserError("--run is read by the step-time model: pass --time with it")
  if ns.check:
    return _check(ns, recipe, overrides, out)
  compiled = _compile_report(ns.compiled) if ns.compiled else None
  resolved = planning(recipe, overrides, ns.gpus, ns.gpu_mem, network_gbs=ns.network_gbs)  # resolved once
  result = memory_plan(recipe, overrides, mfu=ns.mfu, planned=resolved)
  timed = None
  if ns.time:
    from maxtext_moe.steptime.model import format_prediction
    from maxtext_moe.steptime.recipe import for_recipe

    timed = for_recipe(recipe, overrides, compiled=compiled, run_dir=ns.run, name=name, planned=resolved)
  if planned:  # MODEL --gpu GPU: named as the user named it, and what layout it got
    result.recipe = name
  if ns.json:
    extra = ({"planned": planned} if planned else {}) | ({"time": timed.as_dict()} if timed else {})
    print(json.dumps(result.as_dict() | extra), file=out)
  else:
    lead = f"planned: {planned}\n" if planned else ""
    print(lead + result.table(timed) + (f"\n\n{format_prediction(timed)}" if timed else ""), file=out)
  return 0 if result.base.fits else 1


def _recipe_of(ns: argparse.Namespace) -> tuple[str | None, list[str], str, str]:
  """(recipe, overrides, its name, what was planned: empty for a recipe as given); with --gpu GPU, MODEL's
  recipe or default layout on that GPU and --nodes (`search.default_of`)."""
  if not ns.gpu:
    recipe, overrides = recipe_args(ns)
    return recipe, overrides, recipe or "", ""
  from maxtext_moe.steptime import search

  model, overrides = split_recipe(ns.args)
  if model is None:
    raise UserError("plan --gpu GPU needs a MODEL: a recipe, a model of configs/models or a model YAML file")
  if ns.gpus is not None:
    raise UserError("--gpus goes with a RECIPE; with --gpu GPU give the node count: --nodes N")
  if ns.check:
    raise UserError("--check goes with the RECIPE a launcher runs; plan MODEL --gpu GPU --nodes N prints the plan")
  if ns.nodes is not None and ns.nodes < 1:
    raise UserError(f"--nodes must be >= 1, got {ns.nodes}")
  base, planned = search.default_of(model, ns.gpu, ns.nodes or 1, overrides)
  return str(base.path), base.overrides, base.what, planned


def _check(ns: argparse.Namespace, recipe: str, overrides: list[str], out: IO[str]) -> int:
  """`plan RECIPE --check`: one line; a layout that does not divide or fit is an error (exit 2)."""
  from maxtext_moe.cluster import fit

  for flag in ("time", "json", "compiled", "run"):
    if getattr(ns, flag):
      raise UserError(f"--{flag} does not go with --check (one line: fits, or the error)")
  print(f"maxtext-moe: {fit.check(recipe, overrides, gpus=ns.gpus, gpu_mem_gib=ns.gpu_mem).line()}", file=out)
  return 0


def _compile_report(path: str) -> dict:
  """`compile`'s JSON report: its --json output saved to a file, or compile.json from --hlo DIR."""

  file = Path(path)
  file = file / "compile.json" if file.is_dir() else file
  try:
    report = json.loads(file.read_text())
  except (OSError, ValueError) as e:
    raise UserError(
      f"--compiled {path}: not a compile report ({e}); pass the --hlo DIR of 'maxtext-moe compile'"
    ) from None
  if not isinstance(report, dict) or "collectives" not in report or "devices" not in report:
    raise UserError(
      f"--compiled {path}: not a compile report (no collectives); pass the --hlo DIR of 'maxtext-moe compile'"
    )
  return report


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
  p = sub.add_parser(
    "plan",
    parents=[common],
    help="estimate per-GPU memory and throughput; say whether a recipe fits and what would make it fit",
    epilog="Exit code: 0 fits, 1 does not fit, 2 bad input. Example: maxtext-moe plan gb300x1024/deepseek3-671b",
    description="Estimate one device's memory at the training step's peak for RECIPE plus overrides, by "
    "component: parameters, gradients, Adam state, saved activations under the remat/offload policy, the "
    "loss phase's logits, MoE dispatch buffers and attention; plus host memory for offloaded state. Says "
    "whether it fits the GPU's HBM (times the flag profile's XLA_PYTHON_CLIENT_MEM_FRACTION) and, if not, "
    "the cheapest change that does: an offload preset, another EP/FSDP split, or a smaller micro-batch. "
    "Prints training FLOPs per token (MaxText's count) and, at an assumed --mfu (not a prediction), TFLOP/s "
    "and tokens/s per GPU. Nothing is compiled; "
    "'maxtext-moe bench plan' checks the estimate against XLA's compiled memory_analysis() on CPU. "
    "--time adds the step-time model (docs/step-time.md): compute per op class at measured efficiencies, "
    "each collective from its bytes and whether it crosses NVLink domains, what overlaps and what is "
    "exposed; step time, tokens/s, TFLOP/s per GPU, MFU and the three largest exposed costs: the prediction "
    "(the --mfu line is then left out). Its "
    "collectives are analytic, or XLA:GPU's with --compiled DIR (the --hlo DIR of 'maxtext-moe compile' "
    "for the same recipe and overrides); the output says which. The expert GEMMs and exchange run at the "
    "busiest EP rank's rows: --run RUN_DIR takes that imbalance from a training run's moe_load.jsonl (the "
    "same model; a short run of your own), else the model assumes a perfect balance and says so.",
  )
  p.add_argument("args", nargs="*", metavar="RECIPE [key=value]")
  add_nodes_option(p)
  p.add_argument("--gpus", type=int, help="number of GPUs, a whole number of nodes (default: the recipe's nodes)")
  p.add_argument("--gpu-mem", type=float, help="usable memory per GPU in GiB (default: the hardware's HBM)")
  p.add_argument(
    "--mfu",
    type=float,
    default=0.4,
    help="the model FLOPs utilization assumed for the table's what-if throughput line (0.4): an assumption, not "
    "a prediction; --time predicts it (and leaves this line out)",
  )
  p.add_argument("--json", action="store_true", help="print the plan as one JSON object instead of the table")
  p.add_argument("--time", action="store_true", help="add the step-time model (GPU recipes)")
  p.add_argument(
    "--compiled", metavar="DIR", help="with --time: take the collectives from 'maxtext-moe compile --hlo DIR'"
  )
  p.add_argument(
    "--network-gbs",
    type=float,
    metavar="N",
    help="with --time or --search: your scale-out network's GB/s per GPU, each way (default: the hardware "
    "table's, which --time prints: e.g. H100 nodes with a 400 Gb/s NIC per GPU, 50)",
  )
  p.add_argument(
    "--run",
    metavar="RUN_DIR",
    help="with --time: the routing imbalance a training run of the same model measured (its moe_load.jsonl)",
  )
  search_commands.add_options(p)
  p.set_defaults(func=_plan)
