"""The Orbax seam: a leaf type whose arrays we write chunk by chunk, and Orbax's TensorStore specs.

Orbax writes a NumPy leaf with one TensorStore write of the whole array. Its extension point for new leaf
types is a `TypeHandler`; ours (`register_streamed_type`) subclasses Orbax's `NumpyHandler` so the leaf is
stored and restored exactly as a NumPy array would be (same TensorStore spec, typestr 'np.ndarray'), but
hands the writing to the caller's `write(values, open_stores)` coroutine: `open_stores[i]()` opens leaf i's
array with our chunk grid. Reading uses Orbax's read spec (`open_array`). These use Orbax's private
`_src` modules, hence this seam (checked by tests/test_upstream_contract.py).
"""

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from absl import logging as absl_logging
from orbax.checkpoint._src.futures import future
from orbax.checkpoint._src.serialization import tensorstore_utils as ts_utils
from orbax.checkpoint._src.serialization import type_handlers as ocp_type_handlers
from orbax.checkpoint._src.serialization import types as ocp_types

ITEMS = "items"  # the PyTree's directory inside a checkpoint; load_parameters_path = <out>/items


async def _open_for_write(leaf: Any, info: ocp_types.ParamInfo, arg: ocp_types.SaveArgs | None) -> Any:
  """The TensorStore array Orbax would create for a NumPy leaf of leaf.shape/dtype, chunked as
  leaf.chunk_shape (one of our chunks per TensorStore chunk)."""
  await info.await_path_creation()
  spec = ts_utils.build_array_write_spec(
    info=info,
    arg=arg,
    global_shape=leaf.shape,
    local_shape=leaf.chunk_shape,
    dtype=np.dtype(leaf.dtype),
    use_ocdbt=info.is_ocdbt_checkpoint,
    process_index=0,
  )
  return await ts.open(ts.Spec(spec.json), create=True, open=True, context=info.ts_context)


class _StreamedHandler(ocp_type_handlers.NumpyHandler):
  """Orbax's NumPy handler, except that writing is `write(values, open_stores)`'s job."""

  def __init__(self, write: Callable):
    super().__init__(deepcopy_host_arrays=False)
    self._write = write

  async def serialize(self, values, infos, args=None):
    args = args or [None] * len(values)
    opens = [functools.partial(_open_for_write, v, i, a) for v, i, a in zip(values, infos, args, strict=True)]
    return [future.CommitFutureAwaitingContractedSignals(self._write(values, opens), name="streamed_leaf_handler")]


def register_streamed_type(leaf_type: type, write: Callable) -> None:
  """Leaves of `leaf_type` are written by `write` (idempotent). Orbax warns that the handler shares
  np.ndarray's typestr: that is the point (it restores as one), so the warning is silenced."""
  level = absl_logging.get_verbosity()
  absl_logging.set_verbosity(absl_logging.ERROR)
  try:
    ocp.type_handlers.register_type_handler(leaf_type, _StreamedHandler(write), override=True)
  finally:
    absl_logging.set_verbosity(level)


def save_single_step(staging: Path, tree: dict[str, Any]) -> Path:
  """Writes `tree` as step 0 of an Orbax CheckpointManager at `staging` (OCDBT + zarr3, MaxText's layout,
  without zstd: bf16 weights barely compress and readers then need no codec). Returns the step directory."""
  options = ocp.CheckpointManagerOptions(create=True, enable_async_checkpointing=False)
  handlers = {ITEMS: ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True, use_compression=False)}
  with ocp.CheckpointManager(staging, options=options, item_handlers=handlers) as mngr:
    mngr.save(0, args=ocp.args.Composite(**{ITEMS: ocp.args.PyTreeSave(tree)}))
    mngr.wait_until_finished()
  return staging / "0"


def open_array(items_dir: Path, name: str, *, ocdbt: bool, zarr3: bool) -> Any:
  """The TensorStore array of leaf `name` (dotted path) in an Orbax PyTree checkpoint, opened for reading.
  The directory is made absolute: Orbax's OCDBT spec refuses a relative one."""
  info = ocp_types.ParamInfo(
    name=name,
    parent_dir=Path(items_dir).absolute(),
    is_ocdbt_checkpoint=ocdbt,
    use_zarr3=zarr3,
    ts_context=ts_utils.get_ts_context(use_ocdbt=ocdbt),
  )
  spec = ts_utils.build_array_read_spec(info, use_ocdbt=ocdbt)
  return ts.open(ts.Spec(spec.json), open=True, context=info.ts_context).result()
