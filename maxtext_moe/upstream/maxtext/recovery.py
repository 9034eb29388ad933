"""Keeping a run's work when something goes wrong, at MaxText's checkpoint and optimizer seams.

- **Preemption.** MaxText saves a checkpoint at a step where `checkpointing.reached_preemption` is true
  (with `enable_autocheckpoint`, on in our base.yml) and then stops the loop (StopTraining). In a
  multi-process job that is JAX's preemption sync point: JAX catches SIGTERM and all processes agree on the
  step. A single process has no such service, so `Recovery.request_stop` (the launcher's signal handler)
  makes it true at the next step. Either way `stopped_at` records the step.
- **Resume.** `load_state_if_possible` resumes from the newest checkpoint that can be read. When the newest
  cannot, the older ones are tried; only when an older one loads are the newer ones moved to
  RUN/unreadable_checkpoints/ (so a config that fits none of them fails with one line, nothing moved).
- **Non-finite loss, skip mode.** The optimizer is wrapped in `optax.apply_if_finite`: a step whose
  gradients are not finite changes neither the weights nor the optimizer moments.
"""

import datetime
import math
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import optax
from maxtext.common import checkpointing
from maxtext.optimizers import optimizers
from maxtext.utils import exceptions

from maxtext_moe import integrity, stderr
from maxtext_moe.errors import UserError
from maxtext_moe.upstream.patches import Patch, original

UNREADABLE = "unreadable_checkpoints"
RESTORE_LOG = "checkpoint_restore.log"  # what a failed restore printed, in the run directory


def restore_log(checkpoint_dir: Path) -> Path:
  """This process's restore log, next to the checkpoints: one file per process (each truncates and removes
  its own; a shared one was removed under another process still writing it)."""
  index = jax.process_index()
  return checkpoint_dir.parent / (RESTORE_LOG if index == 0 else f"checkpoint_restore.{index}.log")


class NonFiniteLoss(Exception):
  """A training step's loss was NaN or Inf and the run must stop (on_nonfinite_loss)."""

  def __init__(self, step: int, kind: str, skipped: int):
    super().__init__(f"loss {kind} at step {step + 1}")
    self.step, self.kind, self.skipped = step, kind, skipped


@dataclass
class NonFiniteGuard:
  """The on_nonfinite_loss policy, step by step: stop at the first NaN/Inf loss, or (skip) let the
  optimizer skip such steps' updates (`optax.apply_if_finite`) until `max_skips` come in a row."""

  skip: bool = False
  max_skips: int = 3
  in_a_row: int = 0
  skipped: int = 0

  def observe(self, step: int, loss: float | None) -> tuple[dict[str, Any], NonFiniteLoss | None]:
    """(notes for the step's metrics row, the stop to raise once the row is written, or None)."""
    bad = loss is not None and not math.isfinite(loss)
    self.in_a_row = self.in_a_row + 1 if bad else 0
    if not bad:
      return {}, None
    notes = {}
    if self.skip:
      notes["nonfinite_skipped"] = True
      self.skipped += 1
    if not self.skip or self.in_a_row >= self.max_skips:
      return notes, NonFiniteLoss(step, "nan" if math.isnan(loss) else "inf", self.skipped)
    return notes, None


@dataclass
class Recovery:
  """One run's recovery state, shared by the launcher and the patches."""

  fallback: bool = True
  nonfinite: NonFiniteGuard = field(default_factory=NonFiniteGuard)
  integrity: str = "checksums"  # checkpoint_integrity: checksums, sizes or off
  announce: Callable[[str], None] = print  # one line to the user (process 0 only)
  stop_requested: bool = False
  stopped_at: int | None = None
  resumed_from: int | None = None
  moved: list[str] = field(default_factory=list)

  def request_stop(self) -> None:
    self.stop_requested = True


def _agree(ok: bool) -> bool:
  """Whether every process of the job says ok (one process: its own answer)."""
  if jax.process_count() == 1:
    return ok
  import numpy as np  # pylint: disable=import-outside-toplevel
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

  return bool(np.all(multihost_utils.process_allgather(np.array([int(ok)], np.int32))))


def _first_line(e: BaseException) -> str:
  text = str(e).strip()
  return f"{type(e).__name__}: {text.splitlines()[0][:160] if text else ''}".rstrip(": ")


def _move_aside(directory: Path, steps: list[int]) -> list[str]:
  """Moves step directories under RUN/unreadable_checkpoints/ (process 0; the others wait)."""
  stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
  target = directory.parent / UNREADABLE
  moved = []
  if jax.process_index() == 0:
    target.mkdir(exist_ok=True)
    for step in steps:
      dest = target / f"{step}-{stamp}"
      shutil.move(str(directory / str(step)), dest)
      moved.append(str(dest))
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

    multihost_utils.sync_global_devices("maxtext_moe_unreadable_checkpoints_moved")
  return moved


def _report(rec: Recovery, checkpoint_manager: Any, good: int, failures: list[tuple[int, str]]) -> None:
  moved = _move_aside(Path(checkpoint_manager.directory), [s for s, _ in failures])
  checkpoint_manager.reload()
  rec.moved += moved
  for (step, why), dest in zip(failures, moved or [""] * len(failures), strict=True):
    rec.announce(
      f"maxtext-moe: warning: checkpoint {step} cannot be read ({why}); moved to {dest or UNREADABLE}, "
      f"resuming from checkpoint {good}"
    )


class RecoveryPatches:
  """MaxText's checkpoint, preemption and optimizer seams, as bound methods over one run's `Recovery`."""

  def __init__(self, rec: Recovery):
    self.rec = rec

  def patches(self) -> list[Patch]:
    return [
      Patch(checkpointing, "load_state_if_possible", self.load_state_if_possible),
      Patch(checkpointing, "reached_preemption", self.reached_preemption),
      Patch(checkpointing, "save_checkpoint", self.save_checkpoint),
      Patch(checkpointing, "_handle_post_checkpoint_preemption", self.handle_post_checkpoint_preemption),
      Patch(optimizers, "get_optimizer", self.get_optimizer),
    ]

  def load_state_if_possible(self, checkpoint_manager, *args, step=-1, **kwargs):
    """MaxText's restore, from the newest checkpoint that every process can read."""
    load = original(checkpointing, "load_state_if_possible")
    if checkpoint_manager is None or step >= 0 or not hasattr(checkpoint_manager, "reload"):
      return load(checkpoint_manager, *args, step=step, **kwargs)
    steps = sorted(checkpointing.all_steps(checkpoint_manager), reverse=True)
    failures: list[tuple[int, str]] = []
    log = restore_log(Path(checkpoint_manager.directory))
    for candidate in steps:
      damage = self._damage(Path(checkpoint_manager.directory) / str(candidate))
      if damage is not None:
        restored, error = None, RuntimeError(damage)
      else:
        try:
          with stderr.diverted(log):
            restored, error = load(checkpoint_manager, *args, step=candidate, **kwargs), None
        except Exception as e:  # pylint: disable=broad-except  # any failure to read this checkpoint
          restored, error = None, e
      if _agree(error is None):
        self._resumed(checkpoint_manager, candidate, failures)
        return restored
      failures.append((candidate, _first_line(error) if error else "unreadable on another process"))
      if not self.rec.fallback:
        break
    if failures:
      raise self._unreadable(Path(checkpoint_manager.directory), len(steps), failures)
    return load(checkpoint_manager, *args, step=step, **kwargs)

  def _damage(self, step_dir: Path) -> str | None:
    """Why a checkpoint does not match what its save recorded (`integrity`), agreed by every process before
    any of them reads it (process 0 checks; a read is collective, so all skip it or none)."""
    found = integrity.problem(step_dir) if self.rec.integrity != "off" and jax.process_index() == 0 else None
    return None if _agree(found is None) else (found or "damaged on process 0")

  def record(self, checkpoint_manager: Any) -> None:
    """Process 0 records the checkpoints whose saves have completed since (`integrity.record_completed`),
    of those the manager keeps: never one its retention (max_num_checkpoints_to_keep) is deleting."""
    if self.rec.integrity != "off" and jax.process_index() == 0 and checkpoint_manager is not None:
      kept = checkpointing.all_steps(checkpoint_manager)
      checksums = self.rec.integrity == "checksums"
      integrity.record_completed(Path(checkpoint_manager.directory), checksums=checksums, steps=kept)

  def _resumed(self, checkpoint_manager: Any, good: int, failures: list[tuple[int, str]]) -> None:
    if failures:
      _report(self.rec, checkpoint_manager, good, failures)
      # The failed reads' threads print "Event loop is closed" tracebacks until the process ends: from now
      # on fd 2 goes to the restore log (the run's own lines go to standard output or `stderr.say`).
      stderr.divert_rest(restore_log(Path(checkpoint_manager.directory)))
    self.rec.resumed_from = good
    self.rec.announce(f"maxtext-moe: resuming from checkpoint {good} ({checkpoint_manager.directory}/{good})")

  def _unreadable(self, where: Path, count: int, failures: list[tuple[int, str]]) -> UserError:
    newest, why = failures[0]
    log = restore_log(where)
    stderr.divert_rest(log)  # the failed reads' threads still print
    if not self.rec.fallback:
      return UserError(
        f"checkpoint {newest} in {where} cannot be read ({why}; details in {log}); "
        "set checkpoint_fallback=true to resume from the newest readable one"
      )
    return UserError(
      f"none of the {count} checkpoints in {where} can be read with this config (checkpoint {newest}: "
      f"{why}); nothing was moved: check the config against the run's, or use a new run_name"
    )

  def reached_preemption(self, checkpoint_manager, step: int) -> bool:
    """MaxText's preemption test, also true at the next step once a signal asked this process to stop."""
    rec = self.rec
    hit = original(checkpointing, "reached_preemption")(checkpoint_manager, step)
    hit = hit or (rec.stop_requested and jax.process_count() == 1)
    if hit and rec.stopped_at is None:
      rec.stopped_at = int(step)
    return hit

  def handle_post_checkpoint_preemption(self, checkpoint_manager, step, force_ckpt_save):
    """MaxText would stop right after saving step k, before it hands step k's metrics to its logger, so
    that row would be missing from metrics.jsonl. So: save k, let the logger take k's row, and stop at
    k + 1 before anything of it is saved or logged (a resume replays k + 1 exactly)."""
    rec = self.rec
    self.record(checkpoint_manager)
    if rec.stopped_at is None:
      if rec.stop_requested:  # the signal came after this step's save decision: the next step saves
        return None
      return original(checkpointing, "_handle_post_checkpoint_preemption")(checkpoint_manager, step, force_ckpt_save)
    checkpointing.wait_until_finished(checkpoint_manager)
    self.record(checkpoint_manager)
    if int(step) > rec.stopped_at:
      raise exceptions.StopTraining(f"stop requested; checkpoint {rec.stopped_at} saved")
    return None

  def save_checkpoint(self, checkpoint_manager, step, state, config=None, data_iterator=None, force=False):
    """Orbax's save policy declines a step off the checkpoint period unless its own preemption check (JAX's
    service, multi-process only) agrees, and MaxText passes force=False there: force the stop's save."""
    stopped_at = self.rec.stopped_at
    if stopped_at is not None and int(step) > stopped_at:
      return False  # the extra step after a stop request is never kept: a resume replays it
    force = force or (stopped_at is not None and int(step) == stopped_at)
    return original(checkpointing, "save_checkpoint")(checkpoint_manager, step, state, config, data_iterator, force)

  def get_optimizer(self, *args, **kwargs):
    """MaxText's optimizer, wrapped in `optax.apply_if_finite` under on_nonfinite_loss=skip. The launcher
    counts the skipped steps and gives up after max_nonfinite_skips in a row; optax's own limit (after
    which it applies the update anyway) must never be reached first."""
    tx = original(optimizers, "get_optimizer")(*args, **kwargs)
    return optax.apply_if_finite(tx, max_consecutive_errors=2**30) if self.rec.nonfinite.skip else tx


def patches(rec: Recovery) -> list[Patch]:
  return RecoveryPatches(rec).patches()


def remove_incomplete_saves(checkpoint_dir: Path) -> list[str]:
  """Removes what an interrupted Orbax save leaves (`*.orbax-checkpoint-tmp*`); returns their names."""
  if jax.process_index() != 0 or not checkpoint_dir.is_dir():
    return []
  removed = []
  for path in sorted(checkpoint_dir.iterdir()):
    if ".orbax-checkpoint-tmp" in path.name and _remove(path):
      removed.append(path.name)
  return removed


def _remove(path: Path, *, wait_s: float = 10.0) -> bool:
  """Removes `path`, again while a background writer of the failed save (Orbax's async threads, which
  outlive the error that ended the run) recreates files under it; True once it is gone. What is said
  removed is gone; what is not is left for the next run's start, which removes it."""
  deadline = time.monotonic() + wait_s
  while True:
    shutil.rmtree(path, ignore_errors=True)
    if not path.exists():
      time.sleep(0.2)  # a writer that was mid-file may create its directory again: look once more
      if not path.exists():
        return True
    if time.monotonic() > deadline:
      return False
    time.sleep(0.2)
