"""Training data files read before MaxText's grain reader sees them: JSONL or Parquet rows, each with one
named field, and JSONL staged as Parquet (grain reads Parquet, TFRecord and ArrayRecord, not JSON) once,
under the cache directory, keyed by the files' paths, sizes and modification times. Used by SFT
conversations (`sft.conversations`) and pretraining text (`pretrain.text`)."""

import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from maxtext_moe.data.corpus import cache_dir
from maxtext_moe.errors import UserError

JSON_SUFFIXES = (".jsonl", ".json")


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


def stage(paths: list[Path], rows_of: list[list[Any]], *, kind: str, write: Callable[[list[Any], Path], None]) -> str:
  """The JSONL files `paths` (their checked rows, one list per file) as one Parquet file each (`write(rows,
  out)`), in a directory under the cache written once, atomically; returns the glob pattern grain reads."""
  out = staged_dir(paths, kind)
  if not out.is_dir():
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    try:
      for i, file_rows in enumerate(rows_of):
        write(file_rows, tmp / f"part-{i:05d}.parquet")
      try:
        os.rename(tmp, out)
      except OSError:  # another process of the job staged it first
        if not out.is_dir():
          raise
    finally:
      shutil.rmtree(tmp, ignore_errors=True)
  return str(out / "*.parquet")
