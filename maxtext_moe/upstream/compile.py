"""MaxText's own counts of a training step: its FLOPs, and XLA's memory for the compiled step.

The memory planner's FLOPs come from MaxText's `calculate_tflops_training_per_device`; `bench plan` checks
the planner's memory against `compiled_train_memory`, which compiles MaxText's train step ahead of time
for the visible devices as its `train_compile.py` does for a topology (nothing is allocated).
`lowered_train_step` lowers the same step for any platform (a GPU's too, on a CPU machine), which is how
the offload presets' host placements are checked.
"""

import dataclasses
from typing import Any

import jax
from flax.linen import partitioning as nn_partitioning
from maxtext.trainers.pre_train import train, train_compile
from maxtext.utils import maxtext_utils, sharding

from maxtext_moe.upstream import moe_layer
from maxtext_moe.upstream.model import model_patches
from maxtext_moe.upstream.patches import installed


def train_tflops_per_device(cfg: Any) -> tuple[float, float, float]:
  """(total, learnable-weight, attention) TFLOPs of one training step per device, MaxText's own count."""
  total, weights, attention = maxtext_utils.calculate_tflops_training_per_device(cfg, log=False)
  return float(total), float(weights), float(attention)


@dataclasses.dataclass(frozen=True)
class _TrainStep:
  """MaxText's train step with its shaped inputs and shardings, as its `train_compile.py` prepares it."""

  func: Any
  args: Any
  kwargs: Any
  mesh: Any
  in_shardings: Any
  out_shardings: Any
  static_argnums: Any
  donate_argnums: Any


def _train_step(cfg: Any) -> _TrainStep:
  mesh = maxtext_utils.get_mesh_from_config(cfg)
  args, kwargs, state_shardings, _, model = train_compile.get_shaped_inputs(mesh, cfg)
  params_shardings, state_shardings = sharding.maybe_update_params_sharding_with_opt(cfg, state_shardings)
  input_shardings = sharding.build_zero1_input_state_mesh_shardings(cfg, state_shardings, params_shardings)
  data_sharding = sharding.get_input_data_sharding(cfg, mesh)
  func, in_sh, out_sh, static, donate = maxtext_utils.get_functional_train_with_signature(
    train.train_step, data_sharding, input_shardings, model, cfg, params_shardings
  )
  return _TrainStep(func, args, kwargs, mesh, in_sh, out_sh, static, donate)


def compiled_train_memory(cfg: Any) -> dict[str, int]:
  """XLA's `memory_analysis()` per device of the train step for a resolved config (HyperParameters):
  argument/output/alias/temp bytes, on device and host."""
  with installed(model_patches()), moe_layer.te_guard():
    s = _train_step(cfg)
    rules = nn_partitioning.axis_rules(cfg.logical_axis_rules)
    compiled = train_compile.jit_and_compile(
      s.func, s.args, s.kwargs, s.mesh, s.in_shardings, s.out_shardings, s.static_argnums, s.donate_argnums, cfg, rules
    )
  mem = compiled.memory_analysis()
  names = ("argument", "output", "alias", "temp")
  out = {f"{n}_bytes": int(getattr(mem, f"{n}_size_in_bytes")) for n in names}
  out.update({f"host_{n}_bytes": int(getattr(mem, f"host_{n}_size_in_bytes")) for n in names})
  return out


def lowered_train_step(cfg: Any, *, platform: str) -> str:
  """The train step's StableHLO text as lowered for `platform` ("cpu", "cuda", "rocm", "tpu"), on any
  machine: jax.export lowers for a platform it does not run on. Nothing is compiled."""
  from jax import export  # pylint: disable=import-outside-toplevel

  with installed(model_patches()), moe_layer.te_guard():
    s = _train_step(cfg)
    with jax.set_mesh(s.mesh), nn_partitioning.axis_rules(cfg.logical_axis_rules):
      jitted = jax.jit(
        s.func,
        in_shardings=s.in_shardings,
        out_shardings=s.out_shardings,
        static_argnums=s.static_argnums,
        donate_argnums=s.donate_argnums,
      )
      return export.export(jitted, platforms=[platform])(*s.args, **s.kwargs).mlir_module()
