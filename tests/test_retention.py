"""MaxText's `max_num_checkpoints_to_keep` with our checkpoint files, resume, preemption and final saves
(issue 60), and what the kept checkpoints take on disk.

- Orbax deletes an old step in its save finalizer's thread while training goes on, and our integrity record
  (`integrity.MANIFEST`) is written into step directories: made deterministic here by pausing Orbax's
  deletion where a write hurts it most (the step's files gone, its directory not yet), our recorder run
  then, and the deletion finished after. It wrote into the doomed step, so Orbax's last rmdir failed with
  "[Errno 39] Directory not empty" and the next save ended the run ("Checkpointing failed").
- A run with retention stopped by SIGTERM between saves, resumed to its end: the newest checkpoints kept,
  each with its record, nothing else left in checkpoints/ (ci: a training run of about two minutes).
"""

import os
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import pytest
from maxtext.common import checkpointing
from orbax.checkpoint._src.path import deleter

from maxtext_moe import integrity
from maxtext_moe.config.recipes import recipe_path
from maxtext_moe.upstream import patches
from maxtext_moe.upstream.maxtext import recovery
from maxtext_moe.upstream.maxtext.config import hyperparameters

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@dataclass
class PausedDeletion:
  """Orbax's deletion of the first step it deletes, paused where a writer into it does harm: every file
  and directory under the step removed, the step's own directory not yet (what `shutil.rmtree` does last).
  It goes on once `resume` is set; later deletions are Orbax's own."""

  emptied: threading.Event = field(default_factory=threading.Event)
  resume: threading.Event = field(default_factory=threading.Event)
  deleted: list[str] = field(default_factory=list)

  def delete(self, path_deleter: Any, path: Any, *, destination: Any = None, overwrite: bool = False) -> None:
    if self.deleted or destination is not None:
      patches.original(deleter.PathDeleter, "delete")(path_deleter, path, destination=destination, overwrite=overwrite)
      return
    self.deleted.append(Path(path).name)
    for child in Path(path).iterdir():
      shutil.rmtree(child) if child.is_dir() else child.unlink()
    self.emptied.set()
    if not self.resume.wait(120):
      raise TimeoutError("the test never resumed the paused deletion")
    os.rmdir(path)


def _config(resolution: Any, tmp_path: Path) -> Any:
  overrides = ["dataset_type=synthetic", "checkpoint_period=5", "max_num_checkpoints_to_keep=2"]
  overrides += [f"base_output_directory={tmp_path}", "run_name=r"]
  return hyperparameters(resolution.resolve(recipe_path("cpu/deepseek3-tiny"), overrides))


def test_our_records_never_race_orbaxs_deletion_of_an_old_step(resolution, tmp_path):
  """Steps 0-20 saved every 5, two kept, each step's post-save hook (where we record) called as MaxText's
  loop calls it; the first deletion (step 0, by step 10's save) paused until the step after has recorded."""
  cfg = _config(resolution, tmp_path)
  checkpoints = tmp_path / "r" / "checkpoints"
  manager = checkpointing.create_orbax_checkpoint_manager(
    str(checkpoints), True, True, 5, max_num_checkpoints_to_keep=2
  )
  paused, rec = PausedDeletion(), recovery.Recovery(integrity="checksums", announce=lambda line: None)
  state = {"w": jnp.arange(64.0)}
  pausing = False
  with patches.installed(
    [*recovery.patches(rec), patches.Patch(deleter.PathDeleter, "delete", patches.Method(paused.delete))]
  ):
    for step in range(21):
      kept_before = set(checkpointing.all_steps(manager))
      checkpointing.maybe_save_checkpoint(manager, state, cfg, None, step=step)  # records, as every step does
      if pausing:  # this step recorded while Orbax's deletion of an old step was half done
        paused.resume.set()
        pausing = False
      if kept_before - set(checkpointing.all_steps(manager)) and not paused.resume.is_set():
        assert paused.emptied.wait(120), "Orbax never started deleting the step it dropped"
        pausing = True
    checkpointing.wait_until_finished(manager)
  manager.close()
  integrity.record_completed(checkpoints, checksums=True)  # what `train` does once the trainer returned
  assert paused.deleted == ["0"]
  assert sorted(p.name for p in checkpoints.iterdir()) == ["15", "20"]
  assert [integrity.problem(checkpoints / s) for s in ("15", "20")] == [None, None]
  assert all((checkpoints / s / integrity.MANIFEST).is_file() for s in ("15", "20"))


@pytest.mark.slow
@pytest.mark.ci
def test_a_run_keeping_two_checkpoints_is_preempted_between_saves_and_resumes_to_its_end(tmp_path):
  """The CLI as a user runs it: 12 steps saved every 3, two kept; SIGTERM after step 4 (its stop saves a
  checkpoint between the periodic ones), then the printed command to the end. Every step's row once, the
  two newest checkpoints kept with their records, nothing else in checkpoints/, no traceback."""
  from test_recovery import FAST, _ok, _rows, _sigterm_after

  from conftest import run_cli

  args = ["train", "run_name=keep", "steps=12", "checkpoint_period=3", "max_num_checkpoints_to_keep=2"]
  args += ["progress=plain", *FAST]
  r = _sigterm_after(tmp_path, args, step=4)
  assert r.returncode == 75, r.stderr[-3000:]
  stopped = _rows(tmp_path, "keep")[-1]["step"]
  checkpoints = tmp_path / "runs" / "keep" / "checkpoints"
  assert sorted(int(p.name) for p in checkpoints.iterdir()) == [3, stopped], "the newest two: 3 and the stop's"
  r = run_cli(args, cwd=tmp_path)
  _ok(r)
  assert [row["step"] for row in _rows(tmp_path, "keep")] == list(range(12))
  assert sorted(p.name for p in checkpoints.iterdir()) == ["11", "9"]
  assert [integrity.problem(checkpoints / s) for s in ("9", "11")] == [None, None]
  assert all((checkpoints / s / integrity.MANIFEST).is_file() for s in ("9", "11"))
  assert "Traceback" not in r.stderr and "Checkpointing failed" not in r.stderr
