"""Chat conversations for supervised fine-tuning: read from JSONL or Parquet, checked, staged for MaxText.

A conversation is `{"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}` (the format
the Hugging Face ecosystem uses): at most one system turn, first; at least one assistant turn, since only
assistant turns carry loss. Every row is checked before training, so a bad row is one line naming its file
and line, not an assertion deep in a data-loader thread mid-run.

MaxText's grain reader takes Parquet, TFRecord and ArrayRecord, not JSON: JSONL files are written as Parquet
under the cache directory (keyed by the files' paths, sizes and modification times) once per node, a row
group at a time (`data.staging.stream`, each turn's role and content: `SHAPE`), and the run reads that.
No task holds a split: the one that stages holds a row group, and each keeps the first conversations the
launcher measures (`read_split`'s `keep`).
"""

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from maxtext_moe.data import staging
from maxtext_moe.data.staging import JSON_SUFFIXES
from maxtext_moe.errors import UserError
from maxtext_moe.upstream.maxtext import chat

ROLES = ("system", "user", "assistant")
COLUMN = "messages"


@dataclass
class Split:
  """One split's files as read: the conversations (for the token checks) and what MaxText should read."""

  name: str  # "training" or "held-out"
  conversations: list[tuple[str, list[dict]]] = field(default_factory=list)  # (where, messages), the first
  total: int = 0  # conversations in the split
  pattern: str | None = None  # the staged Parquet files' glob, for JSONL input (None: read the files as given)


def check_messages(messages: Any, where: str) -> None:
  """One line naming the row and what is wrong with it."""
  if not isinstance(messages, list) or not messages:
    raise UserError(f"{where}: '{COLUMN}' must be a non-empty list of {{role, content}} turns")
  for i, turn in enumerate(messages):
    if not isinstance(turn, dict) or not isinstance(turn.get("role"), str) or not isinstance(turn.get("content"), str):
      raise UserError(f"{where}: turn {i} needs a 'role' and a 'content' string")
    if turn["role"] not in ROLES:
      raise UserError(f"{where}: turn {i} has the unknown role '{turn['role']}'; SFT turns are {', '.join(ROLES)}")
    if turn["role"] == "system" and i:
      raise UserError(f"{where}: the system turn is turn {i}; it must come first")
  if not any(t["role"] == "assistant" for t in messages):
    raise UserError(f"{where}: no assistant turn, so nothing to train on; every conversation needs one")


def _chars(turns: list[dict]) -> int:
  return sum(len(turn["content"]) for turn in turns)


def _checked(row: dict, where: str) -> None:
  check_messages(row[COLUMN], where)


TURN = pa.struct([("role", pa.string()), ("content", pa.string())])
# A staged conversation: its turns' roles and contents, what the chat template is given (`chat.turns`).
SHAPE = staging.Shape(pa.list_(TURN), chat.turns, _chars, "SFT data", "a list of role/content turns")


def rows(path: Path) -> Iterator[tuple[str, dict]]:
  """(where, row) of a JSONL or Parquet file, each row with a `messages` field."""
  return staging.rows(path, COLUMN, SHAPE.what, SHAPE.each)


def stage(paths: list[Path]) -> str:
  """The JSONL files `paths` staged as Parquet once per node, streamed, every conversation checked
  (`data.staging.stream`); the glob MaxText reads."""
  return staging.stream(paths, kind="sft-staged", column=COLUMN, check=_checked, shape=SHAPE)


def _first(split: Split, paths: list[Path], keep: int, *, to_end: bool) -> None:
  """The first `keep` conversations of `paths` into `split`, each checked; with `to_end`, every row is
  checked and counted."""
  for path in paths:
    for where, row in rows(path):
      if len(split.conversations) >= keep and not to_end:
        return
      check_messages(row[COLUMN], where)
      split.total += 1
      if len(split.conversations) < keep:
        split.conversations.append((where, chat.turns(row[COLUMN])))


def read_split(name: str, files: list[str], *, keep: int) -> Split:
  """Checks every conversation of `files`, keeps the first `keep` (for the token checks), and gives the
  pattern MaxText should read (the files are all JSONL, staged as Parquet, or all Parquet)."""
  split = Split(name)
  paths = [Path(f) for f in files]
  kinds = {p.suffix in JSON_SUFFIXES for p in paths}
  if len(kinds) > 1:
    raise UserError(f"the {name} files mix JSONL and Parquet ({', '.join(files[:4])}); use one format per split")
  if kinds != {True}:
    _first(split, paths, keep, to_end=True)
    return split
  split.pattern = stage(paths)  # every row checked, once per node
  _first(split, paths, keep, to_end=False)
  split.total = staging.staged_rows(split.pattern)
  return split
