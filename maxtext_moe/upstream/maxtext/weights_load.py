"""MaxText's weights-only load (`load_parameters_path`), made to read what we write and to start FP8 runs.

**The FP8 scaling state starts fresh: a bf16 checkpoint loads into an FP8 run.**

MaxText's FP8 dense layers (`quantization=fp8`, and TE's delayed scaling) keep their amax histories and
scales as variables of the `_overwrite_with_gradient` collection, beside the weights. MaxText 0.2.5's
weights-only load (`load_parameters_path`: `checkpointing.load_state_if_possible` ->
`load_params_from_path`) asks the checkpoint for every persistent variable of the model
(`checkpointing._abstract_params`), so a checkpoint without them (a converted Hugging Face model, any bf16
run) is refused as "does not match the model", one missing amax history per projection. They are not
weights: a new FP8 run starts them at their initial values (zero history, unit scale) and calibrates in
its first steps. This patch leaves them out of the weights-only request, so they keep those values
(MaxText overlays the loaded weights on a freshly initialized state). A full-state resume
(`load_full_state_path`, or a run's own checkpoints) is a different path and restores them as saved.

**A training checkpoint's own weights load.** A run's checkpoint (`RUN/checkpoints/N/items`) keeps its
`nnx.Param`s under `params/params/...` and every other persistent variable of the model under
`nnx_aux/model/...`; DeepSeek-V3's routing bias (`MoEBiasVar`) is one. MaxText 0.2.5's weights-only load
looks for those only under `params/<collection>/...` (where converted checkpoints put them), so fine-tuning
from one's own pretraining run stopped with "Checkpoint does not match the model: ... gate/bias: missing".
Here the load asks MaxText for the Params, and reads the other variables from `nnx_aux/model/...` when the
checkpoint has them there (whole arrays: biases and such are small), placed as the model shards them, a
shape that differs from the model's refused by name. Local checkpoints only: a remote one (`gs://...`)
goes to MaxText's load as it is.
"""

import ast
import functools
import json
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from maxtext.common import checkpointing

from maxtext_moe.upstream import orbax
from maxtext_moe.upstream.patches import Patch, original
from maxtext_moe.upstream.pipeline import flat_load as stage_load

AUX = ("nnx_aux", "model")  # where a training checkpoint keeps the model's variables that are not Params

FP8_STATE_COLLECTION = "_overwrite_with_gradient"


def is_fp8_state(variable: Any) -> bool:
  """Whether an NNX variable is FP8 scaling state (an amax history or a scale), as MaxText tells them."""
  return type(variable).__name__ == FP8_STATE_COLLECTION


def weights_only(abstract_unboxed_pre_state: Any) -> Any:
  """MaxText's persistent model variables, less the FP8 scaling state (Linen's `params` as it was)."""
  params = original(checkpointing, "_abstract_params")(abstract_unboxed_pre_state)
  if hasattr(params, "filter"):
    return params.filter(lambda path, var: not is_fp8_state(var))
  return params


def _metadata(items: Path) -> dict[str, Any] | None:
  """An Orbax PyTree checkpoint's metadata, its leaf names dotted under "names" (None if it is not one we
  can read here)."""
  try:
    meta = json.loads((items / "_METADATA").read_text())
  except (OSError, ValueError):
    return None
  return meta | {"names": {".".join(ast.literal_eval(k)) for k in meta.get("tree_metadata", {})}}  # tuple reprs


def _items_dir(path: Any) -> Path:
  p = Path(str(path))
  return p / orbax.ITEMS if (p / orbax.ITEMS / "_METADATA").is_file() else p


def _stored_name(path: tuple[str, ...], var: Any, names: set[str]) -> str | None:
  """Where a checkpoint keeps a variable at `path`: a Param under params/params, another variable under a
  training checkpoint's nnx_aux/model or a converted one's params/<its type>."""
  dotted = ".".join(path)
  if isinstance(var, nnx.Param):
    found = [f"params.params.{dotted}"]
  else:
    found = [f"{'.'.join(AUX)}.{dotted}", f"params.{type(var).__name__}.{dotted}"]
  return next((n for n in found if n in names), None)


def _restore(items: Path, meta: dict[str, Any], name: str, var: Any, layout: Any = None) -> None:
  """Sets `var` to the stored array `name`, placed as the model shards it; through `layout(stored rank)`
  (a `stage_load.Placement`) for a pipelined model's MoE layers read from a stack without stages."""
  store = orbax.open_array(items, name, ocdbt=bool(meta.get("use_ocdbt")), zarr3=bool(meta.get("use_zarr3")))
  where = None if layout is None else layout(store.rank)
  want = var.get_value()
  shape = tuple(store.shape) if where is None else where.shape(tuple(store.shape))
  if shape != tuple(want.shape):
    raise ValueError(
      f"Checkpoint does not match the model: {name} is {tuple(store.shape)} in {items}, the model expects "
      f"{tuple(want.shape)}" + ("" if where is None else f" (as {shape} after the pipeline's layout)")
    )

  def box(index: tuple[slice, ...]) -> np.ndarray:
    got = store[index].read().result() if where is None else stage_load.read(store, where, index)
    return np.asarray(got).astype(want.dtype)

  sharding = getattr(want, "sharding", None)
  full = tuple(slice(None) for _ in shape)
  var.set_value(jax.make_array_from_callback(shape, sharding, box) if sharding is not None else box(full))


def _moved(abstract: nnx.State, names: set[str], cfg: Any) -> dict[tuple, tuple[str, Any]]:
  """A pipelined model's variables of the pipeline's stack and where each comes from, when the checkpoint
  was written without stages (`stage_load`); empty otherwise."""
  stages = stage_load.Stages.of(cfg) if cfg is not None else None
  if stages is None or any(stage_load.PIPELINE[0] in n.split(".") for n in names):
    return {}
  out = {}
  for path, var in abstract.flat_state():
    keys = tuple(map(str, path))
    where = stage_load.placement(keys[1:], stages, is_param=True, ndim=0) if keys[:1] == ("decoder",) else None
    if where is None:
      continue
    name = _stored_name(("decoder", stages.stack.name, *where.source), var, names)
    if name is None:
      raise ValueError(
        f"Checkpoint does not match the model: no decoder/{stages.stack.name}/{'/'.join(where.source)} for the "
        f"pipeline's {'/'.join(keys)} (a checkpoint without stages and with scan_layers=true loads into stages)"
      )
    out[path] = (name, var)
  return out


def load_params_from_path(load_parameters_from_path, abstract_unboxed_params, *args, cfg=None, **kwargs):
  """MaxText's load for the Params; the model's other variables from a training checkpoint's `nnx_aux`;
  a pipelined model's MoE layers from a checkpoint without stages (`stage_load`)."""
  load = original(checkpointing, "load_params_from_path")
  items = _items_dir(load_parameters_from_path)
  meta = _metadata(items) if "://" not in str(load_parameters_from_path) else None
  if not meta or not isinstance(abstract_unboxed_params, nnx.State):
    return load(load_parameters_from_path, abstract_unboxed_params, *args, **kwargs)
  moved = _moved(abstract_unboxed_params, meta["names"], cfg)
  aux = {
    path: var
    for path, var in abstract_unboxed_params.flat_state()
    if path not in moved and not isinstance(var, nnx.Param) and ".".join((*AUX, *map(str, path))) in meta["names"]
  }
  if not aux and not moved:
    return load(load_parameters_from_path, abstract_unboxed_params, *args, **kwargs)
  params = abstract_unboxed_params.filter(lambda path, var: path not in aux and path not in moved)
  restored = load(load_parameters_from_path, params, *args, **kwargs)
  for path, var in aux.items():
    _restore(items, meta, ".".join((*AUX, *map(str, path))), var)
  stages = stage_load.Stages.of(cfg)
  for path, (name, var) in moved.items():
    under = tuple(map(str, path))[1:]
    is_param = isinstance(var, nnx.Param)
    _restore(
      items, meta, name, var, lambda rank, u=under, p=is_param: stage_load.placement(u, stages, is_param=p, ndim=rank)
    )
  return nnx.merge_state(restored, nnx.State.from_flat_path({**aux, **{p: v for p, (_, v) in moved.items()}}))


def patches(cfg: Any = None) -> list[Patch]:
  """The weights-only load; with the run's resolved `cfg`, also into pipeline stages from a checkpoint
  written without them."""
  return [
    Patch(checkpointing, "_abstract_params", weights_only),
    Patch(checkpointing, "load_params_from_path", functools.partial(load_params_from_path, cfg=cfg)),
  ]
