"""Training data files read before MaxText's grain reader sees them: JSONL or Parquet rows, each with one
named field, and JSONL staged as Parquet (grain reads Parquet, TFRecord and ArrayRecord, not JSON) under the
cache directory, keyed by the files' paths, sizes and modification times. Used by SFT conversations
(`sft.conversations`) and pretraining text (`pretrain.text`).

Staging happens once per node: the first process to take the staging lock (`locks`, an flock next to the
staged directory) writes it, the node's other processes wait on the lock and then find it written. The
directory is written under a temporary name (with the host's name; what a killed stager of this host left
is removed by the next) and renamed, so it is there complete or not at all: its existence is the marker.
`stream` reads each JSONL file a line at a time and writes Parquet row groups of at most ROWS_PER_GROUP rows
or GROUP_CHARS characters of text (pyarrow's ParquetWriter), so a file of any size stages in bounded
memory: pretraining text (`TEXT`) and SFT conversations (their `Shape`, `sft.conversations`) alike.
`sources.json` in the staged directory names each part's JSONL file, so that a row found bad later is
named by its own file and line.
"""

import functools
import hashlib
import json
import os
import shutil
import socket
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from maxtext_moe import locks
from maxtext_moe.data.corpus import cache_dir
from maxtext_moe.errors import UserError

JSON_SUFFIXES = (".jsonl", ".json")
SOURCES = "sources.json"
ROWS_PER_GROUP = 10_000
GROUP_CHARS = 64 * 2**20
STAGE_WAIT_S = 7 * 24 * 3600.0  # the node's other processes wait for the one staging, however long it takes


def _same(value: Any) -> Any:
  return value


@dataclass(frozen=True)
class Shape:
  """What a staged file's one column holds: its Arrow type, the value staged from a checked row's field,
  the characters that value counts toward GROUP_CHARS, and how an error names the data (`what`) and what a
  JSONL line needs (`each`, its `{column}` the column's name)."""

  type: pa.DataType
  value: Callable[[Any], Any]
  chars: Callable[[Any], int]
  what: str
  each: str


TEXT = Shape(pa.string(), _same, len, "text data", "a '{column}' string")  # pretraining text: the string as it is


def _jsonl_rows(path: Path, column: str, what: str) -> Iterator[tuple[str, dict]]:
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


def _parquet_rows(path: Path, column: str, what: str) -> Iterator[tuple[str, dict]]:
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


def rows(path: Path, column: str, what: str, each: str) -> Iterator[tuple[str, dict]]:
  """(where, row) of a JSONL or Parquet file, each row with a `column` field (`what`: the data, as an error
  names it; `each`: what a JSONL line must hold)."""
  if path.suffix in JSON_SUFFIXES:
    return _jsonl_rows(path, column, each)
  if path.suffix == ".parquet":
    return _parquet_rows(path, column, what)
  raise UserError(f"{path}: {what} must be .jsonl or .parquet files")


def staged_dir(paths: list[Path], kind: str) -> Path:
  """Where `paths` are staged as Parquet: under the cache, keyed by their paths, sizes and times."""
  key = hashlib.sha256()
  for path in paths:
    st = path.stat()
    key.update(f"{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
  return cache_dir() / kind / key.hexdigest()[:24]


def source_of(part: Path) -> Path | None:
  """The JSONL file a staged Parquet part was written from (None: `part` is not a staged file)."""
  try:
    names = json.loads((part.parent / SOURCES).read_text())
  except (OSError, ValueError):
    return None
  return Path(names[part.name]) if isinstance(names, dict) and part.name in names else None


def _part(i: int) -> str:
  return f"part-{i:05d}.parquet"


def _once(paths: list[Path], kind: str, fill: Callable[[Path], None]) -> str:
  """The staged directory of `paths`, written by `fill(tmp)` once per node (see the module docstring);
  returns the glob pattern grain reads."""
  out = staged_dir(paths, kind)
  lock = out.parent / f".{out.name}.lock"
  if not out.is_dir():
    locks.acquire(lock, what=f"staging {out}", wait_s=STAGE_WAIT_S)
    try:
      if not out.is_dir():  # else another process of this node staged it while this one waited
        _publish(out, paths, fill)
    finally:
      locks.release(lock, remove=True)
  return str(out / "*.parquet")


def _publish(out: Path, paths: list[Path], fill: Callable[[Path], None]) -> None:
  size = sum(p.stat().st_size for p in paths)
  print(
    f"maxtext-moe: staging {len(paths)} JSONL file(s), {size / 1e9:,.2f} GB, as Parquet in {out} (once per node)",
    file=sys.stderr,
    flush=True,
  )
  out.parent.mkdir(parents=True, exist_ok=True)
  mine = f".{out.name}.{socket.gethostname()}."
  for left in out.parent.glob(f"{mine}*"):  # a stager of this host killed mid-write (this one holds its lock)
    shutil.rmtree(left, ignore_errors=True)
  tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=mine))
  try:
    fill(tmp)
    (tmp / SOURCES).write_text(json.dumps({_part(i): str(p.resolve()) for i, p in enumerate(paths)}) + "\n")
    try:
      os.rename(tmp, out)
    except OSError:  # another node staged it first on a shared cache
      if not out.is_dir():
        raise
  finally:
    shutil.rmtree(tmp, ignore_errors=True)


def _write_group(writer: pq.ParquetWriter, column: str, values: list[Any], shape: Shape) -> None:
  writer.write_table(pa.table({column: pa.array(values, type=shape.type)}))


def _write_streamed(path: Path, out: Path, column: str, check: Callable[[dict, str], None], shape: Shape) -> None:
  """One JSONL file as Parquet, `check(row, where)` on each row, a row group at a time."""
  with pq.ParquetWriter(out, pa.schema([(column, shape.type)])) as writer:
    held: list[Any] = []
    chars = 0
    for where, row in rows(path, column, shape.what, shape.each.format(column=column)):
      check(row, where)
      held.append(shape.value(row[column]))
      chars += shape.chars(held[-1])
      if len(held) >= ROWS_PER_GROUP or chars >= GROUP_CHARS:
        _write_group(writer, column, held, shape)
        held, chars = [], 0
    if held:
      _write_group(writer, column, held, shape)


def _write_all_streamed(
  paths: list[Path], column: str, check: Callable[[dict, str], None], shape: Shape, tmp: Path
) -> None:
  for i, path in enumerate(paths):
    _write_streamed(path, tmp / _part(i), column, check, shape)


def stream(
  paths: list[Path], *, kind: str, column: str, check: Callable[[dict, str], None], shape: Shape = TEXT
) -> str:
  """The JSONL files `paths` staged once per node as Parquet with one `column` (`shape`: text unless
  given), streamed a row group at a time, every row checked (`check(row, where)` raises UserError naming
  it); the glob grain reads."""
  return _once(paths, kind, functools.partial(_write_all_streamed, paths, column, check, shape))


def staged_rows(pattern: str) -> int:
  """The rows of the staged files `pattern` (`stream`'s glob), from their footers."""
  return sum(pq.ParquetFile(part).metadata.num_rows for part in sorted(Path(pattern).parent.glob("*.parquet")))
