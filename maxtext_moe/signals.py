"""A stop asked for before the run's own handler is in place: SIGTERM from the first instruction on.

SLURM and Kubernetes send SIGTERM before they evict a job, at any moment: also while `train` is still
importing MaxText or compiling. Python's default would end the process with 143, which `train.sbatch`
does not requeue. `install_early` (the first thing the CLI does) turns such a SIGTERM into `StopBeforeStart`,
a BaseException, so no `except Exception` swallows it; the CLI says what was (not) kept and exits with
EXIT_RESUMABLE (75), which the launchers requeue on. Once the run's own handler is installed
(`launch.interrupts.graceful_stop`: finish the step, save, stop) it takes over; in a multi-process job
JAX's preemption service takes SIGTERM once the job is joined.

It also makes a file-size limit (`ulimit -f`) an error (EFBIG) instead of a kill by SIGXFSZ, so a write that
hits it is reported like a full disk.
"""

import signal


class StopBeforeStart(BaseException):
  """SIGTERM arrived before training started (nothing to save yet)."""

  def __init__(self, name: str):
    super().__init__(name)
    self.name = name


def _early(signum, frame) -> None:
  del frame
  raise StopBeforeStart(signal.Signals(signum).name)


def install_early() -> None:
  """SIGTERM raises StopBeforeStart; SIGXFSZ is ignored (writes past `ulimit -f` fail with EFBIG)."""
  signal.signal(signal.SIGTERM, _early)
  signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
