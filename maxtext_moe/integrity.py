"""What a checkpoint's restore must find: each file's size and CRC-32, recorded once its save is complete.

Orbax 0.12.8 protects only the shard indexes of its zarr3 arrays (a crc32c codec); a truncated or altered
OCDBT data file other than the one read first went undetected until the restore failed deep inside
TensorStore, or did not fail at all. So when a step's save is complete (its directory has its final name),
process 0 writes `STEP/maxtext_moe_files.json`: every file's size and, with `checkpoint_integrity:
checksums`, its CRC-32 (zlib's, one pass). Before a restore the launcher checks the candidate against it
(`problem`), and a mismatch is an unreadable checkpoint: the run falls back to the previous one as it does
for a failed read. A checkpoint without the file (saved before this existed) is restored as it is.

The file lives in Orbax's step directory, so it must never be written into a step Orbax is deleting
(`max_num_checkpoints_to_keep`): Orbax's save finalizer removes old steps in a background thread, file by
file and the directory last, and a manifest written into a half-deleted step made that last rmdir fail
("[Errno 39] Directory not empty"), which killed the run at its next save and left a stub directory. A
step Orbax will delete leaves its manager's list (`CheckpointManager._checkpoints`) in `save`, on the
training thread, before the finalizer starts, and our records are written on that same thread: recording
only the steps the manager still keeps (`record_completed(steps=...)`) never races a deletion. Kept there
rather than beside the step so that it goes wherever the step goes (deleted, moved aside, copied).

Hand-written because Orbax records no per-file sizes or checksums to check against.
"""

import json
import os
import zlib
from collections.abc import Iterable
from pathlib import Path

MANIFEST = "maxtext_moe_files.json"
_CHUNK = 8 * 2**20


def _crc32(path: Path) -> int:
  crc = 0
  with open(path, "rb") as f:
    while chunk := f.read(_CHUNK):
      crc = zlib.crc32(chunk, crc)
  return crc


def _files(step_dir: Path) -> list[Path]:
  return sorted(p for p in step_dir.rglob("*") if p.is_file() and p.name != MANIFEST)


def record(step_dir: Path, *, checksums: bool) -> None:
  """Writes the manifest of a complete checkpoint (atomically: a crash leaves none or a whole one)."""
  files = {str(p.relative_to(step_dir)): [p.stat().st_size, _crc32(p) if checksums else None] for p in _files(step_dir)}
  tmp = step_dir / f".{MANIFEST}.tmp"
  tmp.write_text(json.dumps({"version": 1, "files": files}))
  os.replace(tmp, step_dir / MANIFEST)


def record_completed(checkpoint_dir: Path, *, checksums: bool, steps: Iterable[int] | None = None) -> list[int]:
  """Records every complete step directory that has no manifest yet; returns their steps. `steps`: the ones
  the checkpoint manager keeps, the only ones recorded (None: every step directory, for when no deletion
  can be under way: the manager closed, or never opened)."""
  if not checkpoint_dir.is_dir():
    return []
  kept = None if steps is None else {str(s) for s in steps}
  done = []
  for step_dir in sorted(checkpoint_dir.iterdir()):
    if kept is not None and step_dir.name not in kept:
      continue
    if step_dir.is_dir() and step_dir.name.isdigit() and not (step_dir / MANIFEST).exists():
      record(step_dir, checksums=checksums)
      done.append(int(step_dir.name))
  return done


def problem(step_dir: Path) -> str | None:
  """What is wrong with a checkpoint against its manifest (the first thing found), or None: it matches, or
  it has no manifest."""
  manifest = step_dir / MANIFEST
  if not manifest.is_file():
    return None
  try:
    files = json.loads(manifest.read_text())["files"]
  except (OSError, ValueError, KeyError):
    return f"its {MANIFEST} cannot be read"
  for rel, (size, crc) in files.items():
    path = step_dir / rel
    if not path.is_file():
      return f"{rel} is missing"
    if path.stat().st_size != size:
      return f"{rel} is {path.stat().st_size:,} bytes, its save wrote {size:,}"
    if crc is not None and _crc32(path) != crc:
      return f"{rel} does not match the CRC-32 its save recorded"
  return None
