"""Standard output carries only a command's output: its table, JSON, shell exports or manifest.

While a command runs, file descriptor 1 and `sys.stdout` point at standard error, so whatever a library
prints (MaxText prints `[DECOUPLED NO-OP] ...` notices on import, in Python and possibly from C) lands
there; the command writes its output to the stream `routed_stdout` yields, a duplicate of the real
standard output. Without --verbose, MaxText's decoupled-mode notices are dropped altogether.

A reader that stops early (`| head -3`) breaks the pipe: `routed_stdout` then sends the rest of the output
to /dev/null and raises `ReaderGone`, which the CLI ends on quietly, as a Unix tool ends (exit 141).
"""

import contextlib
import io
import os
import select
import sys
from collections.abc import Iterator
from typing import IO

_NOISE = ("[DECOUPLED NO-OP]", "[NO-OP]")


class _Notices(io.TextIOBase):
  """A line-buffered text stream onto standard error that drops known noise lines."""

  def __init__(self, target: IO[str], drop: tuple[str, ...]):
    super().__init__()
    self._target, self._drop, self._pending = target, drop, ""

  def writable(self) -> bool:
    return True

  def write(self, text: str) -> int:
    lines = (self._pending + text).split("\n")
    self._pending = lines.pop()
    for line in lines:
      if not line.startswith(self._drop):
        self._target.write(line + "\n")
    return len(text)

  def flush(self) -> None:
    if self._target.closed:  # a library kept this stream past the command (a log handler) and flushes at exit
      return
    if self._pending and not self._pending.startswith(self._drop):
      self._target.write(self._pending)
    self._pending = ""
    self._target.flush()


class ReaderGone(Exception):
  """The reader of standard output closed it before the command had written everything (`| head`)."""


def _reader_gone(fd: int) -> bool:
  """Whether `fd` is a pipe or socket whose reading end is closed (poll reports an error on it), so that a
  BrokenPipeError was the output's own, not some other pipe's."""
  poll = select.poll()
  poll.register(fd, select.POLLOUT)
  return any(events & (select.POLLERR | select.POLLHUP) for _, events in poll.poll(0))


def to_devnull(fd: int) -> None:
  """What is still written to `fd` (a buffer flushed on the way out) goes to /dev/null."""
  null = os.open(os.devnull, os.O_WRONLY)
  os.dup2(null, fd)
  os.close(null)


@contextlib.contextmanager
def routed_stdout(*, verbose: bool) -> Iterator[IO[str]]:
  """Yields the command's output stream; everything else written to stdout goes to stderr meanwhile. Raises
  ReaderGone where the output's reader stopped reading (the output's file descriptors then lead to
  /dev/null)."""
  sys.stdout.flush()
  real_fd = os.dup(1)
  os.dup2(2, 1)
  out = os.fdopen(real_fd, "w", buffering=1, encoding="utf-8")
  saved = sys.stdout
  sys.stdout = sys.stderr if verbose else _Notices(sys.stderr, _NOISE)
  try:
    yield out
    out.flush()
  except BrokenPipeError as e:
    if not _reader_gone(real_fd):
      raise
    to_devnull(real_fd)
    raise ReaderGone from e
  finally:
    sys.stdout.flush()
    sys.stdout = saved
    out.flush()
    os.dup2(real_fd, 1)
    out.close()
