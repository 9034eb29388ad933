"""The command that looks at a GPU recipe without a GPU: compile."""

import argparse
import json
import logging
import os
from pathlib import Path
from typing import IO

from maxtext_moe.cli.run_commands import OVERRIDES_HELP, add_nodes_option, recipe_args
from maxtext_moe.errors import UserError


def _compile(ns: argparse.Namespace, out: IO[str]) -> int:
  from maxtext_moe.gpu_compile import command as gpu_compile
  from maxtext_moe.gpu_compile.report import format_report

  recipe, overrides = recipe_args(ns)
  if recipe is None:
    raise UserError("compile needs a GPU RECIPE (see 'maxtext-moe recipes')")
  _check_hlo_dir(ns.hlo)
  if not ns.verbose:  # XLA's and tokamax's notes about autotuning that cannot happen without a GPU
    os.environ["TF_CPP_MIN_LOG_LEVEL"] = "2"
    logging.getLogger("absl").setLevel(logging.ERROR)
  hlo_dir = Path(ns.hlo) if ns.hlo else None
  report = gpu_compile.compile_recipe(recipe, overrides, hlo_dir=hlo_dir, memory_gib=_memory(ns.memory))
  print(json.dumps(report) if ns.json else format_report(report), file=out)
  return 0 if report["fits"] else 1


def _memory(given: str | None) -> float | str | None:
  """--memory: GiB above 0, or `planned` (the planner's figure for the same config)."""
  if given is None or given == "planned":
    return given
  try:
    gib = float(given)
  except ValueError:
    gib = -1.0
  if not 0 < gib < 10_000:
    raise UserError(f"--memory {given}: give the GiB of device memory to schedule for (above 0), or 'planned'")
  return gib


def _check_hlo_dir(hlo: str | None) -> None:
  """--hlo DIR asked about before anything is compiled (XLA would only log that it cannot dump there, and
  the compile's minutes would end without the dump): a directory, or one that can be created, writable."""
  from maxtext_moe.config.paths import unwritable_reason  # pylint: disable=import-outside-toplevel

  if hlo is not None and (why := unwritable_reason(hlo)):
    raise UserError(f"--hlo {hlo}: {why}; give --hlo a directory to write into (created if missing)")


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
  p = sub.add_parser(
    "compile",
    parents=[common],
    help="compile a GPU recipe's train step with XLA:GPU for its own GPUs and device count, on any machine",
    epilog=OVERRIDES_HELP
    + " Exit code: 0 fits, 1 does not fit, 2 bad input, 70 XLA:GPU failed (its first line printed). "
    "Example: maxtext-moe compile h200x8/deepseek3-proxy-16b",
    description="Build the recipe's train step as `train` builds it (the same config, flag profile, patches, "
    "one process per GPU) and compile it with XLA:GPU for the recipe's GPU model at its full device count, "
    "with compile-only devices (the jax-cuda12 plugin, ./setup.sh --gpu-compile; no GPU needed). Prints per "
    "GPU: memory beside the planner's and whether it fits, collectives per step by kind (count, bytes, group "
    "size, async), host transfers, host syncs (conditionals outside command buffers, loops of unknown trip "
    "count), GEMM kinds and number formats, TE NCCL EP calls, compile seconds, and every substitution made "
    "(TE absent, an attention kernel). With Transformer Engine (./setup.sh --gpu-compile-te, then "
    ".venv-te/bin/maxtext-moe compile) TE's grouped GEMM, FP8 dense GEMMs and NCCL EP are compiled as the "
    "container runs them. Kernel choices are not autotuned without a GPU.",
  )
  p.add_argument("args", nargs="*", metavar="RECIPE [key=value]")
  add_nodes_option(p)
  p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
  p.add_argument("--hlo", metavar="DIR", help="also write the optimized HLO and the JSON report to DIR")
  p.add_argument(
    "--memory",
    metavar="GIB",
    help="the device memory XLA:GPU schedules the step for (default: the usable HBM, as on the GPUs). XLA's "
    "scheduler spends what it is given beyond the step's need on overlap (collectives and host copies "
    "started early); a smaller figure shows whether the step fits in it. 'planned': the planner's figure "
    "for the same config, what the planner is held to",
  )
  p.set_defaults(func=_compile)
