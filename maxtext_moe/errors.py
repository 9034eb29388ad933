"""Errors the CLI turns into one line on stderr and an exit code (no traceback)."""

# Standard output's reader stopped early (`| head`): the command ends quietly, with the status a shell reports
# for a tool that SIGPIPE ended (128 + 13).
EXIT_READER_GONE = 141

# A run stopped by SIGTERM/SIGINT after saving a checkpoint: the same command resumes it. The launchers
# requeue on it (scripts/slurm/train.sbatch; a JobSet restarts). EX_TEMPFAIL in sysexits.h.
EXIT_RESUMABLE = 75

# A row of the training data cannot be used (null, not text, an empty conversation, a chat template that fails
# on it): the run saved its last completed step and stopped with one line naming the file and row. Not
# requeued (the same row would stop it again): fix or remove the row, then run the same command.
# EX_DATAERR in sysexits.h.
EXIT_DATAERR = 65


class UserError(ValueError):
  """Bad input from the user: a wrong key, recipe, value, layout or file. The message is one line; exit 2."""


class RunEnded(Exception):
  """A run that ended early with a one-line account of why and what next (not a bug, not bad input)."""

  def __init__(self, message: str, exit_code: int):
    super().__init__(message)
    self.exit_code = exit_code


# XLA itself failed on the program (an internal compiler error, not the config): EX_SOFTWARE in sysexits.h.
EXIT_COMPILER = 70


# A write failed because the disk (or the file-size limit, or a quota) is full: nothing written is left
# looking complete; free space and rerun. EX_IOERR in sysexits.h.
EXIT_NO_SPACE = 74
_NO_SPACE = {28: "no space left on device", 27: "file too large", 122: "disk quota exceeded"}


def no_space(err: BaseException) -> str | None:
  """Why `err` (or an exception it was raised from) is a full disk, in words, else None: an OSError with
  ENOSPC, EFBIG or EDQUOT, or TensorStore's error text for one ("[os_error_code='28']")."""
  seen: set[int] = set()
  while err is not None and id(err) not in seen:
    seen.add(id(err))
    if isinstance(err, OSError) and err.errno in _NO_SPACE:
      return _NO_SPACE[err.errno]
    text = str(err)
    for code, words in _NO_SPACE.items():
      if f"os_error_code='{code}'" in text or words.lower() in text.lower():
        return words
    err = err.__cause__ or err.__context__
  return None
