"""A weights-only load leaves the FP8 scaling state at its start: a bf16 checkpoint loads into an FP8 run.

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
"""

from typing import Any

from maxtext.common import checkpointing

from maxtext_moe.upstream.patches import Patch, original

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


def patches() -> list[Patch]:
  return [Patch(checkpointing, "_abstract_params", weights_only)]
