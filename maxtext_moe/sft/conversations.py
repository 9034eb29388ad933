"""Chat conversations for supervised fine-tuning: read from JSONL or Parquet, checked, staged for MaxText.

A conversation is `{"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}` (the format
the Hugging Face ecosystem uses): at most one system turn, first; at least one assistant turn, since only
assistant turns carry loss. Every row is checked before training, so a bad row is one line naming its file
and line, not an assertion deep in a data-loader thread mid-run.

MaxText's grain reader takes Parquet, TFRecord and ArrayRecord, not JSON: a JSONL file is written once as
Parquet under the cache directory (keyed by the files' paths, sizes and modification times) and the run
reads that.
"""

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from maxtext_moe.data.corpus import cache_dir
from maxtext_moe.errors import UserError

ROLES = ("system", "user", "assistant")
JSON_SUFFIXES = (".jsonl", ".json")
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


def _jsonl_rows(
  path: Path, column: str = COLUMN, what: str = "a list of role/content turns"
) -> Iterator[tuple[str, dict]]:
  with open(path, encoding="utf-8") as f:
    for n, line in enumerate(f, 1):
      if not line.strip():
        continue
      where = f"{path} line {n}"
      try:
        row = json.loads(line)
      except json.JSONDecodeError as e:
        raise UserError(f"{where}: not valid JSON ({e.msg}); each line must be one JSON object") from None
      if not isinstance(row, dict) or column not in row:
        keys = ", ".join(row) if isinstance(row, dict) else type(row).__name__
        raise UserError(f"{where}: no '{column}' field (has: {keys}); each line needs {what}")
      yield where, row


def _parquet_rows(path: Path, column: str = COLUMN, what: str = "SFT data") -> Iterator[tuple[str, dict]]:
  try:
    pf = pq.ParquetFile(path)
  except (pa.ArrowException, OSError) as e:
    raise UserError(f"{path}: not a readable Parquet file ({str(e).splitlines()[0]})") from None
  names = pf.schema_arrow.names
  if column not in names:
    raise UserError(f"{path} has no '{column}' column (columns: {', '.join(names)}); {what} needs one")
  n = 0
  for batch in pf.iter_batches(columns=[column]):
    for row in batch.to_pylist():
      yield f"{path} row {n}", row
      n += 1


def rows(path: Path, column: str = COLUMN, what: str = "SFT data") -> Iterator[tuple[str, dict]]:
  """(where, row) of a JSONL or Parquet file, each row with a `column` field (`messages`)."""
  if path.suffix in JSON_SUFFIXES:
    return _jsonl_rows(path, column) if column == COLUMN else _jsonl_rows(path, column, f"a '{column}' string")
  if path.suffix == ".parquet":
    return _parquet_rows(path, column, what)
  raise UserError(f"{path}: {what} must be .jsonl or .parquet files")


def staged_dir(paths: list[Path], kind: str = "sft-staged") -> Path:
  """Where `paths` are staged as Parquet: under the cache, keyed by their paths, sizes and times."""
  key = hashlib.sha256()
  for path in paths:
    st = path.stat()
    key.update(f"{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
  return cache_dir() / kind / key.hexdigest()[:24]


def _write_parquet(conversations: list[list[dict]], out: Path) -> None:
  turn = pa.struct([("role", pa.string()), ("content", pa.string())])
  pq.write_table(pa.table({COLUMN: pa.array(conversations, type=pa.list_(turn))}), out)


def stage(paths: list[Path], conversations: list[Any], *, kind: str = "sft-staged", write: Any = None) -> str:
  """The JSONL files `paths` (their checked rows: `conversations`, one list per file) as one Parquet file
  each (`write(rows, out)`; conversations by default), in a directory written once, atomically; returns
  the glob pattern grain reads."""
  out = staged_dir(paths, kind)
  write = write or _write_parquet
  if not out.is_dir():
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    try:
      for i, convs in enumerate(conversations):
        write(convs, tmp / f"part-{i:05d}.parquet")
      try:
        os.rename(tmp, out)
      except OSError:  # another process of the job staged it first
        if not out.is_dir():
          raise
    finally:
      shutil.rmtree(tmp, ignore_errors=True)
  return str(out / "*.parquet")


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
