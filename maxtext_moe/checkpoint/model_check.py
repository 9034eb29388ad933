"""A checkpoint checked against the model it is loaded into, from its metadata only, before a job takes its GPUs.

MaxText 0.2.5 finds a checkpoint of another model (16 experts against 256, another layer count) only in the
restore, after every node was allocated. What its restores refuse is what is refused here, and nothing else:

- `load_parameters_path` (`checkpointing.load_params_from_path`, with `upstream/maxtext/weights_load.py`):
  every variable of the model must be there at the model's shape. A Param is read at `params/params/<path>`;
  another variable (DeepSeek's routing bias, `MoEBiasVar`) at `nnx_aux/model/<path>` (a run's own
  checkpoint, our load), `params/<its collection>/<path>` (a converted one) or `params/params/<path>`
  (MaxText's alias for checkpoints older than the collection). A missing one (a LoRA adapter excepted), or a
  shape that differs, is "Checkpoint does not match the model" (`_weight_mismatches`).
- `load_full_state_path` (`_load_linen_checkpoint_into_nnx`): the Params likewise; the other variables are
  taken where present, else they keep their initial values.
- Both: a leaf the model does not ask for is ignored (a warning, `_log_unconsumed_checkpoint_weights`), so it
  is not refused here; Orbax casts a stored dtype to the model's, so dtypes are not compared.
- A checkpoint written without pipeline stages loads into a model with them (`upstream/pipeline/flat_load.py`):
  a pipelined model's tree is compared as the stack a checkpoint without stages keeps (`staged.StagedReader`
  over the model's shapes). One written with stages loads only into the same stages, by name.

Hand-written because MaxText's own pre-load comparison (`_weight_mismatches` against `ocp.metadata`) needs
the model's abstract state, which exists only inside its trainer, with the devices. Here the model's tree
comes from `upstream.maxtext.model.param_leaves` (a trace, nothing allocated) and the checkpoint's from its
`_METADATA` (the leaf names) and each array's own metadata (shape), never a tensor's data. A remote
checkpoint (gs://, s3://) is left to the restore, as is one whose metadata cannot be read.
"""

import ast
import json
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from maxtext_moe.checkpoint.model_spec import MODEL_YAML
from maxtext_moe.checkpoint.orbax_io import ITEMS, LeafReader
from maxtext_moe.checkpoint.staged import StagedReader
from maxtext_moe.errors import UserError
from maxtext_moe.upstream.pipeline import flat_load as stage_load

Leaf = tuple[tuple[str, ...], tuple[int, ...], tuple[str | None, ...]]
Name = tuple[str, ...]
PARAMS = ("params", "params")  # where a checkpoint keeps the Params
AUX = ("nnx_aux", "model")  # where a run's own checkpoint keeps the model's other variables
MAY_BE_MISSING = ("lora_a", "lora_b")  # MaxText's restore lets these start fresh


@dataclass(frozen=True)
class ModelTree:
  """The model's parameters (`param_leaves`), `name`d in messages; `stages`: the pipeline the leaves are laid
  out in (None: leaves without stages); `staged`: whether the run has stages (a one-device tree has none)."""

  name: str
  leaves: list[Leaf]
  stages: stage_load.Stages | None = None
  staged: bool = False

  @classmethod
  def as_run(cls, cfg: Any, leaves: list[Leaf]) -> "ModelTree":
    """The tree of the run's own config (its stages included), as `train` traces it."""
    stages = stage_load.Stages.of(cfg)
    return cls(str(cfg.model_name), leaves, stages, staged=stages is not None)


class Checkpoint:
  """A local Orbax PyTree checkpoint: its leaf names (in `_METADATA`'s order) and their shapes, each read from
  its array's metadata when asked."""

  def __init__(self, given: str, items: Path, order: list[Name], *, full_state: bool):
    self.given, self.items, self.order, self.full_state = given, items, order, full_state
    self.names = set(order)
    self.reader = LeafReader(items)

  @property
  def staged(self) -> bool:
    """Written with pipeline stages."""
    return any(stage_load.PIPELINE[0] in name for name in self.order)

  def shape(self, name: Name) -> tuple[int, ...] | None:
    """The stored shape, None when TensorStore cannot open the array (the restore then says why)."""
    try:
      return self.reader.shape(name)
    except Exception:  # pylint: disable=broad-except  # TensorStore raises several types for an unreadable array
      return None


def local_checkpoint(cfg: Any) -> Checkpoint | None:
  """The checkpoint `load_parameters_path` (else `load_full_state_path`) names, if it is local and has Orbax's
  `_METADATA` (the path itself, or its `items`, as MaxText reads it)."""
  given = str(cfg.load_parameters_path or cfg.load_full_state_path or "")
  if not given or "://" in given:
    return None
  items = Path(given) if (Path(given) / "_METADATA").is_file() else Path(given) / ITEMS
  try:
    tree = json.loads((items / "_METADATA").read_text())["tree_metadata"]
    order = [tuple(ast.literal_eval(key)) for key in tree]
  except (OSError, ValueError, KeyError, TypeError, SyntaxError):
    return None  # config.checks.check_finetune_has_weights names a missing or foreign checkpoint
  return Checkpoint(given, items, order, full_state=not cfg.load_parameters_path)


def check_scan_axis(cfg: Any, ckpt: Checkpoint | None = None) -> None:
  """A checkpoint's stacked layer weights carry their layer axis where `param_scan_axis` says (MaxText reads
  them as they are, and a mismatch is a traceback listing every tensor): the converter, and a run at
  MaxText's default, write it at 1; offload=optimizer_params sets 0. Read off one layer norm's scale:
  (emb, layers) at 1, (layers, emb) at 0."""
  ckpt = ckpt or local_checkpoint(cfg)
  if ckpt is None or not bool(cfg.scan_layers):
    return
  norm = next((n for n in ckpt.order if n[-2:] == ("pre_self_attention_layer_norm", "scale")), None)
  shape = ckpt.shape(norm) if norm else None
  emb, want = int(cfg.emb_dim), int(cfg.param_scan_axis)
  if shape is None or len(shape) != 2 or shape[0] == shape[1] or emb not in shape:
    return
  stored = 1 - shape.index(emb)
  if stored != want:
    why = " (offload=optimizer_params sets it: MaxText offloads parameters only so)" * (want == 0)
    fix = "use offload=optimizer" if want == 0 else f"set param_scan_axis={stored}"
    raise UserError(
      f"{ckpt.given} stores its stacked layer weights with the layer axis at {stored} (a converted checkpoint, "
      f"or a run at MaxText's default, has 1), and this config reads them at param_scan_axis={want}{why}: {fix}"
    )


def check(cfg: Any, tree: ModelTree) -> None:
  """The checkpoint `cfg` loads holds `tree`'s parameters as its restore needs them: else a UserError naming
  the first tensor that differs, with both shapes, or the first one missing. The layer axis first, with
  its own message (`check_scan_axis`)."""
  ckpt = local_checkpoint(cfg)
  if ckpt is None:
    return
  check_scan_axis(cfg, ckpt)
  if ckpt.staged and tree.staged and tree.stages is None:
    return  # the run's stages are not in a one-device tree; the restore compares them by name
  unstage = tree.stages is not None and not ckpt.staged
  found = [d for d in (_difference(ckpt, row) for row in _rows(tree, ckpt.full_state, unstage=unstage)) if d]
  if found:
    raise UserError(_line(cfg, tree, ckpt, found))


@dataclass(frozen=True)
class _Row:
  """One model variable: its name in messages, where a checkpoint may keep it (in the order the restore
  looks), its shape, and whether the restore fails without it."""

  label: str
  stored: tuple[Name, ...]
  shape: tuple[int, ...]
  required: bool


def _rows(tree: ModelTree, full_state: bool, *, unstage: bool) -> list[_Row]:
  """The model's variables as a checkpoint holds them, the Params first (the routing bias's expert count is
  the gate's)."""
  shapes = {("params", *path): tuple(shape) for path, shape, _ in tree.leaves}
  if unstage and tree.stages is not None:
    shapes = _unstaged(shapes, tree.stages)
  rows = [_row(name, shape, full_state) for name, shape in shapes.items()]
  return sorted(rows, key=lambda r: r.stored[0][:2] != PARAMS)


def _row(name: Name, shape: tuple[int, ...], full_state: bool) -> _Row:
  collection, path = name[1], name[2:]
  label = ".".join(name[1:])
  if collection == PARAMS[1]:
    return _Row(label, (name,), shape, required=not any(k in label for k in MAY_BE_MISSING))
  others = ((*AUX, *path), name)
  return _Row(label, others if full_state else (*others, (*PARAMS, *path)), shape, required=not full_state)


class _Shapes:
  """The model's leaves where `StagedReader` reads a checkpoint's: `store(name)` has a shape and a rank."""

  dir = None

  def __init__(self, shapes: dict[Name, tuple[int, ...]]):
    self.shapes = shapes

  def store(self, name: Name) -> SimpleNamespace:
    return SimpleNamespace(shape=self.shapes[name], rank=len(self.shapes[name]))

  def shape(self, name: Name) -> tuple[int, ...]:
    return self.shapes[name]


def _unstaged(shapes: dict[Name, tuple[int, ...]], stages: stage_load.Stages) -> dict[Name, tuple[int, ...]]:
  """A pipelined model's leaves as a checkpoint without stages keeps them: the pipeline's and those outside it
  as the one stack they are laid out from."""
  reader = StagedReader(_Shapes(shapes), stages)
  out: dict[Name, tuple[int, ...]] = {}
  for name, shape in shapes.items():
    where = None
    if name[2:3] == ("decoder",):
      where = stage_load.placement(name[3:], stages, is_param=name[1] == PARAMS[1], ndim=0)
    if where is None:
      out[name] = shape
      continue
    flat = (*name[:3], stages.stack.name, *where.source)
    if flat not in out:
      out[flat] = tuple(reader.shape(flat))
  return out


def _difference(ckpt: Checkpoint, row: _Row) -> tuple[_Row, tuple[int, ...] | None] | None:
  """(row, the stored shape) when it differs, (row, None) when a required variable is missing, else None."""
  name = next((n for n in row.stored if n in ckpt.names), None)
  if name is None:
    return (row, None) if row.required else None
  shape = ckpt.shape(name)
  return None if shape is None or shape == row.shape else (row, shape)


def _dims(shape: tuple[int, ...]) -> str:
  return f"[{', '.join(map(str, shape))}]"


def _line(cfg: Any, tree: ModelTree, ckpt: Checkpoint, found: list) -> str:
  row, shape = found[0]
  if shape is None:
    what = f"{row.label} ({_dims(row.shape)} in {tree.name}) is not in the checkpoint"
  else:
    what = f"{row.label} is {_dims(shape)} in the checkpoint, {_dims(row.shape)} in {tree.name}"
  n = len(found) - 1
  more = f"; {n} more tensor{'s' * (n > 1)} differ{'s' * (n == 1)}" if n else ""
  return f"{ckpt.given} does not hold this model's parameters: {what}{more} ({_fix(cfg, tree, ckpt)})"


def _fix(cfg: Any, tree: ModelTree, ckpt: Checkpoint) -> str:
  """What to change: the stages it was written with, the model next to it (a conversion's OUT/model.yml, a
  run's RUN/model.yml), or the checkpoint."""
  if ckpt.staged and not tree.staged:
    return "it was written with pipeline stages and loads only into the same stages: train with its run's keys"
  near = [ckpt.items.parent, *ckpt.items.parents[2:3]]  # OUT/items, RUN/checkpoints/STEP/items
  theirs = next((d / MODEL_YAML for d in near if (d / MODEL_YAML).is_file()), None)
  if theirs is None:
    return f"load a checkpoint of {tree.name}, or set the model keys it was written with"
  if cfg.model_file and Path(cfg.model_file).resolve() == theirs.resolve():
    return f"the overrides change the model of model_file={cfg.model_file}: drop those that change its shapes"
  return f"its model is {theirs}: pass model_file={theirs}, or load a checkpoint of {tree.name}"
