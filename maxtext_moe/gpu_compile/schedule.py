"""What runs beside what in a compiled program, read from its optimized HLO text (each computation lists its
instructions in schedule order): the async pairs and streams a flag profile changes, and how much of the
expert exchange runs beside a GEMM. `hlo.report` carries both.

Shape legend: none (text in, counts out).
"""

import re
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from maxtext_moe.gpu_compile.gemms import gemm_kind

_QUEUE = re.compile(r'"operation_queue_id":"(\d+)"')


def streams(comps: dict[str, list[Any]]) -> dict[str, Any]:
  """What a flag profile changes in the program, statically: async operation pairs by kind (`*-start`),
  the operation queues (streams) instructions are assigned to, and the command buffers (CUDA graphs)."""
  starts: dict[str, int] = defaultdict(int)
  queues: set[str] = set()
  buffers = sum("command_buffer" in name for name in comps)
  for instrs in comps.values():
    for ins in instrs:
      if ins.opcode.endswith("-start"):
        starts[ins.opcode.removesuffix("-start")] += 1
      queues.update(_QUEUE.findall(ins.rest))
  return {"async_starts": dict(starts), "operation_queues": len(queues), "command_buffers": buffers}


def async_spans(instrs: list[Any], kind: str, counted: Callable[[Any], Any]) -> list[tuple[Any, int]]:
  """Each async `kind` pair of one computation (its instructions in schedule order, as the optimized HLO
  lists them): (its `kind`-start, how many instructions `counted` accepts between its start and done)."""
  started: dict[str, tuple[Any, int]] = {}  # a start's name -> (the start, instructions counted before it)
  seen = 0
  spans = []
  for ins in instrs:
    if ins.opcode == f"{kind}-start":
      started[ins.name] = (ins, seen)
    elif ins.opcode == f"{kind}-done":
      name = re.match(r"\s*%?([\w.\-]+)", ins.rest.split(",")[0].split(")")[0].lstrip("("))
      start = started.pop(name.group(1), None) if name else None
      if start is not None:
        spans.append((start[0], seen - start[1]))
    elif counted(ins):
      seen += 1
  return spans


def exchange_overlap(comps: dict[str, list[Any]], graph: Any, *, size: Callable[[Any], int]) -> dict[str, float]:
  """How much of the expert exchange (all-to-alls outside branches) runs beside a GEMM, per step: an async
  all-to-all whose start and done have a GEMM scheduled between them in its computation (the optimized
  HLO lists each computation in schedule order). `graph`: `hlo.executions`'; `size`: an instruction's
  bytes (`hlo.report`'s: the result's size)."""
  total = beside = 0.0
  for comp, instrs in comps.items():
    n = graph.runs.get(comp, 0.0)
    if not n or graph.in_branch.get(comp):
      continue
    total += n * sum(size(ins) for ins in instrs if ins.opcode in ("all-to-all", "all-to-all-start"))
    beside += n * sum(size(start) for start, gemms in async_spans(instrs, "all-to-all", gemm_kind) if gemms)
  return {"exchange_bytes": total, "exchange_beside_gemm_bytes": beside}
