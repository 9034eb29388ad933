"""Errors the CLI turns into one line on stderr and an exit code (no traceback)."""

# A run stopped by SIGTERM/SIGINT after saving a checkpoint: the same command resumes it. The launchers
# requeue on it (scripts/slurm/train.sbatch; a JobSet restarts). EX_TEMPFAIL in sysexits.h.
EXIT_RESUMABLE = 75


class UserError(ValueError):
  """Bad input from the user: a wrong key, recipe, value, layout or file. The message is one line; exit 2."""


class RunEnded(Exception):
  """A run that ended early with a one-line account of why and what next (not a bug, not bad input)."""

  def __init__(self, message: str, exit_code: int):
    super().__init__(message)
    self.exit_code = exit_code
