"""How a run ends on its data, at MaxText's grain reader, data loader and loop (`DataEndPatches`, installed
by `trainer.run_trainer` for one run).

MaxText's data loader turns every failure to make a batch (the end of the data, a row its tokenizer cannot
take, anything else) into StopTraining, which its loop takes as a normal end: the run exited 0 without a
checkpoint of its last steps and without a word about the row. Here:
- `input_pipeline_utils.make_parquet_iter_dataset` -> MaxText's reader of one Parquet file, its rows through
  `data.rows.Checked` with the run's row check: a row the run cannot use raises BadRow naming its file;
- `DataLoader.load_next_batch_pre_sharding` -> MaxText's, its StopTraining told apart by its cause (the
  end of the data, a bad row, a failure); the processes of a job agree on it (an all-gather of one number
  per step when there are several, since they must stop at the same step; a bad row's line is then
  gathered from its process), the iterator is set back to its state before the batch it could not finish,
  and DataStop is raised;
- `train.training_loop_iteration` -> MaxText's; on DataStop (or, in a one-process run, a bad row of the
  held-out files) it saves the last completed step as MaxText saves its last (`maybe_save_checkpoint`
  without a step), keeps what ended the run in `DataEnd` for the launcher, and ends MaxText's loop.
"""

from dataclasses import dataclass
from typing import Any

import jax
import numpy as np
from maxtext.common import checkpointing, data_loader
from maxtext.input_pipeline import input_pipeline_utils
from maxtext.trainers.pre_train import train
from maxtext.utils import exceptions

from maxtext_moe.data import rows
from maxtext_moe.upstream.patches import Method, Patch, original

RAN_OUT, FAILED, BAD_ROW = "ran_out", "failed", "bad_row"
KINDS = (None, RAN_OUT, FAILED, BAD_ROW)  # what a job reports when its processes differ: the last named
LINE_BYTES = 1024  # a bad row's line as gathered from its process


@dataclass
class DataEnd:
  """One run's row check, and what ended the run when its data did (`kind` None: it did not)."""

  check: rows.RowCheck | None = None
  column: str = ""
  kind: str | None = None
  line: str = ""
  step: int = 0  # the step whose batch could not be made (0-based)
  saved: int | None = None  # the checkpoint that holds the last completed step (None: none)


class DataStop(Exception):
  """The processes agreed that the data ended the run (`kind`, `line`)."""

  def __init__(self, kind: str, line: str):
    super().__init__(kind, line)
    self.kind, self.line = kind, line


@dataclass(frozen=True)
class CheckedParquet:
  """`make_parquet_iter_dataset`: MaxText's reader of one file, each row through `check`. An object, not a
  bound method: grain pickles the pipeline into its worker processes, where MaxText's own function is the
  module's attribute (spawned) or kept by `patches` (forked)."""

  check: rows.RowCheck

  def __call__(self, path: str, hf_access_token: str | None = None) -> Any:
    dataset = original(input_pipeline_utils, "make_parquet_iter_dataset")(path, hf_access_token=hf_access_token)
    return dataset.map(rows.Checked(str(path), self.check))


def _cause(err: BaseException) -> BaseException | None:
  """The exception MaxText's loader guard turned into StopTraining: the first end of data or bad row down
  the chain, else the innermost."""
  seen = err.__cause__ or err.__context__
  while seen is not None and not isinstance(seen, StopIteration | rows.BadRow):
    below = seen.__cause__ or seen.__context__
    if below is None:
      break
    seen = below
  return seen


def _first_line(err: BaseException) -> str:
  text = str(err).strip()
  return f"{type(err).__name__}: {text.splitlines()[0][:200]}" if text else type(err).__name__


def _agree(mine: tuple[str, str] | None) -> tuple[str, str] | None:
  """What every process of the job says ended its data at this step (None: nothing), the same on all."""
  if jax.process_count() == 1:
    return mine
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

  code = KINDS.index(mine[0] if mine else None)
  codes = np.asarray(multihost_utils.process_allgather(np.array([code], np.int32))).reshape(-1)
  worst = int(codes.max())
  if worst == 0:
    return None
  text = (mine[1] if mine and code == worst else "").encode()[:LINE_BYTES].ljust(LINE_BYTES, b"\0")
  lines = np.asarray(multihost_utils.process_allgather(np.frombuffer(text, np.uint8)))
  first = int(np.argmax(codes == worst))
  said = bytes(lines.reshape(len(codes), LINE_BYTES)[first]).rstrip(b"\0").decode(errors="replace")
  return KINDS[worst], said or f"process {first} could not make its batch"


def _state(iterator: Any) -> Any:
  try:
    return iterator.get_state()
  except Exception:  # pylint: disable=broad-except  # an iterator without a state: nothing to set back
    return None


class DataEndPatches:
  """MaxText's Parquet reader, data loader and loop iteration, as bound methods over one run's `DataEnd`."""

  def __init__(self, end: DataEnd):
    self.end = end

  def patches(self) -> list[Patch]:
    found = [
      Patch(data_loader.DataLoader, "load_next_batch_pre_sharding", Method(self.load_next_batch_pre_sharding)),
      Patch(train, "training_loop_iteration", self.training_loop_iteration),
    ]
    if self.end.check is not None:
      found.append(Patch(input_pipeline_utils, "make_parquet_iter_dataset", CheckedParquet(self.end.check)))
    return found

  def _problem(self, err: exceptions.StopTraining) -> tuple[str, str]:
    cause = _cause(err)
    if isinstance(cause, StopIteration):
      return RAN_OUT, "the training data ran out"
    if isinstance(cause, rows.BadRow):
      return BAD_ROW, self.where(cause)
    return FAILED, f"MaxText's data pipeline failed ({_first_line(cause or err)})"

  def where(self, bad: rows.BadRow) -> str:
    """A bad row's one line, with its row number when its file still has it."""
    found = rows.first_bad(bad.path, self.end.column, self.end.check) if self.end.check else None
    return found or str(bad)

  def load_next_batch_pre_sharding(self, loader: Any) -> Any:
    """MaxText's next batch; DataStop, on every process, when any process's data ended."""
    iterator = getattr(loader.data_iterator, "local_iterator", loader.data_iterator)
    before = _state(iterator)
    try:
      batch, mine = original(data_loader.DataLoader, "load_next_batch_pre_sharding")(loader), None
    except exceptions.StopTraining as e:
      batch, mine = None, self._problem(e)
    agreed = _agree(mine)
    if agreed is None:
      return batch
    if before is not None:  # the checkpoint of the last completed step reads on from its last batch
      try:
        iterator.set_state(before)
      except Exception:  # pylint: disable=broad-except  # a pipeline whose workers failed: saved where it stopped
        pass
    raise DataStop(*agreed)

  def training_loop_iteration(self, jax_device_state: dict, python_vars: dict, immutable_data: dict) -> Any:
    """MaxText's iteration; when the data ended the run: the last completed step saved, the loop ended."""
    try:
      return original(train, "training_loop_iteration")(jax_device_state, python_vars, immutable_data)
    except DataStop as e:
      ended, save = (e.kind, e.line), True
    except rows.BadRow as e:  # the held-out files: each process reads its own, so only one process can save
      ended, save = (BAD_ROW, self.where(e)), jax.process_count() == 1
    self.end.kind, self.end.line, self.end.step = *ended, int(python_vars["step"])
    if save:
      self.end.saved = self._save(jax_device_state, python_vars, immutable_data)
    raise exceptions.StopTraining(self.end.line)

  def _save(self, jax_device_state: dict, python_vars: dict, immutable_data: dict) -> int | None:
    """The last completed step's checkpoint (MaxText's save at the end of its loop); its step, or the
    newest checkpoint's where that already holds it."""
    manager = python_vars["checkpoint_manager"]
    if manager is None:
      return None
    done, latest = int(python_vars["step"]) - 1, checkpointing.latest_step(manager)
    keep = immutable_data["save_checkpoint_on_completion"] and done >= int(immutable_data["start_step"])
    if not keep or (latest is not None and latest >= done):
      return latest
    config = immutable_data["config"]
    checkpointing.maybe_save_checkpoint(manager, jax_device_state["state"], config, python_vars["data_iterator"])
    checkpointing.wait_until_finished(manager)
    return done


def patches(end: DataEnd) -> list[Patch]:
  return DataEndPatches(end).patches()
