"""A checkpoint without pipeline stages read into a pipelined model's layout (upstream/pipeline/flat_load.py): every
box of every leaf kind against the stack rearranged by reshape, from a real TensorStore array, for DeepSeek's
MoE stack (the layers outside the pipeline first) and the other decoders' stack of every layer (those
outside after it), circular pipelines included; and back (`Unstaged`, what the export reads)."""

import itertools

import numpy as np
import pytest
import tensorstore as ts

from conftest import REPO
from maxtext_moe.upstream.pipeline import flat_load as stage_load


def _store(x: np.ndarray):
  return ts.open({"driver": "array", "array": x, "dtype": str(x.dtype)}).result()


def _expected(stack: np.ndarray, st: stage_load.Stages, axis: int, kind: str) -> np.ndarray:
  """The pipelined leaf by reshape: the pipeline's layers (after the outside ones for DeepSeek, before them
  for the others) as [R, S, lps, ...]."""
  n = st.stages * st.repeats * st.per_stage
  first = st.outside if st.stack == stage_load.DEEPSEEK else 0
  layers = np.moveaxis(np.take(stack, np.arange(first, first + n), axis=axis), axis, 0)
  grid = layers.reshape(st.repeats, st.stages, st.per_stage, *layers.shape[1:])
  if kind == "scanned":
    out = np.moveaxis(grid, 2, 2 + axis)
  else:
    out = grid[:, :, int(kind.removeprefix("layers_")) if kind.startswith("layers_") else 0]
  return out if st.repeats > 1 else out[0]


def _boxes(shape: tuple[int, ...]):
  """Every box of a split of each axis in two halves (where it has 2 or more): a sharded load's reads."""
  cuts = [[slice(0, n // 2), slice(n // 2, n)] if n > 1 else [slice(None)] for n in shape]
  return list(itertools.product(*cuts))


CASES = [  # stages, repeats, layers per stage, MoE layers outside, stage kind
  (2, 1, 1, 1, "single"),
  (4, 1, 1, 0, "single"),
  (2, 2, 1, 1, "single"),
  (2, 1, 2, 1, "scanned"),
  (2, 2, 2, 0, "scanned"),
  (2, 1, 3, 0, "layers_2"),
  (2, 2, 2, 1, "layers_0"),
]


STACKS = {"deepseek": stage_load.DEEPSEEK, "qwen3_mixtral": stage_load.GENERIC}


@pytest.mark.parametrize("stack", sorted(STACKS))
@pytest.mark.parametrize("stages,repeats,lps,outside,kind", CASES)
@pytest.mark.parametrize("is_param,rank", [(True, 4), (True, 2), (False, 2), (True, 1)])
def test_pipeline_leaf_from_a_stack_without_stages(stack, stages, repeats, lps, outside, kind, is_param, rank):
  st = stage_load.Stages(stages, repeats, lps, outside, scan_axis=1, stack=STACKS[stack])
  total = outside + stages * repeats * lps
  axis = st.layer_axis(is_param, rank)
  shape = [3, 5, 4, 2][:rank]
  shape[axis] = total
  stack = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
  prefix = {"single": (), "scanned": (stage_load.SCANNED,)}.get(kind, (kind,))
  where = stage_load.placement(("pipeline_module", "layers", *prefix, "w"), st, is_param=is_param, ndim=rank)
  assert where.source == ("w",)
  want = _expected(stack, st, axis, kind)
  assert where.shape(stack.shape) == want.shape
  store = _store(stack)
  for box in _boxes(want.shape):
    np.testing.assert_array_equal(stage_load.read(store, where, box), want[box], err_msg=str(box))


def test_layers_outside_the_pipeline_are_the_stack_s_first_layers():
  st = stage_load.Stages(stages=2, repeats=1, per_stage=1, outside=2, scan_axis=1)
  stack = np.arange(3 * 4 * 5, dtype=np.float32).reshape(3, 4, 5)  # a Param, layer axis 1
  where = stage_load.placement(("moe_layers_outside_pipeline", "a", "w"), st, is_param=True, ndim=3)
  assert where.source == ("a", "w") and where.shape(stack.shape) == (3, 2, 5)
  for box in _boxes((3, 2, 5)):
    np.testing.assert_array_equal(stage_load.read(_store(stack), where, box), stack[:, :2][box])


def test_a_generic_decoders_layers_outside_the_pipeline_are_the_stack_s_last_layers():
  """Qwen3-MoE, Mixtral: MaxText runs `layers_outside_pipeline` after the pipeline (a circular one here)."""
  st = stage_load.Stages(stages=2, repeats=2, per_stage=1, outside=2, scan_axis=1, stack=stage_load.GENERIC)
  stack = np.arange(3 * 6 * 5, dtype=np.float32).reshape(3, 6, 5)  # a Param, layer axis 1
  where = stage_load.placement(("layers_outside_pipeline", "a", "w"), st, is_param=True, ndim=3)
  assert where.source == ("a", "w") and where.shape(stack.shape) == (3, 2, 5)
  for box in _boxes((3, 2, 5)):
    np.testing.assert_array_equal(stage_load.read(_store(stack), where, box), stack[:, 4:][box])
  assert stage_load.placement(("moe_layers_outside_pipeline", "a", "w"), st, is_param=True, ndim=3) is None


@pytest.mark.parametrize("stack", sorted(STACKS))
@pytest.mark.parametrize("stages,repeats,lps,outside,kind", [c for c in CASES if c[-1] != "layers_2"])
def test_a_pipelined_checkpoint_reads_back_as_the_stack(stack, stages, repeats, lps, outside, kind):
  """`Unstaged` over the parts a pipelined checkpoint keeps (laid out from a stack by `placement`) reads as
  that stack, whole and by boxes: what the Hugging Face export of a pipelined run reads."""
  st = stage_load.Stages(stages, repeats, lps, outside, scan_axis=1, stack=STACKS[stack])
  shape = [3, outside + stages * repeats * lps, 4]
  whole = np.arange(np.prod(shape), dtype=np.float32).reshape(shape)
  parts = []
  for path in stage_load.staged_parts(("w",), st):
    if path[:2] == stage_load.PIPELINE and lps > 1 and (path[2:3] == (stage_load.SCANNED,)) != (kind == "scanned"):
      continue  # a stage's layers are kept scanned or one by one, not both
    where = stage_load.placement(path, st, is_param=True, ndim=3)
    laid = stage_load.read(_store(whole), where, tuple(slice(None) for _ in where.shape(whole.shape)))
    assert stage_load.stack_rank(path, st, laid.ndim) == 3
    parts.append((_store(laid), where))
  back = stage_load.Unstaged(parts)
  assert back.shape == whole.shape
  np.testing.assert_array_equal(back.read().result(), whole)
  for box in _boxes(whole.shape):
    np.testing.assert_array_equal(back[box].read().result(), whole[box], err_msg=str(box))


@pytest.mark.parametrize(
  "overrides,want",
  [
    (["ici_pipeline_parallelism=2"], stage_load.Stages(2, 2, 1, 0, 1, stage_load.GENERIC)),
    (
      ["ici_pipeline_parallelism=2", "pipeline_parallel_layers=2"],
      stage_load.Stages(2, 1, 1, 2, 1, stage_load.GENERIC),
    ),
  ],
)
def test_the_layout_of_a_resolved_qwen3_config(overrides, want, resolution):
  """MaxText pipelines every layer of a Qwen3-MoE decoder by default (4 here: 2 stages x 2 repeats)."""
  model = ["model_name=qwen3-moe-from-hf", "override_model_config=true", "base_num_decoder_layers=4"]
  model += ["base_emb_dim=64", "base_num_query_heads=4", "base_num_kv_heads=2", "head_dim=16", "base_moe_mlp_dim=32"]
  model += ["num_experts=16", "num_experts_per_tok=4", "recipe_num_devices=4"]
  cfg = resolution.resolved(REPO / "configs/recipes/cpu/deepseek3-tiny.yml", [*model, *overrides])
  assert stage_load.Stages.of(cfg) == want
  keys = {k: int(getattr(cfg, k)) for k in ("ici_pipeline_parallelism", "dcn_pipeline_parallelism")}
  keys |= {k: int(getattr(cfg, k)) for k in ("num_pipeline_repeats", "num_layers_per_pipeline_stage")}
  keys["pipeline_parallel_layers"] = int(cfg.pipeline_parallel_layers)
  assert stage_load.Stages.of(cfg, keys=keys) == want  # as the export reads it from the run's job.json


def test_dense_layers_and_the_rest_of_the_model_are_not_moved():
  st = stage_load.Stages(stages=2, repeats=1, per_stage=1, outside=1, scan_axis=1)
  for path in [("dense_layers", "w"), ("decoder_norm", "scale"), ("moe_layers", "w"), ("pipeline_module", "x")]:
    assert stage_load.placement(path, st, is_param=True, ndim=2) is None, path
