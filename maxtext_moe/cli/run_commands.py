"""The commands that run or describe a training job: train, config, recipes, flags."""

import argparse
from typing import IO

from maxtext_moe.errors import UserError

OVERRIDES_HELP = """Overrides use MaxText's key=value grammar, e.g.: maxtext-moe train cpu/deepseek3-tiny steps=20
run_name=demo. A key that the model file also sets needs override_model_config=true."""


def split_recipe(args: list[str]) -> tuple[str | None, list[str]]:
  """First argument without '=' is the recipe; the rest are key=value overrides."""
  if args and "=" not in args[0]:
    return args[0], args[1:]
  return None, args


def _needs_recipe(args: list[str], command: str) -> tuple[str, list[str]]:
  recipe, overrides = split_recipe(args)
  if recipe is None:
    raise UserError(f"{command} needs a RECIPE (see 'maxtext-moe recipes')")
  return recipe, overrides


def _train(ns: argparse.Namespace, out: IO[str]) -> int:
  from maxtext_moe.launch.train import train

  recipe, overrides = split_recipe(ns.args)
  train(recipe, overrides, verbose=ns.verbose, out=out)
  return 0


def _config(ns: argparse.Namespace, out: IO[str]) -> int:
  from maxtext_moe.launch.show import show_config, show_keys

  if ns.keys:
    print(show_keys(), file=out)
    return 0
  recipe, overrides = _needs_recipe(ns.args, "config")
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
  from maxtext_moe.config import flags
  from maxtext_moe.launch.train import read_launch

  recipe, overrides = _needs_recipe(ns.args, "flags")
  launch = read_launch(recipe, overrides)
  launch.resolve()  # the whole config must be valid, not only its flag keys
  run_flags = flags.for_config(launch.keys.plugin)
  if not ns.no_check:
    flags.probe(run_flags.xla_flags)
  print(run_flags.export_lines(), file=out)
  return 0


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
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
  p.set_defaults(func=_train)

  p = sub.add_parser(
    "config",
    parents=[common],
    help="print a recipe's resolved config (YAML)",
    epilog=OVERRIDES_HELP,
    description="Resolve RECIPE plus overrides without training and print, as YAML, the plugin's keys and "
    "every key whose value differs from MaxText's own base.yml (MaxText's value in a comment).",
  )
  p.add_argument("args", nargs="*", metavar="RECIPE [key=value]")
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
  p.add_argument("--no-check", action="store_true", help="skip checking the XLA flags against the installed jaxlib")
  p.set_defaults(func=_flags)

  p = sub.add_parser(
    "recipes",
    parents=[common],
    help="list the shipped recipes",
    description="List configs/recipes/<hw>/<model>, one per line (on a terminal the default is marked).",
  )
  p.set_defaults(func=_recipes)
