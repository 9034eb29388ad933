"""The commands that run or describe a training job: train, launch, config, recipes, flags, report."""

import argparse
import json
import os
from pathlib import Path
from typing import IO

from maxtext_moe.cluster.supervisor import NNODES
from maxtext_moe.errors import UserError

OVERRIDES_HELP = """Overrides use MaxText's key=value grammar, e.g.: maxtext-moe train cpu/deepseek3-tiny steps=20
run_name=demo. A key that the model file also sets needs override_model_config=true."""


NODES_HELP = (
  "nodes in the job (the YAML key nodes): the recipe's per-node (NVLink domain) layout N times, the DCN axis "
  "set to -1 taking the rest; default the recipe's own"
)


def split_recipe(args: list[str]) -> tuple[str | None, list[str]]:
  """First argument without '=' is the recipe; the rest are key=value overrides."""
  if args and "=" not in args[0]:
    return args[0], args[1:]
  return None, args


def add_nodes_option(p: argparse.ArgumentParser) -> None:
  """`--nodes N`, the one name of the job's node count on every command (the YAML key `nodes`)."""
  p.add_argument("--nodes", type=int, metavar="N", help=NODES_HELP)


def recipe_args(ns: argparse.Namespace, env: dict[str, str] | None = None) -> tuple[str | None, list[str]]:
  """(recipe, overrides) of a command's arguments, `--nodes N` as the override nodes=N (after the others).
  Under `launch --nnodes N` (its MAXTEXT_MOE_NNODES in `env`) a command given no node count runs on N."""
  recipe, overrides = split_recipe(ns.args)
  if getattr(ns, "nodes", None) is not None:
    overrides = [*overrides, f"nodes={ns.nodes}"]
  elif env and env.get(NNODES) and not any(o.startswith("nodes=") for o in overrides):
    overrides = [*overrides, f"nodes={env[NNODES]}"]
  return recipe, overrides


def _needs_recipe(ns: argparse.Namespace, command: str) -> tuple[str, list[str]]:
  recipe, overrides = recipe_args(ns)
  if recipe is None:
    raise UserError(f"{command} needs a RECIPE (see 'maxtext-moe recipes')")
  return recipe, overrides


def _train(ns: argparse.Namespace, out: IO[str]) -> int:
  from maxtext_moe.launch.train import Distributed, train

  recipe, overrides = recipe_args(ns, dict(os.environ))
  if ns.init_timeout <= 0:
    raise UserError(f"--init-timeout must be > 0 seconds, got {ns.init_timeout}")
  dist = Distributed(ns.coordinator, ns.num_processes, ns.process_id, ns.local_rank, ns.init_timeout)
  checked = train(recipe, overrides, verbose=ns.verbose, out=out, dist=dist, check_only=ns.check)
  if ns.check and checked.get("off_devices"):
    print(
      f"train {checked['recipe']}: checked off its GPUs: the config, the layout on {checked['devices']} GPUs, the "
      f"paths, data and tokenizer and a resume's layout pass, and it fits ({checked['plan']}); nothing was written",
      file=out,
    )
    print(f"  {checked['at_risk']}", file=out)
    print(f"  skipped (checked when the job starts): {'; '.join(checked['skipped'])}", file=out)
  elif ns.check:
    print(
      f"train {checked['recipe']}: the config resolves and every check before training passes on "
      f"{checked['devices']} device(s) in {checked['processes']} process(es); nothing was written",
      file=out,
    )
  return 0


def _launch(ns: argparse.Namespace, out: IO[str]) -> int:
  from maxtext_moe.cluster import supervisor

  command = ns.command[1:] if ns.command[:1] == ["--"] else ns.command
  job = supervisor.plan(
    dict(os.environ),
    nproc_per_node=ns.nproc_per_node,
    nnodes=ns.nnodes,
    node_rank=ns.node_rank,
    coordinator=ns.coordinator,
  )
  return supervisor.supervise(job, command, env=dict(os.environ), stdout=out)


def _config(ns: argparse.Namespace, out: IO[str]) -> int:
  from maxtext_moe.tools.show import show_config, show_keys

  if ns.keys:
    print(show_keys(), file=out)
    return 0
  recipe, overrides = _needs_recipe(ns, "config")
  print(show_config(recipe, overrides, show_all=ns.all), file=out)
  return 0


def _recipes(ns: argparse.Namespace, out: IO[str]) -> int:
  from maxtext_moe.config.recipes import DEFAULT_RECIPE, list_recipes

  del ns
  mark = out.isatty()  # a person reading gets the default marked; a pipe gets bare names
  for name in list_recipes():
    print(f"{name}{'  (default)' if mark and name == DEFAULT_RECIPE else ''}", file=out)
  return 0


def _flags(ns: argparse.Namespace, out: IO[str]) -> int:
  from maxtext_moe.config import checks, flags
  from maxtext_moe.upstream import resolution

  name, overrides = _needs_recipe(ns, "flags")
  recipe = resolution.read(name, [*overrides, *checks.WITHOUT_WEIGHTS])  # the flags do not depend on them
  recipe.resolve()  # the whole config must be valid, not only its flag keys
  run_flags = recipe.flags
  if not ns.no_check:
    flags.probe(run_flags.xla_flags)
  print(run_flags.export_lines(), file=out)
  return 0


def _report(ns: argparse.Namespace, out: IO[str]) -> int:
  from maxtext_moe.runlog import report  # pylint: disable=import-outside-toplevel
  from maxtext_moe.runlog.summary import format_summary  # pylint: disable=import-outside-toplevel

  summary, written = report.report(Path(ns.run_dir))
  if ns.json:
    print(json.dumps(summary | {"files": [str(p) for p in written]}), file=out)
  else:
    print(format_summary(summary), file=out)
    print(f"  pictures    {', '.join(str(p) for p in written)}", file=out)
  return 0


def _register_jobs(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
  p = sub.add_parser(
    "train",
    parents=[common],
    help="train a recipe (default: the tiny DeepSeek-V3-shaped model on CPU)",
    epilog=OVERRIDES_HELP,
    description="Run MaxText's trainer on RECIPE (default cpu/deepseek3-tiny) with key=value overrides. "
    "Writes Orbax checkpoints, metrics.jsonl and loss.png under base_output_directory/run_name; "
    "rerunning with the same run_name resumes from the last checkpoint.",
  )
  p.add_argument("args", nargs="*", metavar="[RECIPE] [key=value]")
  add_nodes_option(p)
  p.add_argument(
    "--check",
    action="store_true",
    help="resolve the config and run every check made before training (keys, layout, paths, MoE path), "
    "then stop: exit 0 or one line and exit 2, nothing written (SFT data is checked when training starts). "
    "Off the job's GPUs (a login node) a GPU recipe is checked for its own device count, with the memory "
    "plan, and what needs the devices is named as skipped",
  )
  g = p.add_argument_group(
    "multi-process jobs",
    "One process per GPU. Found by itself under SLURM (srun, one task per GPU) and under 'maxtext-moe launch' "
    "(and so in our Kubernetes manifests); otherwise give all three of --coordinator, --num-processes and "
    "--process-id. Process 0 writes the metrics, plot and summary; every process prints one line at start.",
  )
  g.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's host and a free port on it")
  g.add_argument("--num-processes", type=int, metavar="N", help="processes in the job")
  g.add_argument("--process-id", type=int, metavar="I", help="this process, 0..N-1")
  g.add_argument("--local-rank", type=int, metavar="R", help="this process's GPU on its node (default 0)")
  g.add_argument("--init-timeout", type=int, default=300, metavar="S", help="seconds to wait for the coordinator (300)")
  p.set_defaults(func=_train)

  p = sub.add_parser(
    "launch",
    parents=[common],
    help="start one process per GPU on this node and supervise them",
    description="Run COMMAND (a maxtext-moe command, usually 'train RECIPE ...') once per GPU on this node, "
    "each child told the coordinator, the process count (nodes x N), its process id and its GPU. SIGTERM and "
    "SIGINT are forwarded to every child; if one fails, the others are stopped and launch exits non-zero "
    "naming it. The node rank is --node-rank, else JOB_COMPLETION_INDEX (Kubernetes indexed Job/JobSet), "
    "else 0. Under SLURM use srun instead: it starts one task per GPU itself.",
    epilog="Example: maxtext-moe launch --nproc-per-node 8 -- train h200x8/deepseek3-proxy-16b steps=100",
  )
  p.add_argument("--nproc-per-node", type=int, required=True, metavar="N", help="processes (GPUs) on this node")
  p.add_argument(
    "--nnodes", "--nodes", type=int, dest="nnodes", help="nodes in the job (default: MAXTEXT_MOE_NNODES, else 1)"
  )
  p.add_argument("--node-rank", type=int, help="this node, 0..nnodes-1 (default: JOB_COMPLETION_INDEX, else 0)")
  p.add_argument(
    "--coordinator",
    metavar="HOST:PORT",
    help="node 0's address and a free port (default: MAXTEXT_MOE_COORDINATOR; one node: a free local port)",
  )
  p.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND", help="e.g. -- train RECIPE key=value")
  p.set_defaults(func=_launch)


def _register_inspection(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
  p = sub.add_parser(
    "config",
    parents=[common],
    help="print a recipe's resolved config (YAML)",
    epilog=OVERRIDES_HELP,
    description="Resolve RECIPE plus overrides without training and print, as YAML, the plugin's keys and "
    "every key whose value differs from MaxText's own base.yml (MaxText's value in a comment).",
  )
  p.add_argument("args", nargs="*", metavar="RECIPE [key=value]")
  add_nodes_option(p)
  p.add_argument("--all", action="store_true", help="print every key, not only the ones that differ")
  p.add_argument("--keys", action="store_true", help="list the plugin's own keys with their descriptions")
  p.set_defaults(func=_config)

  p = sub.add_parser(
    "flags",
    parents=[common],
    help="print a recipe's XLA/NCCL environment as export lines",
    epilog='Example, in a SLURM script: eval "$(maxtext-moe flags gb200-nvl72/deepseek3-671b)"',
    description="Resolve RECIPE plus overrides and print the `export` lines of its flag profile "
    "(configs/flags/profiles.yml, chosen by recipe_hardware or flag_profile) plus xla_flags_extra and "
    "env_extra. Every XLA flag is first checked against the installed jaxlib. `train` applies the same "
    "environment itself.",
  )
  p.add_argument("args", nargs="*", metavar="RECIPE [key=value]")
  add_nodes_option(p)
  p.add_argument("--no-check", action="store_true", help="skip checking the XLA flags against the installed jaxlib")
  p.set_defaults(func=_flags)

  p = sub.add_parser(
    "recipes",
    parents=[common],
    help="list the shipped recipes",
    description="List configs/recipes/<hw>/<model>, one per line (on a terminal the default is marked).",
  )
  p.set_defaults(func=_recipes)

  p = sub.add_parser(
    "report",
    parents=[common],
    help="a run directory's pictures and summary, rebuilt from its files",
    epilog="Example: maxtext-moe report runs/deepseek3-tiny-cpu-20261130-120000 --json",
    description="Read RUN_DIR's metrics.jsonl and moe_load.jsonl (nothing else: a run copied off a cluster "
    "works), rewrite loss.png, moe_load.png (experts x steps load per MoE layer) and moe_balance.png (max/mean "
    "load and routing-bias magnitude over steps), and print the loss, eval loss, median throughput, dropped "
    "tokens and the worst-balanced layer and step.",
  )
  p.add_argument("run_dir", metavar="RUN_DIR")
  p.add_argument("--json", action="store_true", help="print the summary as one JSON object")
  p.set_defaults(func=_report)


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
  _register_jobs(sub, common)
  _register_inspection(sub, common)
