"""A checkpoint without pipeline stages read into a pipelined model's layout (upstream/stage_load.py): every
box of every leaf kind against the stack rearranged by reshape, from a real TensorStore array."""

import itertools

import numpy as np
import pytest
import tensorstore as ts

from maxtext_moe.upstream import stage_load


def _store(x: np.ndarray):
  return ts.open({"driver": "array", "array": x, "dtype": str(x.dtype)}).result()


def _expected(stack: np.ndarray, st: stage_load.Stages, axis: int, kind: str) -> np.ndarray:
  """The pipelined leaf by reshape: the pipeline's layers (after the outside ones) as [R, S, lps, ...]."""
  n = st.stages * st.repeats * st.per_stage
  layers = np.moveaxis(np.take(stack, np.arange(st.outside, st.outside + n), axis=axis), axis, 0)
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


@pytest.mark.parametrize("stages,repeats,lps,outside,kind", CASES)
@pytest.mark.parametrize("is_param,rank", [(True, 4), (True, 2), (False, 2), (True, 1)])
def test_pipeline_leaf_from_a_stack_without_stages(stages, repeats, lps, outside, kind, is_param, rank):
  st = stage_load.Stages(stages=stages, repeats=repeats, per_stage=lps, outside=outside, scan_axis=1)
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
  where = stage_load.placement((stage_load.OUTSIDE, "a", "w"), st, is_param=True, ndim=3)
  assert where.source == ("a", "w") and where.shape(stack.shape) == (3, 2, 5)
  for box in _boxes((3, 2, 5)):
    np.testing.assert_array_equal(stage_load.read(_store(stack), where, box), stack[:, :2][box])


def test_dense_layers_and_the_rest_of_the_model_are_not_moved():
  st = stage_load.Stages(stages=2, repeats=1, per_stage=1, outside=1, scan_axis=1)
  for path in [("dense_layers", "w"), ("decoder_norm", "scale"), ("moe_layers", "w"), ("pipeline_module", "x")]:
    assert stage_load.placement(path, st, is_param=True, ndim=2) is None, path
