"""One writer per output: an advisory lock (`fcntl.flock`) on a file next to what is written.

Two `train`s with one run_name (or two `convert`s into one OUT) would write the same metrics and
checkpoints. The first to start holds the lock for its whole life; a second refuses in one line naming the
holder (host, pid, since when, its command), or waits for it with `wait_s`. The kernel drops the lock when
its holder dies, SIGKILL included, so a killed run never leaves it stuck; the file itself stays (it only
names the last holder) unless released with `remove=True`, which unlinks it while still holding it. A
taker therefore checks, once it holds the lock, that the file it locked is still the one at the path (the
holder may have unlinked it meanwhile), and starts over on the new file if not. flock is per host on most
network file systems: it keeps two runs apart on one node, and process 0 of a job is the only writer
across nodes.
"""

import datetime
import fcntl
import os
import socket
import sys
import time
from pathlib import Path
from typing import IO

from maxtext_moe.errors import UserError

_HELD: dict[str, IO[str]] = {}  # path -> the open lock file of this process (kept open while it runs)


def _holder(fh: IO[str]) -> str:
  fh.seek(0)
  return fh.read().strip() or "another process"


def acquire(path: Path, *, what: str, wait_s: float = 0.0) -> None:
  """Takes the lock at `path` for this process, or raises UserError (one line) naming its holder; with
  `wait_s` > 0, first waits that long for it. Taking a lock this process holds is a no-op."""
  path = Path(path).absolute()
  if str(path) in _HELD:
    return
  path.parent.mkdir(parents=True, exist_ok=True)
  deadline = time.monotonic() + wait_s
  while True:
    fh = open(path, "a+", encoding="utf-8")  # noqa: SIM115 - held open until release() or exit
    try:
      fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      if time.monotonic() >= deadline:
        holder = _holder(fh)
        fh.close()
        raise UserError(f"{what} is in use by {holder}; wait for it to end, or choose another name") from None
      fh.close()
      time.sleep(min(1.0, max(deadline - time.monotonic(), 0.01)))
      continue
    if _still_at(fh, path):
      break
    fh.close()  # the holder removed this file as we waited: lock the one at the path now
  since = datetime.datetime.now().isoformat(timespec="seconds")
  command = " ".join(os.path.basename(a) if i == 0 else a for i, a in enumerate(sys.argv))[:200]
  fh.seek(0)
  fh.truncate()
  fh.write(f"pid {os.getpid()} on {socket.gethostname()} since {since} ({command})\n")
  fh.flush()
  _HELD[str(path)] = fh


def _still_at(fh: IO[str], path: Path) -> bool:
  try:
    return os.path.samestat(os.fstat(fh.fileno()), os.stat(path))
  except FileNotFoundError:
    return False


def release(path: Path, *, remove: bool = False) -> None:
  """Drops the lock at `path`; with `remove`, first unlinks its file (while still holding it)."""
  path = Path(path).absolute()
  fh = _HELD.pop(str(path), None)
  if fh is not None:
    if remove:
      path.unlink(missing_ok=True)
    fcntl.flock(fh, fcntl.LOCK_UN)
    fh.close()
