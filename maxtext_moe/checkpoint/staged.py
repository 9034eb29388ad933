"""A checkpoint written with pipeline stages, read as one without them (what export reads).

A pipelined run keeps the layers of the pipeline's stack as `decoder/pipeline_module/layers/...`
[(R,) S, ...] and those run outside the pipeline as a stack of their own (a DeepSeek run's MoE layers before
it, `decoder/moe_layers_outside_pipeline/...`; a Qwen3-MoE or Mixtral run's last layers after it,
`decoder/layers_outside_pipeline/...`; upstream/pipeline/flat_load.py has the layout); a checkpoint without stages
keeps them as one stack, `decoder/moe_layers/...` or `decoder/layers/...`. The layout depends on the run's
pipeline keys, which the checkpoint does not record: the run's `job.json` (beside `checkpoints/`) does.
"""

import json
from pathlib import Path
from typing import Any

from maxtext_moe.errors import UserError
from maxtext_moe.upstream.pipeline import flat_load as stage_load


class StagedReader:
  """`orbax_io.LeafReader`'s `shape` and `read` over a pipelined checkpoint, the pipeline's layers and those
  outside it as the one stack a checkpoint without stages has."""

  def __init__(self, reader: Any, stages: stage_load.Stages):
    self.reader, self.stages = reader, stages
    self.dir = reader.dir
    self._stacks: dict[tuple[str, ...], stage_load.Unstaged] = {}

  def _stack(self, path: tuple[str, ...]) -> stage_load.Unstaged:
    if path not in self._stacks:
      j = next(i for i in range(len(path) - 1) if path[i : i + 2] == ("decoder", self.stages.stack.name))
      head, under = path[: j + 1], path[j + 2 :]
      parts = []
      for part in stage_load.staged_parts(under, self.stages):
        try:
          store = self.reader.store((*head, *part))
        except Exception:  # pylint: disable=broad-except  # TensorStore raises several types for a missing array
          continue
        rank = stage_load.stack_rank(part, self.stages, store.rank)
        where = stage_load.placement(part, self.stages, is_param=head[:2] == ("params", "params"), ndim=rank)
        parts.append((store, where))
      self._stacks[path] = stage_load.Unstaged(parts)
    return self._stacks[path]

  def _staged(self, path: tuple[str, ...]) -> bool:
    return any(path[i : i + 2] == ("decoder", self.stages.stack.name) for i in range(len(path) - 1))

  def shape(self, path: tuple[str, ...]) -> tuple[int, ...]:
    return self._stack(path).shape if self._staged(path) else self.reader.shape(path)

  def read(self, path: tuple[str, ...], index: tuple[Any, ...] = ()) -> Any:
    if not self._staged(path):
      return self.reader.read(path, index)
    stack = self._stack(path)
    box = tuple(slice(i, i + 1) if isinstance(i, int) else i for i in index)
    box = (*box, *(slice(None) for _ in range(len(stack.shape) - len(box))))
    out = stack[box].read().result()
    return out.reshape([n for i, n in enumerate(out.shape) if i >= len(index) or not isinstance(index[i], int)])


def reader_for(reader: Any, items: Path, cfg: Any) -> Any:
  """`reader`, or a `StagedReader` over it when the checkpoint was written with pipeline stages."""
  meta = json.loads((Path(items) / "_METADATA").read_text())
  if not any(stage_load.PIPELINE[0] in key for key in meta.get("tree_metadata", {})):
    return reader
  job = Path(items).parents[2] / "job.json" if len(Path(items).parents) > 2 else None
  try:
    layout = json.loads(job.read_text())["pipeline"] if job else None
  except (OSError, ValueError, KeyError):
    layout = None
  if not layout:
    raise UserError(
      f"{items} was written with pipeline stages, and its run's job.json (RUN/job.json, which records them) "
      "is not beside it: pass the checkpoint inside its run directory"
    )
  return StagedReader(reader, stage_load.Stages.of(cfg, keys=layout))
