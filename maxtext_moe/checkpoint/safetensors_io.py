"""Reading and writing Hugging Face safetensors checkpoints without PyTorch.

Reading is hand-written (header + `np.memmap`) for two measured reasons: `safetensors` 0.8.0's numpy
API fails on F8_E4M3 tensors ("module 'numpy' has no attribute 'float8_e4m3fn'"), and its
`get_tensor` copies the whole tensor into memory, whereas a memmap view lets a converter touch one
tensor at a time and leaves caching to the page cache. The format is 8 bytes of little-endian header
length, a JSON header {name: {dtype, shape, data_offsets}}, then the data. Writing uses the
`safetensors` library (`safetensors.numpy.save_file`), which handles ml_dtypes arrays; its files are then
given the mode any file created there gets (`staging.usual_file_mode`: 0.8's are 0o600).
"""

import json
import os
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

from maxtext_moe.checkpoint.relayout import StoredTensor
from maxtext_moe.checkpoint.staging import usual_file_mode
from maxtext_moe.errors import UserError

DTYPES = {
  "BF16": np.dtype(ml_dtypes.bfloat16),
  "F16": np.dtype(np.float16),
  "F32": np.dtype(np.float32),
  "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
}
INDEX_FILE = "model.safetensors.index.json"
_MAX_HEADER = 100 * 1024 * 1024


@dataclass(frozen=True)
class TensorInfo:
  shard: Path
  dtype: str
  shape: tuple[int, ...]
  start: int  # absolute byte offset in the shard file
  nbytes: int


def read_header(path: Path) -> dict[str, TensorInfo]:
  """Parses and checks one shard's header; a malformed one is a one-line UserError naming the file."""
  size = path.stat().st_size
  with path.open("rb") as f:
    raw = f.read(8)
    if len(raw) < 8:
      raise UserError(f"corrupt safetensors file {path}: shorter than its 8-byte header length")
    (n,) = struct.unpack("<Q", raw)
    if n > min(size - 8, _MAX_HEADER):
      raise UserError(f"corrupt safetensors header in {path}: header length {n} exceeds the file")
    try:
      header = json.loads(f.read(n))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
      raise UserError(f"corrupt safetensors header in {path}: {e}") from None
  if not isinstance(header, dict):
    raise UserError(f"corrupt safetensors header in {path}: not a JSON object")
  out = {}
  for name, meta in header.items():
    if name == "__metadata__":
      continue
    try:
      dtype, shape, (begin, end) = meta["dtype"], tuple(int(d) for d in meta["shape"]), meta["data_offsets"]
    except (KeyError, TypeError, ValueError):
      raise UserError(f"corrupt safetensors header in {path}: bad entry for {name!r}") from None
    itemsize = DTYPES[dtype].itemsize if dtype in DTYPES else None
    if itemsize is not None and end - begin != int(np.prod(shape)) * itemsize:
      raise UserError(f"corrupt safetensors header in {path}: {name!r} has {end - begin} bytes for shape {list(shape)}")
    if not 0 <= begin <= end <= size - 8 - n:
      raise UserError(f"corrupt safetensors file {path}: {name!r} lies past the end of the file (truncated?)")
    out[name] = TensorInfo(path, dtype, shape, 8 + n + begin, end - begin)
  return out


class HFCheckpoint:
  """A Hugging Face checkpoint directory: config.json plus one or more safetensors shards."""

  def __init__(self, directory: str | os.PathLike):
    self.dir = Path(directory)
    if not self.dir.is_dir():
      raise UserError(f"Hugging Face checkpoint {self.dir} is not a directory")
    cfg = self.dir / "config.json"
    if not cfg.is_file():
      raise UserError(f"{self.dir} has no config.json: point --hf at a Hugging Face model directory")
    self.config = json.loads(cfg.read_text())
    self.tensors: dict[str, TensorInfo] = {}
    for shard in self._shards():
      self.tensors |= read_header(shard)

  def _shards(self) -> list[Path]:
    index = self.dir / INDEX_FILE
    if index.is_file():
      weight_map = json.loads(index.read_text()).get("weight_map", {})
      shards = sorted({self.dir / f for f in weight_map.values()})
      missing = [s.name for s in shards if not s.is_file()]
      if missing:
        raise UserError(
          f"shard {missing[0]} listed in {INDEX_FILE} is missing from {self.dir} ({len(missing)} missing)"
        )
      return shards
    shards = sorted(self.dir.glob("*.safetensors"))
    if not shards:
      raise UserError(f"no *.safetensors files in {self.dir}")
    return shards

  def __contains__(self, name: str) -> bool:
    return name in self.tensors

  def raw(self, name: str) -> np.ndarray:
    """A read-only memmap view of tensor `name` in its stored dtype."""
    info = self.tensors[name]
    if info.dtype not in DTYPES:
      raise UserError(f"tensor {name} has dtype {info.dtype}; expected one of {', '.join(DTYPES)}")
    return np.memmap(info.shard, DTYPES[info.dtype], "r", offset=info.start, shape=info.shape)

  def weight(self, name: str, *, block: tuple[int, int], rows: slice = slice(None)) -> StoredTensor:
    """Rows `rows` of tensor `name` as stored (a memmap view), with its `weight_scale_inv` rows when it is
    FP8 (then `rows` must start on a block boundary). `relayout` turns it into an array."""
    x = self.raw(name)
    if x.dtype != DTYPES["F8_E4M3"]:
      return StoredTensor(x[rows])
    scale_name = name + "_scale_inv"
    if scale_name not in self.tensors:
      raise UserError(f"FP8 tensor {name} has no {scale_name} in {self.dir}")
    r0, r1, _ = rows.indices(x.shape[0])
    assert r0 % block[0] == 0, "FP8 row blocks start on a scale-block boundary"
    return StoredTensor(x[r0:r1], self.raw(scale_name)[r0 // block[0] : -(-r1 // block[0])], tuple(block))


def write_shards(out_dir: Path, tensors: Iterable[tuple[str, np.ndarray]], *, max_shard_bytes: int) -> Iterator[int]:
  """Writes (name, array) pairs into shards of at most `max_shard_bytes` (one bigger tensor gets its own)
  plus model.safetensors.index.json. Yields bytes written after each shard, so callers can show progress.
  Holds at most one shard's tensors in memory. Each shard has the mode a file created there usually has."""
  pending: dict[str, np.ndarray] = {}
  pending_bytes, written, weight_map, mode = 0, [], {}, usual_file_mode(out_dir)

  def flush():
    name = f"shard-{len(written):05d}.safetensors"
    save_file(pending, str(out_dir / name), metadata={"format": "pt"})
    os.chmod(out_dir / name, mode)
    written.append((name, list(pending)))

  for name, arr in tensors:
    if pending and pending_bytes + arr.nbytes > max_shard_bytes:
      flush()
      yield pending_bytes
      pending, pending_bytes = {}, 0
    pending[name] = np.ascontiguousarray(arr)
    pending_bytes += arr.nbytes
  if pending:
    flush()
    yield pending_bytes
  total = 0
  for i, (tmp_name, names) in enumerate(written):
    final = f"model-{i + 1:05d}-of-{len(written):05d}.safetensors"
    (out_dir / tmp_name).rename(out_dir / final)
    weight_map |= dict.fromkeys(names, final)
    total += (out_dir / final).stat().st_size
  index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
  (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
