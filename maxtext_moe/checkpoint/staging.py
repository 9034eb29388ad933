"""Output that is complete or absent: a staged directory renamed into place, and a bytes progress bar.

Both converters write through `staged_output`, so a failure (bad input found late, a full disk, Ctrl-C,
SIGTERM) leaves neither a partial OUT nor a staging directory (nor its lock file) behind, and an existing
OUT is only replaced once the new one is complete and on disk.
"""

import os
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from maxtext_moe import locks, signals
from maxtext_moe.errors import UserError


@contextmanager
def staged_output(out: Path, *, force: bool) -> Iterator[Path]:
  """Yields a temporary sibling of `out` to write into; on success flushes it to disk and renames it to
  `out`, on failure removes it. An existing `out` is an error unless `force`, and is only removed after
  success. So `out` is either absent or complete and on disk, even across a power loss."""
  out = Path(out).absolute()
  lock = out.parent / f".{out.name}.lock"
  with signals.under_cleanup():  # a SIGTERM raises through here, so the staging directory goes
    locks.acquire(lock, what=f"output directory {out}")
    yield from _staged(out, lock, force=force)


def _staged(out: Path, lock: Path, *, force: bool) -> Iterator[Path]:
  try:
    if out.exists() and not force:
      raise UserError(f"output directory {out} already exists; pass --force to replace it")
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
      yield tmp
      _fsync_tree(tmp)
    except BaseException:
      shutil.rmtree(tmp, ignore_errors=True)
      raise
    if out.exists():
      shutil.rmtree(out)
    tmp.rename(out)
    _fsync(out.parent)
  finally:
    locks.release(lock, remove=True)


def _fsync(path: Path) -> None:
  fd = os.open(path, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def _fsync_tree(root: Path) -> None:
  """fsync every file and directory under root: the writers do not sync each write themselves."""
  for dirpath, _, filenames in os.walk(root):
    for name in filenames:
      _fsync(Path(dirpath) / name)
    _fsync(Path(dirpath))


def usual_file_mode(directory: Path) -> int:
  """The permission bits a file created in `directory` gets the usual way: 0o666 masked by the process's
  umask (0o644 under umask 022), or by the directory's default ACL where it has one. Writers that create
  files otherwise (safetensors 0.8's `save_file` writes a 0o600 temporary file and renames it into place:
  safetensors/safetensors#782) are given this mode, so a serving or evaluation user reads an export as
  they read its config.json; a user's umask 077 is kept, not widened.

  Hand-written because Python has no way to read the umask without setting it (`os.umask`), which would
  change it for the whole process, under writer threads, for a moment: a probe file is created as any file
  is and its mode read back, which also honors default ACLs."""
  fd, probe = -1, directory / f".mode-probe-{os.getpid()}"
  try:
    fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o666)
    return os.fstat(fd).st_mode & 0o777
  finally:
    if fd >= 0:
      os.close(fd)
      probe.unlink()


class ByteProgress:
  """A rich progress bar in bytes with throughput (or nothing when not on a terminal)."""

  def __init__(self, description: str, total: int, enabled: bool):
    from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

    self.bar = (
      Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        DownloadColumn(),
        TransferSpeedColumn(),
        TimeRemainingColumn(),
        transient=True,
      )
      if enabled
      else None
    )
    self.task = self.bar.add_task(description, total=total) if self.bar else None
    self.done = 0

  def __enter__(self):
    if self.bar:
      self.bar.start()
    return self

  def __exit__(self, *exc):
    if self.bar:
      self.bar.stop()

  def advance(self, nbytes: int) -> None:
    self.done += nbytes
    if self.bar:
      self.bar.advance(self.task, nbytes)


def interactive() -> bool:
  """Whether progress bars are worth drawing (stderr is a terminal)."""
  return sys.stderr.isatty()
