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
import json
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from maxtext.common import checkpointing

from maxtext_moe.upstream import orbax
from maxtext_moe.upstream.patches import Patch, original

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


def load_params_from_path(load_parameters_from_path, abstract_unboxed_params, *args, **kwargs):
  """MaxText's load for the Params; the model's other variables from a training checkpoint's `nnx_aux`."""
  load = original(checkpointing, "load_params_from_path")
  items = _items_dir(load_parameters_from_path)
  meta = _metadata(items) if "://" not in str(load_parameters_from_path) else None
  if not meta or not isinstance(abstract_unboxed_params, nnx.State):
    return load(load_parameters_from_path, abstract_unboxed_params, *args, **kwargs)
  aux = {
    path: var
    for path, var in abstract_unboxed_params.flat_state()
    if not isinstance(var, nnx.Param) and ".".join((*AUX, *map(str, path))) in meta["names"]
  }
  if not aux:
    return load(load_parameters_from_path, abstract_unboxed_params, *args, **kwargs)
  params = abstract_unboxed_params.filter(lambda path, var: path not in aux)
  restored = load(load_parameters_from_path, params, *args, **kwargs)
  ocdbt, zarr3 = bool(meta.get("use_ocdbt")), bool(meta.get("use_zarr3"))
  for path, var in aux.items():
    name = ".".join((*AUX, *map(str, path)))
    store = orbax.open_array(items, name, ocdbt=ocdbt, zarr3=zarr3)
    if tuple(store.shape) != tuple(var.get_value().shape):
      raise ValueError(
        f"Checkpoint does not match the model: {name} is {tuple(store.shape)} in {items}, the model expects "
        f"{tuple(var.get_value().shape)}"
      )
    value = np.asarray(store.read().result()).astype(var.get_value().dtype)
    sharding = getattr(var.get_value(), "sharding", None)
    var.set_value(jax.device_put(value, sharding) if sharding is not None else value)
  return nnx.merge_state(restored, nnx.State.from_flat_path(aux))


def patches() -> list[Patch]:
  return [
    Patch(checkpointing, "_abstract_params", weights_only),
    Patch(checkpointing, "load_params_from_path", load_params_from_path),
  ]
