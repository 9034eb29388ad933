"""The commands about data: data show, data check, data example, eval."""

import argparse
import json
import shutil
from pathlib import Path
from typing import IO

from maxtext_moe.cli.run_commands import OVERRIDES_HELP, _needs_recipe, add_nodes_option
from maxtext_moe.errors import UserError


def _resolved(ns: argparse.Namespace, command: str, *, weights: bool = True):
  from maxtext_moe.launch.preflight import check_inputs  # pylint: disable=import-outside-toplevel
  from maxtext_moe.upstream import resolution  # pylint: disable=import-outside-toplevel

  recipe, overrides = _needs_recipe(ns, command)
  if not weights:  # the data alone: a fine-tuning recipe need not name its checkpoint
    overrides = [*overrides, "finetune=false"]
  cfg = resolution.read(recipe, overrides).resolve()
  check_inputs(cfg)
  return cfg


def _training_data(ns: argparse.Namespace, command: str):
  """The recipe resolved and checked as `train` checks it before it reads a row (MaxText's own checks
  included), without its weights: what `data show` and `data check` read."""
  from maxtext_moe.upstream.maxtext import trainer  # pylint: disable=import-outside-toplevel

  cfg = _resolved(ns, command, weights=False)
  trainer.validate(cfg)
  return cfg


def _example(ns: argparse.Namespace, out: IO[str]) -> int:
  from maxtext_moe.data import arithmetic  # pylint: disable=import-outside-toplevel

  if not ns.out:
    raise UserError("data example needs --out DIR")
  dest = Path(ns.out)
  if dest.exists():
    raise UserError(f"--out {dest} exists; choose a new directory")
  shutil.copytree(arithmetic.example_dir(), dest)
  print(f"{dest}: train.jsonl, eval.jsonl, tokenizer/ (the cpu/deepseek3-tiny-sft example)", file=out)
  return 0


def _check(ns: argparse.Namespace, out: IO[str]) -> int:
  import jax  # pylint: disable=import-outside-toplevel

  from maxtext_moe.tools import data_check  # pylint: disable=import-outside-toplevel

  if ns.epochs is not None and ns.epochs < 1:
    raise UserError(f"--epochs must be at least 1, got {ns.epochs}")
  cfg = _training_data(ns, "data check")
  devices = (
    int(cfg.recipe_num_devices)
    if int(cfg.recipe_num_devices) > 0
    else jax.local_device_count() * max(int(cfg.nodes), 1)
  )
  data_check.check(cfg, devices=devices, epochs=ns.epochs, out=out)
  return 0


def _data(ns: argparse.Namespace, out: IO[str]) -> int:
  if ns.action == "example":
    return _example(ns, out)
  if ns.action == "check":
    return _check(ns, out)
  from maxtext_moe.pretrain import text  # pylint: disable=import-outside-toplevel
  from maxtext_moe.sft import prepare as sft_data  # pylint: disable=import-outside-toplevel

  if ns.rows < 1:
    raise UserError(f"--rows must be at least 1, got {ns.rows}")
  cfg = _training_data(ns, "data show")
  if sft_data.applies(cfg) or cfg.use_sft:
    sft_data.show(cfg, rows=ns.rows, out=out)
  else:  # pretraining text: the rows MaxText's grain pipeline packs
    text.show(cfg, rows=ns.rows, out=out)
  return 0


def _eval(ns: argparse.Namespace, out: IO[str]) -> int:
  from maxtext_moe.tools import evaluate  # pylint: disable=import-outside-toplevel

  if ns.nodes is not None:
    raise UserError(
      f"--nodes {ns.nodes}: eval scores the checkpoint on this machine's devices, whatever the job's nodes "
      "(the checkpoint loads on any device count); leave --nodes out"
    )
  if ns.limit is not None and ns.limit < 1:
    raise UserError(f"--limit must be at least 1, got {ns.limit}")
  report = evaluate.evaluate(_resolved(ns, "eval"), split=ns.split, limit=ns.limit)
  if ns.json:
    print(json.dumps(report), file=out)
  else:
    evaluate.format_report(report, out)
  return 0


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
  p = sub.add_parser(
    "data",
    parents=[common],
    help="show training data (SFT or pretraining text) as the model sees it, check every row, or write the SFT example",
    epilog="Examples: maxtext-moe data show cpu/deepseek3-tiny-sft --rows 2; maxtext-moe data check "
    "cpu/deepseek3-tiny grain_train_files=corpus.jsonl tokenizer_type=huggingface tokenizer_path=TOK "
    "vocab_from_tokenizer=true",
    description="show: print the first rows of the first batch MaxText's grain pipeline builds from the "
    "recipe's training files (reading only the rows that batch needs; SFT conversations are all checked, as "
    "train checks them). SFT conversations: the chat template and packing, the tokens that carry loss between "
    "[[ and ]]. Pretraining text (one text column of JSONL or Parquet): each packed row's documents, decoded. "
    "check: read every row once in bounded memory (a progress line on standard error every 30 s), checked as "
    "train checks it and tokenized as MaxText's pipeline does, and print the rows and tokens of an epoch and "
    "the steps one and num_epoch (or --epochs) epochs take at the job's global batch (--nodes); the first "
    "bad row is one line naming its file and row, exit 2. example: copy the embedded SFT example (two-digit "
    "addition conversations, train and held-out splits, a character-level chat tokenizer) to --out.",
  )
  p.add_argument("action", choices=["show", "check", "example"])
  p.add_argument("args", nargs="*", metavar="RECIPE [key=value]")
  add_nodes_option(p)
  p.add_argument("--rows", type=int, default=3, help="show: packed rows to print (default 3)")
  p.add_argument("--epochs", type=int, help="check: the epochs to count steps for (default the recipe's num_epoch)")
  p.add_argument("--out", help="example: a new directory to write")
  p.set_defaults(func=_data)

  p = sub.add_parser(
    "eval",
    parents=[common],
    help="a checkpoint on held-out conversations: completion loss, exact match (greedy)",
    epilog=OVERRIDES_HELP
    + " Example: maxtext-moe eval cpu/deepseek3-tiny-sft load_parameters_path=runs/RUN/checkpoints/120/items",
    description="Load the checkpoint at load_parameters_path and, for each held-out conversation "
    "(grain_eval_files; --split train for the training files), score its last assistant turn: the mean "
    "cross-entropy of its tokens given the prompt, and whether greedy decoding reproduces it exactly, "
    "end-of-turn marker included.",
  )
  p.add_argument("args", nargs="*", metavar="RECIPE [key=value]")
  p.add_argument("--nodes", type=int, metavar="N", help="refused: eval runs on this machine's devices")
  p.add_argument("--split", choices=["eval", "train"], default="eval", help="which files to score (default eval)")
  p.add_argument("--limit", type=int, help="score only the first N conversations")
  p.add_argument("--json", action="store_true", help="print the report as one JSON object")
  p.set_defaults(func=_eval)
