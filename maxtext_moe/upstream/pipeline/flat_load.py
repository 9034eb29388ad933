"""A checkpoint written without pipeline stages (every converted Hugging Face one, every run without stages)
loaded weights-only into a model with MaxText's pipeline stages.

Without stages, a scanned decoder keeps the layers the pipeline takes as one stack, the layer axis of each
Param at `param_scan_axis` (0 for the routing bias and the other non-Params, and for a Param too small to
have that axis): DeepSeek's MoE layers as `decoder/moe_layers/...` (its dense layers apart), every layer of
the other decoders (Qwen3-MoE, Mixtral) as `decoder/layers/...` (`Stack`). With S stages, R repeats (a
circular pipeline) and `lps` layers per stage, MaxText pipelines `pipeline_parallel_layers` of them as
`decoder/pipeline_module/layers/...` of shape [(R,) S, <one stage>]: a stage is one layer (lps 1: the
layer axis gone), `lps` layers scanned (`scanned_layers`, the layer axis kept, lps long) or `lps` layers
one by one (`layers_0` ...). Repeat r of stage s holds the pipeline's layers (r*S + s)*lps ... + lps - 1:
each microbatch runs through stages 0..S-1 once per repeat. The stack's other `n_out` layers run outside
the pipeline, as a stack of their own: a DeepSeek decoder's first n_out MoE layers before it
(`decoder/moe_layers_outside_pipeline`), the other decoders' last n_out layers after it
(`decoder/layers_outside_pipeline`; `layers/nnx_decoders.py`, `NNXDecoder.__call__`).

`Placement` is that map for one model leaf; `read` fills any box of it from the stored stack, one
contiguous run of layers per (repeat, stage) cell, so each process reads only the shards it holds (a 671B
expert stack is hundreds of GB). Written here because MaxText's weights-only load asks the checkpoint for
the model's own tree and has no relayout.
"""

from dataclasses import dataclass
from typing import Any

import numpy as np

PIPELINE = ("pipeline_module", "layers")
SCANNED = "scanned_layers"  # a stage of lps layers scanned (scan_layers_per_stage)


@dataclass(frozen=True)
class Stack:
  """A decoder's stack the pipeline takes its layers from: its name without stages, the name of its
  layers run outside the pipeline, and whether those run before the pipeline or after it."""

  name: str
  outside: str
  outside_first: bool


DEEPSEEK = Stack("moe_layers", "moe_layers_outside_pipeline", outside_first=True)  # its dense layers apart
GENERIC = Stack("layers", "layers_outside_pipeline", outside_first=False)  # Qwen3-MoE, Mixtral, ...


def stack_of(decoder_block: Any) -> Stack:
  """The stack of a `decoder_block` (MaxText's enum or its value)."""
  return DEEPSEEK if str(getattr(decoder_block, "value", decoder_block)).lower() == "deepseek" else GENERIC


@dataclass(frozen=True)
class Stages:
  """What a pipelined decoder's layout depends on, from a resolved MaxText config."""

  stages: int
  repeats: int
  per_stage: int
  outside: int  # layers of the stack run outside the pipeline
  scan_axis: int  # param_scan_axis
  stack: Stack = DEEPSEEK

  @classmethod
  def of(cls, cfg: Any, keys: dict[str, int] | None = None) -> "Stages | None":
    """From a resolved config; its pipeline keys from `keys` (a run's job.json) when given."""
    if keys is None and not getattr(cfg, "using_pipeline_parallelism", False):
      return None
    key = (lambda k: int(keys[k])) if keys is not None else (lambda k: int(getattr(cfg, k)))
    stack = stack_of(cfg.decoder_block)
    layers = int(cfg.num_decoder_layers) - (int(cfg.first_num_dense_layers) if stack == DEEPSEEK else 0)
    return cls(
      stages=key("ici_pipeline_parallelism") * key("dcn_pipeline_parallelism"),
      repeats=key("num_pipeline_repeats"),
      per_stage=key("num_layers_per_pipeline_stage"),
      outside=layers - key("pipeline_parallel_layers"),
      scan_axis=int(cfg.param_scan_axis),
      stack=stack,
    )

  @property
  def pipelined(self) -> int:
    return self.stages * self.repeats * self.per_stage

  @property
  def first_pipelined(self) -> int:
    """The stack's first layer the pipeline runs."""
    return self.outside if self.stack.outside_first else 0

  @property
  def first_outside(self) -> int:
    """The stack's first layer run outside the pipeline."""
    return 0 if self.stack.outside_first else self.pipelined

  def layer_axis(self, is_param: bool, ndim: int) -> int:
    """Where a stored stack keeps its layer axis (MaxText's scan moves a Param's there if it has the room)."""
    return self.scan_axis if is_param and ndim > self.scan_axis else 0


@dataclass(frozen=True)
class Placement:
  """One model leaf as layers of the stored stack: `layers` [*grid, m] is the stored layer of each grid
  cell (repeat, stage) and position; `inner` keeps the stored layer axis (m long) at `axis`, else m is 1
  and the axis is dropped."""

  source: tuple[str, ...]  # the leaf's path under the stack
  layers: np.ndarray
  inner: bool
  axis: int

  def shape(self, stored: tuple[int, ...]) -> tuple[int, ...]:
    """The model leaf's shape, from the stored stack's."""
    grid, m = self.layers.shape[:-1], self.layers.shape[-1]
    rest = list(stored)
    if self.inner:
      rest[self.axis] = m
    else:
      del rest[self.axis]
    return (*grid, *rest)


def placement(path: tuple[str, ...], stages: Stages, *, is_param: bool, ndim: int) -> Placement | None:
  """Where a pipelined model's leaf (`path` under `decoder`) comes from in the stack without stages; None
  for a leaf outside the MoE layers. `ndim` is the stored stack's rank."""
  if path[:1] == (stages.stack.outside,):
    layers = stages.first_outside + np.arange(stages.outside)
    return Placement(path[1:], layers, True, stages.layer_axis(is_param, ndim))
  if path[: len(PIPELINE)] != PIPELINE:
    return None
  rest = path[len(PIPELINE) :]
  s, r, lps = stages.stages, stages.repeats, stages.per_stage
  first = stages.first_pipelined + lps * (np.arange(r)[:, None] * s + np.arange(s)[None, :])  # [R, S]
  if rest[:1] == (SCANNED,):
    layers, inner, rest = first[..., None] + np.arange(lps), True, rest[1:]
  elif lps > 1:
    k = int(rest[0].removeprefix("layers_"))
    layers, inner, rest = first[..., None] + k, False, rest[1:]
  else:
    layers, inner = first[..., None], False
  layers = layers if r > 1 else layers[0]  # MaxText stacks repeats only in a circular pipeline
  return Placement(rest, layers, inner, stages.layer_axis(is_param, ndim))


def read(store: Any, where: Placement, index: tuple[slice, ...]) -> np.ndarray:
  """The box `index` of the model leaf, read from `store` (the stored stack: anything indexable by a
  tuple of slices whose `[...]` has `.read().result()`, a TensorStore array)."""
  g = where.layers.ndim - 1
  cells = where.layers[index[:g]]
  rest = list(index[g:])
  if where.inner:
    cells = cells[..., rest.pop(where.axis)]
  blocks = []
  for cell in np.ndindex(cells.shape[:-1]):
    run = cells[cell]
    if len(run) and np.any(np.diff(run) != 1):
      raise AssertionError(f"pipeline layout: layers {run.tolist()} of one stage are not consecutive")
    box = (*rest[: where.axis], slice(int(run[0]), int(run[-1]) + 1), *rest[where.axis :])
    block = np.asarray(store[box].read().result())
    blocks.append(block if where.inner else np.squeeze(block, axis=where.axis))
  return np.stack(blocks).reshape(*cells.shape[:-1], *blocks[0].shape)


class _Box:
  """What TensorStore's indexing gives: `.read().result()`."""

  def __init__(self, value: np.ndarray):
    self.value = value

  def read(self) -> "_Box":
    return self

  def result(self) -> np.ndarray:
    return self.value


class Unstaged:
  """One MoE-layer leaf of a pipelined checkpoint as the stack a checkpoint without stages keeps: `shape`
  and boxes (`stack[box].read().result()`), from its parts (the layers before the pipeline, the pipeline's
  leaf or one per layer of a stage), each a (stored array, `Placement`) pair."""

  def __init__(self, parts: list[tuple[Any, Placement]]):
    self.parts = parts
    self.owner: dict[int, tuple[int, tuple[int, ...], int]] = {}  # stack layer -> (part, grid cell, position)
    for i, (_, where) in enumerate(parts):
      for idx in np.ndindex(where.layers.shape):
        self.owner[int(where.layers[idx])] = (i, idx[:-1], idx[-1])
    if sorted(self.owner) != list(range(len(self.owner))):
      raise ValueError(f"pipeline layout: the parts hold layers {sorted(self.owner)}, not 0..{len(self.owner) - 1}")
    store, where = parts[0]
    rest = list(store.shape[where.layers.ndim - 1 :])
    if where.inner:
      rest[where.axis] = len(self.owner)
    else:
      rest.insert(where.axis, len(self.owner))
    self.shape, self.axis = tuple(rest), where.axis

  def __getitem__(self, box: tuple[slice, ...]) -> _Box:
    layers = range(len(self.owner))[box[self.axis]]
    rest = [b for i, b in enumerate(box) if i != self.axis]
    blocks = []
    for layer in layers:
      part, cell, pos = self.owner[layer]
      store, where = self.parts[part]
      inner = [*rest[: where.axis], slice(pos, pos + 1), *rest[where.axis :]] if where.inner else rest
      block = np.asarray(store[(*cell, *inner)].read().result())
      blocks.append(block if where.inner else np.expand_dims(block, where.axis))
    return _Box(np.concatenate(blocks, axis=self.axis))

  def read(self) -> _Box:
    return self[tuple(slice(None) for _ in self.shape)]


def staged_parts(under: tuple[str, ...], stages: Stages) -> list[tuple[str, ...]]:
  """Where a pipelined checkpoint may keep stack leaf `under` (its path below the stack), as paths under
  `decoder`: the layers outside the pipeline, then the pipeline's one leaf (a stage of one layer or of
  scanned layers) or one per layer of a stage; the caller takes those that exist."""
  paths = [(stages.stack.outside, *under)] if stages.outside else []
  if stages.per_stage == 1:
    return [*paths, (*PIPELINE, *under)]
  return [*paths, (*PIPELINE, SCANNED, *under), *((*PIPELINE, f"layers_{k}", *under) for k in range(stages.per_stage))]


def stack_rank(path: tuple[str, ...], stages: Stages, rank: int) -> int:
  """The stack's rank, from the rank of its part at `path` (under `decoder`) in a pipelined checkpoint."""
  if path[:1] == (stages.stack.outside,):
    return rank
  grid = 2 if stages.repeats > 1 else 1
  return rank - grid + (0 if path[len(PIPELINE) : len(PIPELINE) + 1] == (SCANNED,) else 1)
