"""Host-offload presets: one plugin key (`offload`) that sets MaxText's own offload keys.

  none              nothing on the host (YAML `none` reaches us as None: MaxText turns the string into None)
  optimizer         Adam's moments live in host memory (optimizer_memory_host_offload); the train step brings
                    them to the device for the update, a stacked leaf at a time
  optimizer_params  + parameters (parameter_memory_host_offload; MaxText requires param_scan_axis=0 for it,
                    which changes the scanned layout of new checkpoints); the train step brings them all
                    back to the device for the step, so the device is spared only between steps and their
                    re-laid-out copy
  activations       remat_policy=custom: each layer's input and the big matmul outputs, the MoE ones
                    included (our block tags them with MaxText's names), go to host memory; under the
                    bounded rounds the MoE ones are recomputed instead (`moe.settings.outputs_recomputed`)
  all               optimizer_params + activations

A preset's keys go before the user's key=value overrides, so an explicit override still wins.
"""

from enum import StrEnum

from maxtext_moe.moe.settings import REMAT_NAMES


class OffloadPreset(StrEnum):
  OPTIMIZER = "optimizer"
  OPTIMIZER_PARAMS = "optimizer_params"
  ACTIVATIONS = "activations"
  ALL = "all"


# MaxText's custom-remat tensor names that the activation preset moves to the host (each layer's input, the
# attention output projection, and the MoE block's three GEMM outputs; the MLP's output `mlpwo` is named too,
# but it only joins the residual stream and no backward keeps it); the rest stay 'remat'.
OFFLOADED_ACTIVATIONS = ("decoder_layer_input", "out_proj", "mlpwo", *REMAT_NAMES)


# The presets that set param_scan_axis=0 (MaxText offloads parameters only so): a converted checkpoint, and a
# run's at MaxText's default, keep the layer axis at 1, which a run at 0 cannot read (`checkpoint/model_check.py`
# refuses it at launch). A recipe that starts from weights is never offered them (the planner's fixes, the search).
LAYER_AXIS_ZERO = frozenset({OffloadPreset.OPTIMIZER_PARAMS, OffloadPreset.ALL})


def takes(preset: str | None, *, loads_weights: bool) -> bool:
  """Whether a recipe can take `preset`: one that loads a checkpoint (a fine-tune) cannot put the layer axis
  at 0 (`LAYER_AXIS_ZERO`)."""
  return not (loads_weights and preset in LAYER_AXIS_ZERO)


def preset_overrides(preset: OffloadPreset | str | None) -> list[str]:
  """MaxText key=value overrides for `preset` (None or 'none': no offload)."""
  if preset in (None, "none"):
    return []
  preset = OffloadPreset(preset)
  out = []
  if preset in (OffloadPreset.OPTIMIZER, OffloadPreset.OPTIMIZER_PARAMS, OffloadPreset.ALL):
    out.append("optimizer_memory_host_offload=true")
  if preset in (OffloadPreset.OPTIMIZER_PARAMS, OffloadPreset.ALL):
    out += ["parameter_memory_host_offload=true", "param_scan_axis=0"]
  if preset in (OffloadPreset.ACTIVATIONS, OffloadPreset.ALL):
    out += ["remat_policy=custom", *(f"{name}=offload" for name in OFFLOADED_ACTIVATIONS)]
  return out
