"""Standard error at the file-descriptor level, where TensorStore's and uvloop's threads write.

An Orbax restore that fails leaves reader threads printing tracebacks ("RuntimeError: Event loop is
closed") until the process ends. `diverted(log)` sends fd 2 to a log file during such a read (shown
afterwards when the read works); `divert_rest(log)` keeps it there once the run is given up on; and
`last_word(line)` writes the one-line error to the real standard error and sends what follows to the
log (or /dev/null), so the line is the last thing a user sees; `hide_closed_loop_reports` drops one
report that races all of these. Hand-written: it is a few dup2 calls and a hook.
"""

import contextlib
import os
import sys
from collections.abc import Iterator
from pathlib import Path

_real_fd: int | None = None  # the real standard error while fd 2 is diverted after a failure


@contextlib.contextmanager
def diverted(log: Path) -> Iterator[None]:
  """fd 2 into `log` for the block; afterwards back, and what the block printed shown if it succeeded
  (kept in the log if it failed)."""
  sys.stderr.flush()
  saved = os.dup(2)
  ok = False
  with open(log, "a+b") as f:
    start = f.tell()
    os.dup2(f.fileno(), 2)
    try:
      yield
      ok = True
    finally:
      sys.stderr.flush()
      os.dup2(saved, 2)
      os.close(saved)
      if ok:
        f.seek(start)
        sys.stderr.write(f.read().decode(errors="replace"))
        f.truncate(start)
  if ok and log.exists() and log.stat().st_size == 0:
    log.unlink(missing_ok=True)


def _closed_loop(kind: type, value: BaseException | None) -> bool:
  return kind is RuntimeError and str(value) == "Event loop is closed"


def hide_closed_loop_reports() -> None:
  """TensorStore's threads hand results to Orbax's asyncio loop; when Orbax has given up on a failed read
  or write and closed the loop, each late result is reported as an unraisable exception
  (PyErr_WriteUnraisable, which calls sys.unraisablehook; its PyErr_Print calls sys.excepthook):
  "RuntimeError: Event loop is closed", a traceback each. Seen with a full disk under load: up to eight,
  before the failure's first log record could divert fd 2. They say nothing a user can act on (the failure
  itself ends the run in one line), so they are dropped; every other report is shown."""
  except_hook, unraisable_hook = sys.excepthook, sys.unraisablehook

  def on_exception(kind, value, tb):
    if not _closed_loop(kind, value):
      except_hook(kind, value, tb)

  def on_unraisable(args):
    if not _closed_loop(args.exc_type, args.exc_value):
      unraisable_hook(args)

  sys.excepthook, sys.unraisablehook = on_exception, on_unraisable


def divert_rest(log: Path) -> None:
  """From now on fd 2 goes to `log` (a failed read's threads keep printing until the process ends);
  `last_word` still reaches the real standard error."""
  global _real_fd  # pylint: disable=global-statement
  sys.stderr.flush()
  if _real_fd is None:
    _real_fd = os.dup(2)
  fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
  os.dup2(fd, 2)
  os.close(fd)


def say(line: str) -> None:
  """One line to the real standard error, also while fd 2 is diverted."""
  sys.stderr.flush()
  os.write(_real_fd if _real_fd is not None else 2, (line + "\n").encode())


def last_word(line: str, *, verbose: bool) -> None:
  """Writes `line` to the real standard error as its last line (unless --verbose, what the process
  prints after it goes to /dev/null, or stays in the log fd 2 was diverted to)."""
  sys.stderr.flush()
  real = _real_fd if _real_fd is not None else 2
  if not verbose and _real_fd is None:
    real = os.dup(2)
    os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
  os.write(real, (line + "\n").encode())
