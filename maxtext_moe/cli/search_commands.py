"""`maxtext-moe plan MODEL --gpu GPU --nodes N --search [--verify K] [--write FILE.yml]`: the layouts of a model
on a cluster ranked by the step-time model (`steptime/search.py`), the first K compiled by XLA:GPU
(`gpu_compile/verify.py`), the chosen one written as a recipe file, whole or not at all."""

import argparse
from pathlib import Path
from typing import IO

from maxtext_moe.cli.run_commands import split_recipe
from maxtext_moe.errors import UserError


def run(ns: argparse.Namespace, out: IO[str]) -> int:
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
  found, tried, ctx = search.search(base, tensor=ns.tensor, network_gbs=ns.network_gbs)
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
  shown = search.table(found, top=top, title=title, verified=verified, hbm_gib=ctx.hbm_gib)
  emit(shown, result, as_json=ns.json, out=out, width=200)
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


def add_options(p: argparse.ArgumentParser) -> None:
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
