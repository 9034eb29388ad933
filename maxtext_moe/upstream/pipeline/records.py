"""What the layers record per iteration, out of a circular pipeline (num_pipeline_repeats > 1).

MaxText's default pipeline (`NNXPipeline`, `layers/pipeline.py`) runs each iteration as a vmap of one stage
over the stages, on the state `nnx.state(stage)` gives back: the stage's weights, its RNG state and what its
layers sowed (`nnx.Intermediate`: our block's stats, DeepSeek's `moe_bias_updates`). With one repeat that
state is the next iteration's as it is, and the scan over iterations stacks its intermediates [T, S, ...].
With R repeats the pipeline's state holds every repeat, [R, S, ...], and `run_one_iteration` writes the
stage's state back into it at the repeat each stage ran (`_scatter_update`, a `jax.tree.map` over the
state before and after). The state before holds no intermediates (the loss pops them after every forward
pass), the state after does, so the two trees differ and the map fails on the first compile. Nor would
writing them back by repeat be right: what a layer records at one iteration is that iteration's, not the
repeat's state.

Here, under R > 1, the stages' vmapped function hands back its state without the intermediates, and
`run_one_iteration` returns them beside the state it wrote back, as MaxText's one-repeat path returns
them: the scan then stacks them [T, S, ...] per iteration, and `pipeline.fold` sums them per (repeat,
stage) from the schedule (`Schedule.slots`, which counts repeats), the bubble's dropped. The bias update
stays one per step from the folded counts of the whole step (`pipeline.fold_aux`). With one repeat
nothing changes. MaxText's other circular pipeline, `NNXCircularPipeline` (pipeline_fsdp_ag_per_repeat),
is not touched: it hands out only the intermediates its state held before the call (none), so with MoE
layers our checks refuse it (`config/stage_checks.py`).
"""

from typing import Any

from flax import nnx
from maxtext.layers import pipeline as mt_pipeline

from maxtext_moe.upstream.patches import Patch, original

_RECORDS: list[list[Any]] = []  # one list per `run_one_iteration` in progress: the records its stages gave


def stages_function(pipe: Any) -> Any:
  """MaxText's vmapped stage function; inside a circular pipeline's `run_one_iteration`, one that keeps
  what the layers sowed apart from the state MaxText writes back by repeat."""
  vmapped = original(mt_pipeline.NNXPipeline, "get_main_vmap_func_for_iterations")(pipe)
  if not _RECORDS:
    return vmapped
  records = _RECORDS[-1]

  def run(*args: Any) -> tuple[Any, Any]:
    out, state = vmapped(*args)
    sown, rest = state.split(nnx.Intermediate, ...)
    records.append(sown)
    return out, rest

  return run


def run_one_iteration(pipe: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
  """MaxText's iteration; with repeats, the stages' records of this iteration [S, ...] returned in the
  layer state beside the weights and RNG state written back by repeat."""
  run = original(mt_pipeline.NNXPipeline, "run_one_iteration")
  if int(pipe.config.num_pipeline_repeats) <= 1:
    return run(pipe, *args, **kwargs)
  records: list[Any] = []
  _RECORDS.append(records)
  try:
    loop_state, layer_state = run(pipe, *args, **kwargs)
  finally:
    _RECORDS.pop()
  if len(records) != 1:
    raise AssertionError(f"pipeline: {len(records)} stage calls in one iteration, expected 1")
  return loop_state, nnx.State.merge(layer_state, records[0])


def patches() -> list[Patch]:
  return [
    Patch(mt_pipeline.NNXPipeline, "get_main_vmap_func_for_iterations", stages_function),
    Patch(mt_pipeline.NNXPipeline, "run_one_iteration", run_one_iteration),
  ]
