"""Writing and reading MaxText parameter checkpoints (Orbax) one tensor group at a time.

Orbax writes a NumPy leaf with one TensorStore write of the whole array, so a scanned MoE leaf
([experts, layers, D, F]: 436 GB for DeepSeek-V3's wi_0) would have to exist in memory at once.
`StreamedLeaf` is a leaf that knows its shape and how to produce itself chunk by chunk; its Orbax
`TypeHandler` (Orbax's extension point for new leaf types) builds the same TensorStore spec Orbax
builds for a NumPy array, with the chunk grid set to our chunk shape, and writes chunk after chunk.
On disk the result is an ordinary Orbax PyTree checkpoint of arrays, which MaxText's
`load_parameters_path` reads (tests/test_convert.py loads it through MaxText's own loader).

Reading back (`LeafReader`) opens a leaf through Orbax's read spec and reads slices, so the export
side is bounded the same way.
"""

import collections
import json
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils
from orbax.checkpoint._src.serialization import type_handlers as ocp_type_handlers
from orbax.checkpoint._src.serialization import types as ocp_types

Chunk = tuple[tuple[slice, ...], np.ndarray]
# Bytes in flight + the chunk being made stay under this many largest chunks (at most 16M elements each,
# deepseek.MAX_CHUNK_ELEMS). With numpy making chunks, 4 vs 1 took 11.5 s vs 18.7 s for the 2.8 GB
# `bench convert`. Since XLA makes them (3x faster), 2, 3 and 4 run at the same speed (0.28-0.32 GB/s on
# 2 cores) and 2 has the lowest peak RSS: 1.7-2.1x the largest tensor, against 3.1-3.4x with 4.
INFLIGHT_CHUNKS = 2
ITEMS = "items"  # the PyTree's directory inside a checkpoint; load_parameters_path = <out>/items


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


class StreamedLeafHandler(ocp_type_handlers.NumpyHandler):
  """Writes a StreamedLeaf chunk by chunk into the TensorStore array Orbax would have created for it.
  Restores as a NumPy array (typestr 'np.ndarray'), so readers see a plain array checkpoint."""

  def __init__(self):
    super().__init__(deepcopy_host_arrays=False)

  async def _open(self, leaf: StreamedLeaf, info: ocp_types.ParamInfo, arg: ocp_types.SaveArgs | None):
    await info.await_path_creation()
    spec = ts_utils.build_array_write_spec(
      info=info,
      arg=arg,
      global_shape=leaf.shape,
      local_shape=leaf.chunk_shape,  # the zarr chunk grid: one of our chunks per TensorStore chunk
      dtype=np.dtype(leaf.dtype),
      use_ocdbt=info.is_ocdbt_checkpoint,
      process_index=0,
    )
    return await ts.open(ts.Spec(spec.json), create=True, open=True, context=info.ts_context)

  async def serialize(self, values, infos, args=None):
    """Leaves one after another, chunk after chunk. Writes overlap with producing the next chunks while
    the bytes in flight plus the chunk being made stay under INFLIGHT_CHUNKS largest chunks: memory is
    a few chunks, never a leaf."""
    args = args or [None] * len(values)
    budget = INFLIGHT_CHUNKS * max(_chunk_bytes(v) for v in values)

    async def write_all():
      inflight: collections.deque = collections.deque()  # (commit future, bytes, progress callback)
      used = 0

      async def retire_oldest():
        nonlocal used
        fut, nbytes, done = inflight.popleft()
        await fut
        used -= nbytes
        done(nbytes)

      for leaf, info, arg in zip(values, infos, args, strict=True):
        store = await self._open(leaf, info, arg)
        need = _chunk_bytes(leaf)
        chunks = leaf.chunks()
        while True:
          while inflight and used + need > budget:  # make room before making the next chunk
            await retire_oldest()
          item = next(chunks, None)
          if item is None:
            break
          index, block = item
          block = np.asarray(block, leaf.dtype)
          # The block is ours alone (made for this write), so TensorStore may keep it instead of copying.
          inflight.append((store[index].write(block, can_reference_source_data_indefinitely=True), need, leaf.on_chunk))
          used += need
      while inflight:
        await retire_oldest()

    from orbax.checkpoint._src.futures import future  # pylint: disable=import-outside-toplevel

    return [future.CommitFutureAwaitingContractedSignals(write_all(), name="streamed_leaf_handler")]


def _chunk_bytes(leaf: StreamedLeaf) -> int:
  return int(np.prod(leaf.chunk_shape)) * np.dtype(leaf.dtype).itemsize


def _register() -> None:
  """Orbax warns that our handler shares np.ndarray's typestr: that is the point (it restores as one)."""
  from absl import logging as absl_logging  # pylint: disable=import-outside-toplevel

  level = absl_logging.get_verbosity()
  absl_logging.set_verbosity(absl_logging.ERROR)
  try:
    ocp.type_handlers.register_type_handler(StreamedLeaf, StreamedLeafHandler(), override=True)
  finally:
    absl_logging.set_verbosity(level)


_register()


def save_tree(out_dir: Path, tree: dict[str, Any]) -> None:
  """Writes `tree` (leaves: StreamedLeaf or arrays) as a one-step Orbax checkpoint whose step directory
  is `out_dir` (out_dir/_CHECKPOINT_METADATA, out_dir/items): the layout MaxText's own converter
  writes, which its loader accepts as out_dir/items. out_dir must not exist; on failure it is removed."""
  staging = out_dir.parent / f"{out_dir.name}.steps"
  try:
    options = ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False)
    # MaxText's own layout (OCDBT + zarr3), without zstd: bf16 weights barely compress (measured: the
    # compression cost more time than the conversion itself on 2 cores), and readers need no codec.
    handlers = {ITEMS: ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True, use_compression=False)}
    with ocp.CheckpointManager(staging, options=options, item_handlers=handlers) as mngr:
      mngr.save(0, args=ocp.args.Composite(**{ITEMS: ocp.args.PyTreeSave(tree)}))
      mngr.wait_until_finished()
    (staging / "0").rename(out_dir)
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
      info = ocp_types.ParamInfo(
        name=name,
        parent_dir=self.dir,
        is_ocdbt_checkpoint=self._ocdbt,
        use_zarr3=self._zarr3,
        ts_context=ts_utils.get_ts_context(use_ocdbt=self._ocdbt),
      )
      spec = ts_utils.build_array_read_spec(info, use_ocdbt=self._ocdbt)
      self._stores[name] = ts.open(ts.Spec(spec.json), open=True, context=info.ts_context).result()
    return self._stores[name]

  def shape(self, path: tuple[str, ...]) -> tuple[int, ...]:
    return tuple(self._open(".".join(path)).shape)

  def read(self, path: tuple[str, ...], index: tuple[slice | int, ...] = ()) -> np.ndarray:
    store = self._open(".".join(path))
    return np.asarray(store[index].read().result() if index else store.read().result())
