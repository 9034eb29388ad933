"""How a run that ended early is reported: one line saying what happened, what was kept, and the exact
command that continues it. Raised as RunEnded; the CLI prints it and exits with its code."""

import datetime
import logging
import os
import re
import shlex
import shutil
from pathlib import Path
from typing import Any

from maxtext_moe import stderr
from maxtext_moe.errors import EXIT_NO_SPACE, EXIT_RESUMABLE, RunEnded, no_space

NONFINITE = "nonfinite_checkpoints"


def resume_command(recipe: str | None, user_overrides: tuple[str, ...], run_name: str) -> str:
  """The command that continues this run: the same recipe and overrides, its run_name pinned."""
  kept = [o for o in user_overrides if not o.startswith("run_name=")]
  return shlex.join(["maxtext-moe", "train", *([recipe] if recipe else []), *kept, f"run_name={run_name}"])


def checkpoint_steps(checkpoint_dir: Path) -> list[int]:
  """Steps of the complete checkpoints (Orbax writes a step's directory under a temporary name first)."""
  if not checkpoint_dir.is_dir():
    return []
  return sorted(int(p.name) for p in checkpoint_dir.iterdir() if p.is_dir() and p.name.isdigit())


def stopped(signal_name: str, step: int, checkpoint_dir: Path, command: str) -> RunEnded:
  return RunEnded(
    f"stopped by {signal_name} after step {step + 1}; checkpoint {step} saved in {checkpoint_dir}; "
    f"resume with: {command}",
    EXIT_RESUMABLE,
  )


def _move_after(checkpoint_dir: Path, bad_step: int) -> list[int]:
  """Moves checkpoints saved at or after the non-finite step (their weights may be NaN) out of the way
  of a resume, under RUN/nonfinite_checkpoints/."""
  later = [s for s in checkpoint_steps(checkpoint_dir) if s >= bad_step]
  if later:
    target = checkpoint_dir.parent / NONFINITE
    target.mkdir(exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    for s in later:
      shutil.move(str(checkpoint_dir / str(s)), target / f"{s}-{stamp}")
  return later


def nonfinite(err: Any, checkpoint_dir: Path, command: str, *, lead: bool) -> RunEnded:
  """The run stops on a NaN/Inf loss (`recorder.NonFiniteLoss`): which step, the last good checkpoint,
  what to try."""
  moved = _move_after(checkpoint_dir, err.step) if lead else []
  good = [s for s in checkpoint_steps(checkpoint_dir) if s < err.step]
  skipped = f" after skipping {err.skipped} non-finite step(s)" if err.skipped else ""
  kept = (
    f"the last good checkpoint is {good[-1]} ({checkpoint_dir / str(good[-1])})" if good else "no checkpoint before it"
  )
  aside = f", later ones moved to {checkpoint_dir.parent / NONFINITE}" if moved else ""
  return RunEnded(
    f"the loss became {err.kind} at step {err.step + 1}{skipped}; {kept}{aside}; try a lower learning_rate, "
    f"more warm-up (warmup_steps_fraction), gradient_clipping_threshold, or on_nonfinite_loss=skip, then: {command}",
    1,
  )


def _size(path: Path) -> int:
  return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else 0


_SAVING = re.compile(r"checkpoints/(\d+)\.orbax-checkpoint-tmp")


def unexpected(err: Exception, recorder: Any, checkpoint_dir: Path, command: str) -> BaseException:
  """A full disk (ENOSPC, EFBIG, EDQUOT, whoever raised it) as one line: what failed, what was removed, the
  last complete checkpoint, roughly how much space a save needs, how to continue; anything else as it was."""
  why = no_space(err)
  if why is None:
    return err
  from maxtext_moe.upstream.maxtext.recovery import remove_incomplete_saves  # pylint: disable=import-outside-toplevel

  removed = remove_incomplete_saves(checkpoint_dir)
  saving = _SAVING.search(str(err))
  what = f"checkpoint {saving.group(1)}'s save" if saving else "a write to the run directory"
  done = checkpoint_steps(checkpoint_dir)
  try:
    recorder.finish(stopped=True)
  except Exception:  # pylint: disable=broad-except  # the summary and plots may not fit either
    pass
  kept = (
    f"checkpoint {done[-1]} is intact (a save needs about {_size(checkpoint_dir / str(done[-1])) / 1e6:,.0f} MB)"
    if done
    else "no checkpoint was complete yet"
  )
  gone = f"; the unfinished save ({', '.join(removed)}) was removed" if removed else ""
  left = sorted(p.name for p in checkpoint_dir.glob("*.orbax-checkpoint-tmp*")) if checkpoint_dir.is_dir() else []
  gone += f"; {', '.join(left)} was still being written: the next run removes it" if left else ""
  return RunEnded(f"{what} failed: {why}{gone}; {kept}; free space, then resume with: {command}", EXIT_NO_SPACE)


class _FullDiskNoise(logging.Filter):
  """Drops the log records of a full disk (Orbax's threads log each failed write with a traceback): the
  run ends with one line saying so (`unexpected`)."""

  def filter(self, record: logging.LogRecord) -> bool:
    err = record.exc_info[1] if record.exc_info else None
    if no_space(err) is None and no_space(RuntimeError(record.getMessage())) is None:
      return True
    # The first sign of a full disk, in Orbax's writer thread: what its threads print from here on (uvloop's
    # "Event loop is closed" tracebacks, straight to fd 2) is noise; the run's own last line still shows.
    stderr.divert_rest(Path(os.devnull))
    return False


def quiet_about_full_disks() -> None:
  """Filters a full disk's records from absl's logger (Orbax logs through it) and the root's handlers."""
  for target in (logging.getLogger("absl"), *logging.getLogger().handlers):
    if not any(isinstance(f, _FullDiskNoise) for f in target.filters):
      target.addFilter(_FullDiskNoise())
