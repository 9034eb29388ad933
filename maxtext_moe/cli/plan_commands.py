"""`maxtext-moe plan`: memory per GPU, the fit verdict and the cheapest fix; with --time the step time."""

import argparse
import json
from pathlib import Path
from typing import IO

from maxtext_moe.cli.run_commands import add_nodes_option, recipe_args, split_recipe
from maxtext_moe.errors import UserError


def _plan(ns: argparse.Namespace, out: IO[str]) -> int:
  from maxtext_moe.gpu_compile import verify
  from maxtext_moe.planner.memory_plan import memory_plan

  verify.check_count(ns.verify, search=ns.search)
  if ns.search:
    return _search(ns, out)
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
  result = memory_plan(recipe, overrides, gpus=ns.gpus, gpu_mem_gib=ns.gpu_mem, mfu=ns.mfu)
  timed = None
  if ns.time:
    from maxtext_moe.steptime.model import format_prediction
    from maxtext_moe.steptime.recipe import for_recipe

    timed = for_recipe(recipe, overrides, gpus=ns.gpus, compiled=compiled, run_dir=ns.run, name=name)
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


def _search(ns: argparse.Namespace, out: IO[str]) -> int:
  """`plan MODEL --gpu GPU --nodes N --search [--write FILE.yml]`."""
  import functools
  import shlex
  import sys

  from maxtext_moe.bench.report import emit
  from maxtext_moe.steptime import search

  model, overrides = split_recipe(ns.args)
  if model is None:
    raise UserError("plan --search needs a MODEL: a recipe, a model of configs/models or a model YAML file")
  for flag in ("time", "compiled", "gpus", "gpu_mem", "run"):
    if getattr(ns, flag):
      raise UserError(f"--{flag.replace('_', '-')} is not read by --search (it times every layout it keeps)")
  if ns.nodes is not None and ns.nodes < 1:
    raise UserError(f"--nodes must be >= 1, got {ns.nodes}")
  if ns.check:
    raise UserError("--check goes with a RECIPE, not --search (the search keeps only layouts that fit)")
  if ns.force and not ns.write:
    raise UserError("--force goes with --write FILE.yml (it replaces FILE.yml)")
  if ns.write:
    _writable_recipe(Path(ns.write), force=ns.force)  # before the search's minutes
  top = 8 if ns.top is None else ns.top
  if top < 1:
    raise UserError(f"--top must be >= 1, got {top}")
  base = search.base_of(model, ns.gpu, ns.nodes or 1, overrides)
  found, tried, ctx = search.search(base, tensor=ns.tensor)
  devices = f"{ctx.num_devices} x {ns.gpu or 'the recipe GPU'}"
  title = f"{model} on {ns.nodes or 1} node(s), {devices}: {len(found)} of {tried} layouts tried fit, fastest first"
  result = {"model": model, "nodes": ns.nodes or 1, "devices": ctx.num_devices, "tried": tried}
  result["layouts"] = [f.row() for f in found[:top]]
  if not found:
    raise UserError(
      f"no layout of {model} fits {ctx.num_devices} GPUs ({tried} tried, offload included): use more nodes "
      "(--nodes) or GPUs with more memory"
    )
  command = shlex.join(["maxtext-moe", *sys.argv[1:]]) if sys.argv[1:2] == ["plan"] else "maxtext-moe plan --search"
  search_text = functools.partial(search.recipe_text, base, command=command, hbm_gib=ctx.hbm_gib)
  found, verified = _verified(ns, found, text_of=search_text)
  result["layouts"] = [f.row() for f in found[:top]]
  if verified:
    result["verified"] = [v.row() for v in verified]
  if ns.write:
    chosen = next((v for v in verified if v.fits), None)  # with --verify, the first that compiled to fit
    text = search_text(found[0], compiled=chosen.row()) if chosen else search_text(found[0])
    _write_recipe(Path(ns.write), text)
    result["written"] = str(Path(ns.write).resolve())
  emit(search.table(found, top=top, title=title, verified=verified), result, as_json=ns.json, out=out, width=200)
  if ns.write and not ns.json:
    what = "the first that compiles to fit" if verified else "the first"
    print(f"wrote {what} as a recipe: {ns.write} (maxtext-moe compile {ns.write} checks it)", file=out)
  return 0


def _verified(ns: argparse.Namespace, found: list, *, text_of) -> tuple[list, list]:
  """(the layouts, those `--verify K` compiled): without --verify as the search ranked them; with it, the
  first K compiled as the recipe files they would be written as, ranked again by what compiles to fit (none
  does: one line)."""
  import sys

  from maxtext_moe.gpu_compile import verify

  if not ns.verify:
    return found, []
  verified = verify.verify(found, ns.verify, text_of=text_of, progress=sys.stderr)
  verify.first_fitting(verified)
  return verify.reranked(found, verified), verified


def _writable_recipe(path, *, force: bool) -> None:
  """--write FILE.yml as a recipe file may be written: .yml, in a folder that exists, not over a file
  already there unless --force."""
  if path.suffix != ".yml":
    raise UserError(f"--write {path}: a recipe file ends in .yml (MaxText's rule)")
  if not path.parent.is_dir():
    raise UserError(f"--write {path}: the folder {path.parent} does not exist")
  if path.is_dir():
    raise UserError(f"--write {path}: is a directory; name the recipe file to write")
  if path.exists() and not force:
    raise UserError(f"--write {path.absolute()} already exists; pass --force to replace it")


def _write_recipe(path, text: str) -> None:
  """Writes the recipe whole or not at all (a temporary file renamed into place)."""
  tmp = path.with_name(f".{path.name}.tmp")
  tmp.write_text(text, encoding="utf-8")
  tmp.replace(path)


def _compile_report(path: str) -> dict:
  """`compile`'s JSON report: its --json output saved to a file, or compile.json from --hlo DIR."""
  from pathlib import Path

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
    "--run",
    metavar="RUN_DIR",
    help="with --time: the routing imbalance a training run of the same model measured (its moe_load.jsonl)",
  )
  _add_search_options(p)
  p.set_defaults(func=_plan)


def _add_search_options(p: argparse.ArgumentParser) -> None:
  """--search and what goes with it: the layouts of a model on a GPU and node count, the fastest written."""
  p.add_argument(
    "--search",
    action="store_true",
    help="rank the layouts of MODEL (a recipe, a model of configs/models or a model YAML) that fit --nodes "
    "nodes of --gpu: EP x FSDP (x TP with --tensor) per NVLink domain, EP, FSDP, data or pipeline stages across, "
    "remat, offload and micro-batch, by the step-time model's tokens/s per GPU",
  )
  p.add_argument(
    "--gpu",
    help=f"the GPU ({', '.join(_gpus())}); default a recipe's own. Without --search, MODEL on --nodes nodes of "
    "it is planned (and with --time timed) as its shipped recipe for that GPU, else a default layout (the "
    "largest EP in a node, FSDP the rest and across), your key=value overrides on top",
  )
  p.add_argument(
    "--write", metavar="FILE.yml", help="with --search: write the fastest as a recipe file (not over one: --force)"
  )
  p.add_argument("--force", action="store_true", help="with --write: replace FILE.yml if it exists")
  p.add_argument(
    "--check",
    action="store_true",
    help="for launchers: one line, exit 0 when the layout fits; a layout that does not divide or fit is "
    "one error line, exit 2 (scripts/slurm/train.sbatch runs it before starting the tasks)",
  )
  p.add_argument("--top", type=int, help="with --search: how many layouts to print (8)")
  p.add_argument(
    "--verify",
    type=int,
    metavar="K",
    help="with --search: compile the first K layouts with XLA:GPU on this machine (minutes each; Transformer "
    "Engine's kernels where ./setup.sh --gpu-compile-te made .venv-te), show compiled GiB beside planned, rank "
    "what compiles to fit first, and with --write write the first that does (none does: exit 2)",
  )
  p.add_argument(
    "--tensor",
    action="store_true",
    help="with --search: tensor parallelism 2 and 4 too (EP x TP in place of FSDP in a node). Their times are "
    "lower bounds: XLA:GPU's programs of our block under TP move far more than the model counts "
    "(docs/step-time.md); compile one before you run it",
  )


def _gpus() -> list[str]:
  from maxtext_moe.config import hardware

  return list(hardware.GPUS)
