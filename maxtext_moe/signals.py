"""A stop asked for before the run's own handler is in place: SIGTERM from the first instruction on.

SLURM and Kubernetes send SIGTERM before they evict a job, at any moment: also while `train` is still
importing MaxText or compiling. Python's default would end the process with 143, which `train.sbatch`
does not requeue. `install_early` (the first thing the CLI does) makes such a SIGTERM end the process at
once with one line and EXIT_RESUMABLE (75), which the launchers requeue on: before training starts there is
nothing to save, and the run lock goes with the process.

At once, from inside the handler, not by raising: an exception raised where the signal lands is not
reliably ours to catch. Inside a C extension's import it comes out as an ImportError (jaxlib's does this)
and the import machinery prints its traceback; in a finalizer Python prints it and drops it. Code that
must undo what it started (a staged output) runs `under_cleanup()`: there the signal raises
`StopBeforeStart`, a BaseException no `except Exception` swallows, and the CLI reports it the same way.

Once the run's own handler is installed (`launch.interrupts.graceful_stop`: finish the step, save, stop)
it takes over; in a multi-process job JAX's preemption service takes SIGTERM once the job is joined.

It also makes a file-size limit (`ulimit -f`) an error (EFBIG) instead of a kill by SIGXFSZ, so a write that
hits it is reported like a full disk.
"""

import contextlib
import os
import signal
from collections.abc import Iterator

from maxtext_moe.errors import EXIT_RESUMABLE


class StopBeforeStart(BaseException):
  """SIGTERM arrived before training started (nothing to save yet), inside `under_cleanup()`."""

  def __init__(self, name: str):
    super().__init__(name)
    self.name = name


_CLEANUP_DEPTH = [0]  # > 0 while code that must undo its work runs (under_cleanup)
_RECEIVED: list[str] = []  # the signals the early handler took, first first


def stopped_line(name: str) -> str:
  return (
    f"maxtext-moe: stopped by {name} before anything was trained; nothing was lost (no step ran, no "
    "checkpoint was due); the same command starts again"
  )


def _early(signum, frame) -> None:
  del frame
  name = signal.Signals(signum).name
  _RECEIVED.append(name)
  if _CLEANUP_DEPTH[0] > 0:
    raise StopBeforeStart(name)
  os.write(2, (stopped_line(name) + "\n").encode())
  os._exit(EXIT_RESUMABLE)  # pylint: disable=protected-access  # see the module's docstring


def install_early() -> None:
  """SIGTERM ends the process at once with one line and 75 (raises StopBeforeStart under_cleanup);
  SIGXFSZ is ignored (writes past `ulimit -f` fail with EFBIG)."""
  signal.signal(signal.SIGTERM, _early)
  signal.signal(signal.SIGXFSZ, signal.SIG_IGN)


@contextlib.contextmanager
def under_cleanup() -> Iterator[None]:
  """While this runs, an early SIGTERM raises StopBeforeStart through the caller's `finally`s."""
  _CLEANUP_DEPTH[0] += 1
  try:
    yield
  finally:
    _CLEANUP_DEPTH[0] -= 1


def received() -> str | None:
  """The signal the early handler took, if any (its exception may have been converted on its way)."""
  return _RECEIVED[0] if _RECEIVED else None
