"""Paths a run reads and writes, asked about before anything is written: can a directory be created and
written, which files a data pattern names."""

import glob
import os
import tempfile
from pathlib import Path


def unwritable_reason(path: str | Path) -> str | None:
  """Why `path` cannot be (created and) written as a directory, or None. Remote URLs (gs://...) pass."""
  if "://" in str(path):
    return None
  p = Path(path).expanduser().absolute()
  if p.exists() and not p.is_dir():
    return f"{p} is a file, not a directory"
  probe = p
  while not probe.exists():
    probe = probe.parent
  if not probe.is_dir():
    return f"{probe} is a file, so {p} cannot be created"
  try:  # try it: permission bits do not tell for root, read-only mounts or /proc
    fd, name = tempfile.mkstemp(dir=probe, prefix=".maxtext-moe-probe-")
    os.close(fd)
    os.unlink(name)
  except OSError as e:
    return f"{probe} is not writable ({e.strerror})" + ("" if probe == p else f", so {p} cannot be created")
  return None


def data_files(pattern: str) -> list[str]:
  """The files a grain_train_files value names: ';'-separated patterns, each maybe ',weight'."""
  found = []
  for part in str(pattern).split(";"):
    path = part.split(",")[0].strip()
    if path and "://" not in path:
      found += glob.glob(path)
    elif path:
      found.append(path)  # remote: left to the reader
  return found
