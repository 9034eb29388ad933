"""What one device holds at the compiled step's memory peak, from XLA's own dump of its buffer assignment.

XLA writes, with `--xla_dump_to=DIR --xla_dump_hlo_as_text`, the buffer assignment (every value of the
preallocated temporary buffer with its offset and size) and the live ranges (the schedule positions
between which each value is live). The peak is the schedule position where the live values cover the
most bytes of the temporary buffer (values sharing bytes counted once). Its live set is what the memory
planner's constants stand for (docs/planner.md); `compile --hlo DIR` writes it as `peak.json`.

Hand-written because XLA exposes these only as dump files (no Python API reads them).
"""

import collections
import re
from pathlib import Path
from typing import Any

from maxtext_moe.errors import UserError

_ALLOCATION = re.compile(r"allocation (\d+): size (\d+),(.*)")
_VALUE = re.compile(r"value: <\d+ ([^ ]+) @\d+> \(size=(\d+),offset=(\d+)\): (\S+)")
_RANGE = re.compile(r"\s+(\S+\{[^}]*\}):(\d+)-(\d+)")
_COLOR = re.compile(r"\bcolor [1-9]")  # a memory space other than the device's (0, not written)


def _temp_values(buffer_assignment: str) -> list[tuple[str, int, int, str]]:
  """(value name with its tuple index, size, offset, shape) of the device's preallocated temporary buffer.
  Host memory (memory space 5: offloaded activations) has a temporary buffer of its own, marked with its
  color; its offsets are not the device buffer's."""
  out, in_temp = [], False
  for line in buffer_assignment.splitlines():
    if m := _ALLOCATION.match(line):
      in_temp = "preallocated-temp" in m.group(3) and not _COLOR.search(m.group(3))
      continue
    if in_temp and (m := _VALUE.search(line)):
      name = m.group(1) if "{" in m.group(1) else f"{m.group(1)}{{}}"
      out.append((name, int(m.group(2)), int(m.group(3)), m.group(4)))
  return out


def _ranges(live_range: str) -> dict[str, tuple[int, int]]:
  text = live_range.split("BufferLiveRange:", 1)[-1]
  return {m.group(1): (int(m.group(2)), int(m.group(3))) for m in _RANGE.finditer(text)}


def _covered(spans: list[tuple[int, int]]) -> int:
  total, end = 0, -1
  for a, b in sorted(spans):
    if b > end:
      total, end = total + b - max(a, end), b
  return total


def _dumped(dump_dir: Path, kind: str) -> Path:
  """XLA's dump of the optimized train step's `kind`, or one line: XLA only logs a dump it cannot write."""
  found = sorted(dump_dir.glob(f"*jit_train_step*after_optimizations-{kind}.txt"))
  if not found:
    raise UserError(
      f"XLA wrote no {kind} of the train step into {dump_dir} (it only logs a dump it cannot write): "
      "give --hlo a writable directory with free space and run it again"
    )
  return found[0]


def peak_live_set(dump_dir: Path, *, top: int = 25) -> dict[str, Any]:
  """{"peak_bytes", "position", "values": [(name, shape, bytes)] largest first} of the train step's dump."""
  ba, lr = (_dumped(dump_dir, kind) for kind in ("buffer-assignment", "live-range"))
  ranges = _ranges(lr.read_text())
  values = [(v, ranges[v[0]]) for v in _temp_values(ba.read_text()) if v[0] in ranges]
  events: dict[int, list[tuple[bool, int]]] = collections.defaultdict(list)
  for i, (_, (start, end)) in enumerate(values):
    events[start].append((True, i))
    events[end + 1].append((False, i))
  live: set[int] = set()
  best: tuple[int, int, frozenset] = (0, -1, frozenset())
  for position in sorted(events):
    for starts, i in events[position]:
      (live.add if starts else live.discard)(i)
    covered = _covered([(values[i][0][2], values[i][0][2] + values[i][0][1]) for i in live])
    if covered > best[0]:
      best = (covered, position, frozenset(live))
  peak, position, members = best
  largest = sorted(members, key=lambda i: -values[i][0][1])[:top]
  rows = [(values[i][0][0], values[i][0][3], values[i][0][1]) for i in largest]
  return {"peak_bytes": peak, "position": position, "values": rows}
