"""Writing and reading MaxText parameter checkpoints (Orbax) one tensor group at a time.

Orbax writes a NumPy leaf with one TensorStore write of the whole array, so a scanned MoE leaf
([experts, layers, D, F]: 436 GB for DeepSeek-V3's wi_0) would have to exist in memory at once.
`StreamedLeaf` is a leaf that knows its shape and how to produce itself chunk by chunk; `write_leaves`
writes such leaves chunk after chunk into the arrays Orbax creates for them (through the Orbax seam,
`upstream.orbax`). On disk the result is an ordinary Orbax PyTree checkpoint of arrays, which MaxText's
`load_parameters_path` reads (tests/test_convert.py loads it through MaxText's own loader).

Reading back (`LeafReader`) opens a leaf through Orbax's read spec and reads slices, so the export
side is bounded the same way.
"""

import collections
import json
import shutil
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from maxtext_moe.upstream import orbax as orbax_seam

Chunk = tuple[tuple[slice, ...], np.ndarray]
# Bytes in flight + the chunk being made stay under this many largest chunks (at most 16M elements each,
# leaf_plan.MAX_CHUNK_ELEMS). With numpy making chunks, 4 vs 1 took 11.5 s vs 18.7 s for the 2.8 GB
# `bench convert`. Since XLA makes them (3x faster), 2, 3 and 4 run at the same speed (0.28-0.32 GB/s on
# 2 cores) and 2 has the lowest peak RSS: 1.7-2.1x the largest tensor, against 3.1-3.4x with 4.
INFLIGHT_CHUNKS = 2
ITEMS = orbax_seam.ITEMS


@dataclass(frozen=True)
class StreamedLeaf:
  """A checkpoint leaf of `shape`/`dtype` produced as (index, block) chunks of `chunk_shape`."""

  shape: tuple[int, ...]
  dtype: np.dtype
  chunk_shape: tuple[int, ...]
  chunks: Callable[[], Iterator[Chunk]]
  on_chunk: Callable[[int], None] = lambda nbytes: None

  @property
  def ndim(self) -> int:
    return len(self.shape)

  @property
  def size(self) -> int:
    return int(np.prod(self.shape))

  @property
  def nbytes(self) -> int:
    return self.size * np.dtype(self.dtype).itemsize


def _chunk_bytes(leaf: StreamedLeaf) -> int:
  return int(np.prod(leaf.chunk_shape)) * np.dtype(leaf.dtype).itemsize


async def write_leaves(values: Sequence[StreamedLeaf], open_stores: Sequence[Callable]) -> None:
  """Leaves one after another, chunk after chunk. Writes overlap with producing the next chunks while the
  bytes in flight plus the chunk being made stay under INFLIGHT_CHUNKS largest chunks: memory is a few
  chunks, never a leaf. `open_stores[i]()` opens leaf i's TensorStore array."""
  budget = INFLIGHT_CHUNKS * max(_chunk_bytes(v) for v in values)
  inflight: collections.deque = collections.deque()  # (commit future, bytes, progress callback)
  used = 0
  for leaf, open_store in zip(values, open_stores, strict=True):
    store = await open_store()
    need = _chunk_bytes(leaf)
    chunks = leaf.chunks()
    while True:
      while inflight and used + need > budget:  # make room before making the next chunk
        used -= await _retire_oldest(inflight)
      item = next(chunks, None)
      if item is None:
        break
      index, block = item
      # The block is ours alone (made for this write), so TensorStore may keep it instead of copying.
      write = store[index].write(np.asarray(block, leaf.dtype), can_reference_source_data_indefinitely=True)
      inflight.append((write, need, leaf.on_chunk))
      used += need
  while inflight:
    used -= await _retire_oldest(inflight)


async def _retire_oldest(inflight: collections.deque) -> int:
  fut, nbytes, done = inflight.popleft()
  await fut
  done(nbytes)
  return nbytes


def save_tree(out_dir: Path, tree: dict[str, Any]) -> None:
  """Writes `tree` (leaves: StreamedLeaf or arrays) as a one-step Orbax checkpoint whose step directory
  is `out_dir` (out_dir/_CHECKPOINT_METADATA, out_dir/items): the layout MaxText's own converter
  writes, which its loader accepts as out_dir/items. out_dir must not exist; on failure it is removed."""
  orbax_seam.register_streamed_type(StreamedLeaf, write_leaves)
  staging = out_dir.parent / f"{out_dir.name}.steps"
  try:
    orbax_seam.save_single_step(staging, tree).rename(out_dir)
  except BaseException:
    shutil.rmtree(out_dir, ignore_errors=True)
    raise
  finally:
    shutil.rmtree(staging, ignore_errors=True)


class LeafReader:
  """Slices of the leaves of an Orbax PyTree checkpoint, read on demand."""

  def __init__(self, items_dir: Path):
    self.dir = Path(items_dir)
    meta = json.loads((self.dir / "_METADATA").read_text())  # Orbax's PyTree metadata file
    self._ocdbt = bool(meta.get("use_ocdbt"))
    self._zarr3 = bool(meta.get("use_zarr3"))
    self._stores: dict[str, Any] = {}

  def _open(self, name: str):
    if name not in self._stores:
      self._stores[name] = orbax_seam.open_array(self.dir, name, ocdbt=self._ocdbt, zarr3=self._zarr3)
    return self._stores[name]

  def store(self, path: tuple[str, ...]) -> Any:
    """The leaf's TensorStore array, opened for reading."""
    return self._open(".".join(path))

  def shape(self, path: tuple[str, ...]) -> tuple[int, ...]:
    return tuple(self.store(path).shape)

  def read(self, path: tuple[str, ...], index: tuple[slice | int, ...] = ()) -> np.ndarray:
    store = self._open(".".join(path))
    return np.asarray(store[index].read().result() if index else store.read().result())
