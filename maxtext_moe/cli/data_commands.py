"""The commands about data: data show, data example, eval."""

import argparse
import json
import shutil
from pathlib import Path
from typing import IO

from maxtext_moe.cli.run_commands import OVERRIDES_HELP, _needs_recipe
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


def _data(ns: argparse.Namespace, out: IO[str]) -> int:
  if ns.action == "example":
    from maxtext_moe.data import arithmetic  # pylint: disable=import-outside-toplevel

    if not ns.out:
      raise UserError("data example needs --out DIR")
    dest = Path(ns.out)
    if dest.exists():
      raise UserError(f"--out {dest} exists; choose a new directory")
    shutil.copytree(arithmetic.example_dir(), dest)
    print(f"{dest}: train.jsonl, eval.jsonl, tokenizer/ (the cpu/deepseek3-tiny-sft example)", file=out)
    return 0
  from maxtext_moe.pretrain import text  # pylint: disable=import-outside-toplevel
  from maxtext_moe.sft import prepare as sft_data  # pylint: disable=import-outside-toplevel

  if ns.rows < 1:
    raise UserError(f"--rows must be at least 1, got {ns.rows}")
  cfg = _resolved(ns, "data show", weights=False)
  if sft_data.applies(cfg) or cfg.use_sft:
    sft_data.show(cfg, rows=ns.rows, out=out)
  else:  # pretraining text: the rows MaxText's grain pipeline packs
    text.show(cfg, rows=ns.rows, out=out)
  return 0


def _eval(ns: argparse.Namespace, out: IO[str]) -> int:
  from maxtext_moe.tools import evaluate  # pylint: disable=import-outside-toplevel

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
    help="show training data (SFT or pretraining text) as the model sees it, or write the SFT example",
    epilog="Examples: maxtext-moe data show cpu/deepseek3-tiny-sft --rows 2; maxtext-moe data show "
    "cpu/deepseek3-tiny grain_train_files=corpus.jsonl tokenizer_type=huggingface tokenizer_path=TOK "
    "vocab_from_tokenizer=true",
    description="show: check every row of the recipe's training files (as train does) and print the first "
    "rows of the first batch MaxText's grain pipeline builds from them. SFT conversations: the chat "
    "template and packing, the tokens that carry loss between [[ and ]]. Pretraining text (one text column "
    "of JSONL or Parquet): each packed row's documents, decoded. example: copy the embedded SFT example "
    "(two-digit addition conversations, train and held-out splits, a character-level chat tokenizer) to --out.",
  )
  p.add_argument("action", choices=["show", "example"])
  p.add_argument("args", nargs="*", metavar="RECIPE [key=value]")
  p.add_argument("--rows", type=int, default=3, help="show: packed rows to print (default 3)")
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
  p.add_argument("--split", choices=["eval", "train"], default="eval", help="which files to score (default eval)")
  p.add_argument("--limit", type=int, help="score only the first N conversations")
  p.add_argument("--json", action="store_true", help="print the report as one JSON object")
  p.set_defaults(func=_eval)
