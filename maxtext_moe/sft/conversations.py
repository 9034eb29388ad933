"""Chat conversations for supervised fine-tuning: read from JSONL or Parquet, checked, staged for MaxText.

A conversation is `{"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}` (the format
the Hugging Face ecosystem uses): at most one system turn, first; at least one assistant turn, since only
assistant turns carry loss. Every row is checked before training, so a bad row is one line naming its file
and line, not an assertion deep in a data-loader thread mid-run.

MaxText's grain reader takes Parquet, TFRecord and ArrayRecord, not JSON: a JSONL file is written once as
Parquet under the cache directory (keyed by the files' paths, sizes and modification times) and the run
reads that.
"""

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from maxtext_moe.data import staging
from maxtext_moe.data.staging import JSON_SUFFIXES
from maxtext_moe.errors import UserError

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


def _write_parquet(conversations: list[list[dict]], out: Path) -> None:
  turn = pa.struct([("role", pa.string()), ("content", pa.string())])
  pq.write_table(pa.table({COLUMN: pa.array(conversations, type=pa.list_(turn))}), out)


def rows(path: Path) -> Iterator[tuple[str, dict]]:
  """(where, row) of a JSONL or Parquet file, each row with a `messages` field."""
  return staging.rows(path, COLUMN, "SFT data", "a list of role/content turns")


def stage(paths: list[Path], conversations: list[list[list[dict]]]) -> str:
  """The JSONL files `paths` (their checked `conversations`) staged as Parquet (`data.staging.stage`)."""
  return staging.stage(paths, conversations, kind="sft-staged", write=_write_parquet)


def read_split(name: str, files: list[str], *, keep: int) -> Split:
  """Checks every conversation of `files`, keeps the first `keep` (for the token checks), and gives the
  pattern MaxText should read (JSONL staged as Parquet; the files are all JSONL or all Parquet)."""
  split = Split(name)
  paths = [Path(f) for f in files]
  kinds = {p.suffix in JSON_SUFFIXES for p in paths}
  if len(kinds) > 1:
    raise UserError(f"the {name} files mix JSONL and Parquet ({', '.join(files[:4])}); use one format per split")
  jsonl = kinds == {True}
  staged = []
  for path in paths:
    whole = []
    for where, row in rows(path):
      check_messages(row[COLUMN], where)
      turns = [{"role": t["role"], "content": t["content"]} for t in row[COLUMN]]
      split.total += 1
      if len(split.conversations) < keep:
        split.conversations.append((where, turns))
      if jsonl:
        whole.append(turns)
    staged.append(whole)
  split.pattern = stage(paths, staged) if jsonl else None
  return split
