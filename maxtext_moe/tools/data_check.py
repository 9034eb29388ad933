"""`maxtext-moe data check RECIPE [key=value ...]`: every row of the recipe's training files read once, in
bounded memory (a row at a time: JSONL by line, Parquet by record batch), checked as the run checks it and
tokenized as the trainer tokenizes it (a document by MaxText's tokenizer; a conversation whole by its chat
template, once for the check and the count), with a progress line on standard error every PROGRESS_S
seconds. It prints the rows and tokens of one epoch, the sequences they fill and so the steps an epoch and
`num_epoch` (or --epochs) epochs take at the job's global batch. The first bad row is one line (exit 2).

Why counted here and not by running MaxText's pipeline to its end: its grain sources hold their rows in
memory or read Parquet only, and its packer is what a count would cost most for. Without packing the
count is exact (a document's chunks of max_target_length, one sequence per conversation); with packing a
row holds at most max_target_length tokens, so the tokens give a lower bound of the sequences, and the
data lasts at least the steps printed.
"""

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from maxtext_moe.errors import UserError

PROGRESS_S = 30.0


@dataclass
class Tally:
  """What one split's files hold (`pieces`: the sequences they make without packing)."""

  files: int = 0
  rows: int = 0
  tokens: int = 0
  pieces: int = 0


@dataclass
class TextCount:
  """A pretraining row checked (`check`, the run's) and its tokens as MaxText's pipeline makes them: the
  whole document in chunks of `length` (`TokenizeAndChunk`), or its first `length` tokens with
  use_truncation (`TokenizeAndTrim`)."""

  check: Any
  tokenizer: Any
  length: int
  truncate: bool

  def __call__(self, row: dict, where: str) -> tuple[int, int]:
    self.check(row, where)
    n = len(self.tokenizer.encode(row[self.check.column]))
    if self.truncate:
      return min(n, self.length), int(n > 0)
    return n, -(-n // self.length)


@dataclass
class ConversationCount:
  """An SFT row checked and rendered once, as the run checks it and the trainer renders it
  (`sft.prepare.row_check`: the whole conversation through the chat template), its tokens cut at `length`
  (one sequence each)."""

  check: Any
  length: int

  def __call__(self, row: dict, where: str) -> tuple[int, int]:
    chunks, _ = self.check.rendered(row.get(self.check.column), where)
    return min(sum(len(c) for c in chunks), self.length), 1


def _progress(tally: Tally, of: int, started: float, err: IO[str]) -> None:
  minutes = (time.monotonic() - started) / 60
  print(
    f"maxtext-moe: data check: file {tally.files} of {of}, {tally.rows:,} rows, {tally.tokens:,} tokens so far "
    f"({minutes:.0f} min)",
    file=err,
    flush=True,
  )


def scan(paths: list[Path], column: str, count: Any, err: IO[str] = sys.stderr) -> Tally:
  """Every row of `paths`, checked and counted (`count(row, where)`: its tokens and sequences, or UserError
  for the first bad one)."""
  from maxtext_moe.data import staging  # pylint: disable=import-outside-toplevel

  tally, started = Tally(), time.monotonic()
  said = started
  for path in paths:
    tally.files += 1
    for where, row in staging.rows(path, column, "training data", f"a '{column}' field"):
      tokens, pieces = count(row, where)
      tally.rows, tally.tokens, tally.pieces = tally.rows + 1, tally.tokens + tokens, tally.pieces + pieces
      if time.monotonic() - said >= PROGRESS_S:
        said = time.monotonic()
        _progress(tally, len(paths), started, err)
  return tally


def _split(cfg: Any) -> tuple[list[Path], str, Any]:
  """(the training files, their column, the row check and counter) of `cfg`'s data."""
  from maxtext_moe.pretrain import text  # pylint: disable=import-outside-toplevel
  from maxtext_moe.sft import prepare as sft  # pylint: disable=import-outside-toplevel
  from maxtext_moe.upstream.maxtext import sft_data  # pylint: disable=import-outside-toplevel
  from maxtext_moe.upstream.maxtext.config import hyperparameters  # pylint: disable=import-outside-toplevel

  length = int(cfg.max_target_length)
  if sft.applies(cfg):
    hf, _ = sft.checked_tokenizer(cfg)
    check = sft.row_check(hf)
    paths = text.local_files(str(cfg.grain_train_files), "grain_train_files", check.column, text=False)
    return _local(paths, cfg), check.column, ConversationCount(check, length)
  if not text.applies(cfg):
    raise UserError(
      "data check reads text data: an *-sft recipe, or dataset_type=grain with one text column "
      "(train_data_columns=[text]) and JSONL or Parquet files"
    )
  text.check_vocab(cfg)
  check = text.row_check(cfg)
  paths = text.local_files(str(cfg.grain_train_files), "grain_train_files", check.column)
  tokenizer = sft_data.encoder(hyperparameters(cfg))
  return _local(paths, cfg), check.column, TextCount(check, tokenizer, length, bool(cfg.use_truncation))


def _local(paths: list[Path] | None, cfg: Any) -> list[Path]:
  if paths is None:
    raise UserError(f"grain_train_files={cfg.grain_train_files}: data check reads local files")
  return paths


def report(cfg: Any, tally: Tally, *, devices: int, epochs: int) -> list[str]:
  """The lines `data check` prints for `tally` at `cfg`'s global batch on `devices` devices."""
  from maxtext_moe.config.nodes import global_batch  # pylint: disable=import-outside-toplevel

  length, packed = int(cfg.max_target_length), bool(cfg.packing)
  batch = global_batch(cfg.per_device_batch_size, devices, cfg.gradient_accumulation_steps)
  sequences = -(-tally.tokens // length) if packed else tally.pieces
  steps = sequences // batch
  bound = "at least " if packed else ""
  each = "conversation" if cfg.use_sft else "document" if cfg.use_truncation else "chunk"
  return [
    f"grain_train_files={cfg.grain_train_files}: {tally.files:,} file(s), {tally.rows:,} rows, every one usable; "
    f"{tally.tokens:,} tokens an epoch",
    f"  an epoch fills {bound}{sequences:,} sequences of max_target_length={length:,} "
    f"({'packed' if packed else 'one per ' + each}): {bound}{steps:,} steps "
    f"at the global batch of {batch:,} sequences ({devices:,} device(s))",
    f"  {epochs} epoch(s): {bound}{steps * epochs:,} steps; steps={steps * epochs} or fewer never runs out of data "
    f"(num_epoch={epochs})",
  ]


def check(cfg: Any, *, devices: int, epochs: int | None, out: IO[str], err: IO[str] = sys.stderr) -> None:
  """`data check`: every training row of `cfg` read, checked and counted; the report on `out`."""
  paths, column, count = _split(cfg)
  tally = scan(paths, column, count, err)
  if not tally.rows:
    raise UserError(f"grain_train_files={cfg.grain_train_files} holds no rows")
  for line in report(cfg, tally, devices=devices, epochs=int(cfg.num_epoch) if epochs is None else epochs):
    print(line, file=out)
