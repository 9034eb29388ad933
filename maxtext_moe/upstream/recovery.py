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
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import optax
from maxtext.common import checkpointing
from maxtext.optimizers import optimizers
from maxtext.utils import exceptions

from maxtext_moe import stderr
from maxtext_moe.errors import UserError
from maxtext_moe.upstream.patches import Patch, original

UNREADABLE = "unreadable_checkpoints"
RESTORE_LOG = "checkpoint_restore.log"  # what a failed restore printed, in the run directory


@dataclass
class Recovery:
  """One run's recovery state, shared by the launcher and the patches."""

  fallback: bool = True
  skip_nonfinite: bool = False
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


def _load_with_fallback(rec: Recovery) -> Callable:
  load = original(checkpointing, "load_state_if_possible")

  def load_state_if_possible(checkpoint_manager, *args, step=-1, **kwargs):
    if checkpoint_manager is None or step >= 0 or not hasattr(checkpoint_manager, "reload"):
      return load(checkpoint_manager, *args, step=step, **kwargs)
    steps = sorted(checkpointing.all_steps(checkpoint_manager), reverse=True)
    failures: list[tuple[int, str]] = []
    for candidate in steps:
      log = Path(checkpoint_manager.directory).parent / RESTORE_LOG
      try:
        with stderr.diverted(log):
          restored, error = load(checkpoint_manager, *args, step=candidate, **kwargs), None
      except Exception as e:  # pylint: disable=broad-except  # any failure to read this checkpoint
        restored, error = None, e
      if _agree(error is None):
        if failures:
          _report(rec, checkpoint_manager, candidate, failures)
        rec.resumed_from = candidate
        rec.announce(f"maxtext-moe: resuming from checkpoint {candidate} ({checkpoint_manager.directory}/{candidate})")
        return restored
      failures.append((candidate, _first_line(error) if error else "unreadable on another process"))
      if not rec.fallback:
        break
    if failures:
      newest, why = failures[0]
      where = Path(checkpoint_manager.directory)
      stderr.divert_rest(where.parent / RESTORE_LOG)  # the failed reads' threads still print
      if not rec.fallback:
        raise UserError(
          f"checkpoint {newest} in {where} cannot be read ({why}; details in {where.parent / RESTORE_LOG}); "
          "set checkpoint_fallback=true to resume from the newest readable one"
        )
      raise UserError(
        f"none of the {len(steps)} checkpoints in {where} can be read with this config (checkpoint {newest}: "
        f"{why}); nothing was moved: check the config against the run's, or use a new run_name"
      )
    return load(checkpoint_manager, *args, step=step, **kwargs)

  return load_state_if_possible


def _report(rec: Recovery, checkpoint_manager: Any, good: int, failures: list[tuple[int, str]]) -> None:
  moved = _move_aside(Path(checkpoint_manager.directory), [s for s, _ in failures])
  checkpoint_manager.reload()
  rec.moved += moved
  for (step, why), dest in zip(failures, moved or [""] * len(failures), strict=True):
    rec.announce(
      f"maxtext-moe: warning: checkpoint {step} cannot be read ({why}); moved to {dest or UNREADABLE}, "
      f"resuming from checkpoint {good}"
    )


def _preemption(rec: Recovery) -> Callable:
  reached = original(checkpointing, "reached_preemption")

  def reached_preemption(checkpoint_manager, step: int) -> bool:
    hit = reached(checkpoint_manager, step) or (rec.stop_requested and jax.process_count() == 1)
    if hit and rec.stopped_at is None:
      rec.stopped_at = int(step)
    return hit

  return reached_preemption


def _stop_one_step_later(rec: Recovery) -> Callable:
  after_save = original(checkpointing, "_handle_post_checkpoint_preemption")

  def handle_post_checkpoint_preemption(checkpoint_manager, step, force_ckpt_save):
    # MaxText would stop right after saving step k, before it hands step k's metrics to its logger, so
    # that row would be missing from metrics.jsonl. So: save k, let the logger take k's row, and stop at
    # k + 1 before anything of it is saved or logged (a resume replays k + 1 exactly).
    if rec.stopped_at is None:
      if rec.stop_requested:  # the signal came after this step's save decision: the next step saves
        return None
      return after_save(checkpoint_manager, step, force_ckpt_save)
    checkpointing.wait_until_finished(checkpoint_manager)
    if int(step) > rec.stopped_at:
      raise exceptions.StopTraining(f"stop requested; checkpoint {rec.stopped_at} saved")
    return None

  return handle_post_checkpoint_preemption


def _forced_save(rec: Recovery) -> Callable:
  save = original(checkpointing, "save_checkpoint")

  def save_checkpoint(checkpoint_manager, step, state, config=None, data_iterator=None, force=False):
    # Orbax's save policy declines a step off the checkpoint period unless its own preemption check (JAX's
    # service, multi-process only) agrees, and MaxText passes force=False there: force the stop's save.
    if rec.stopped_at is not None and int(step) > rec.stopped_at:
      return False  # the extra step after a stop request is never kept: a resume replays it
    force = force or (rec.stopped_at is not None and int(step) == rec.stopped_at)
    return save(checkpoint_manager, step, state, config, data_iterator, force)

  return save_checkpoint


def _optimizer(rec: Recovery) -> Callable:
  make = original(optimizers, "get_optimizer")

  def get_optimizer(*args, **kwargs):
    tx = make(*args, **kwargs)
    # The launcher counts the skipped steps and gives up after max_nonfinite_skips in a row; optax's own
    # limit (after which it applies the update anyway) must never be reached first.
    return optax.apply_if_finite(tx, max_consecutive_errors=2**30) if rec.skip_nonfinite else tx

  return get_optimizer


def patches(rec: Recovery) -> list[Patch]:
  return [
    Patch(checkpointing, "load_state_if_possible", _load_with_fallback(rec)),
    Patch(checkpointing, "reached_preemption", _preemption(rec)),
    Patch(checkpointing, "save_checkpoint", _forced_save(rec)),
    Patch(checkpointing, "_handle_post_checkpoint_preemption", _stop_one_step_later(rec)),
    Patch(optimizers, "get_optimizer", _optimizer(rec)),
  ]


def remove_incomplete_saves(checkpoint_dir: Path) -> list[str]:
  """Removes what an interrupted Orbax save leaves (`*.orbax-checkpoint-tmp*`); returns their names."""
  if jax.process_index() != 0 or not checkpoint_dir.is_dir():
    return []
  removed = []
  for path in sorted(checkpoint_dir.iterdir()):
    if ".orbax-checkpoint-tmp" in path.name:
      shutil.rmtree(path, ignore_errors=True)
      removed.append(path.name)
  return removed
