"""What a compiled XLA program does per step, read from its optimized HLO text (`compiled.as_text()`).

Hand-written because no library reads XLA's HLO text from Python (jax exposes the text, not the module).
It parses computations and instructions, walks the call graph from ENTRY with each computation's
executions per step (a while body runs its `known_trip_count` times, one without it at most once per
execution of the loop; a conditional's branches at most once per execution of the conditional; fusion
bodies are one kernel, not walked), and reports:

- collectives by kind: executions per step, bytes per step (the result's size, an async pair's too),
  group size, the named mesh axes its groups span, async or not, and whether inside a conditional's branch
  or an unknown-trip loop's body (then counted as if it ran once each time; the bounded rounds' further
  rounds, which natural routing does not need);
- host transfers: copies into or out of host memory (memory space S(5)), executions and bytes;
- conditionals and loops: a `conditional` outside a command buffer and a `while` without a known trip count
  are host syncs on XLA:GPU (the predicate is copied to the host and the host waits for the stream), each
  time they run;
- GEMMs by kind: cuBLAS custom calls, Triton GEMM fusions, TE's dense and grouped GEMMs, Mosaic/Pallas
  kernels, plain dot fusions; and by kind and number format (FP8, MXFP8, bf16, ...) from their operands.

Shape legend: none (text in, counts out).
"""

import dataclasses
import math
import re
from collections import defaultdict
from typing import Any

from maxtext_moe.gpu_compile import schedule
from maxtext_moe.gpu_compile.gemms import gemm_format, gemm_kind

_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4, "u32": 4, "f32": 4}
_BYTES |= {"s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16, "s4": 1, "u4": 1, "token": 0}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\](\{[^}]*\})?")
_COMP = re.compile(r"^(ENTRY )?%?([\w.\-]+) [^{]*\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT )?%?([\w.\-]+) = (.+?) ([\w\-]+)\((.*)$")
_CALLS = re.compile(r"(to_apply|calls|body|condition|true_computation|false_computation)=%?([\w.\-]+)")
_BRANCHES = re.compile(r"branch_computations=\{([^}]*)\}")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_GROUPS_IOTA = re.compile(r"replica_groups=\[(\d+),(\d+)\]<=")
_GROUPS_LIST = re.compile(r"replica_groups=\{\{([0-9,]*)\}")
_GROUPS_MESH = re.compile(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}")
COLLECTIVES = (
  "all-gather",
  "all-reduce",
  "reduce-scatter",
  "all-to-all",
  "ragged-all-to-all",
  "collective-permute",
  "collective-broadcast",
)
HOST_MEMORY_SPACE = "S(5)"


@dataclasses.dataclass(frozen=True)
class Instr:
  name: str
  opcode: str
  shape: str
  rest: str  # operands and attributes


def array_bytes(shape: str) -> int:
  """Bytes of every array in an HLO shape (a tuple's elements added), e.g. 'bf16[4,8]{1,0}' -> 64."""
  total = 0
  for dtype, dims, _ in _ARRAY.findall(shape):
    n = 1
    for d in (int(x) for x in dims.split(",") if x):
      n *= d
    total += n * _BYTES.get(dtype, 1 if dtype.startswith("f8") else 4)
  return total


def parse(text: str) -> tuple[dict[str, list[Instr]], str]:
  """({computation: its instructions}, the ENTRY computation's name)."""
  comps: dict[str, list[Instr]] = {}
  entry, current = "", None
  for line in text.splitlines():
    if current is None:
      m = _COMP.match(line)
      if m:
        current = m.group(2)
        comps[current] = []
        entry = current if m.group(1) else entry
      continue
    if line.startswith("}"):
      current = None
      continue
    m = _INSTR.match(line)
    if m:
      comps[current].append(Instr(m.group(2), m.group(4), m.group(3), m.group(5)))
  return comps, entry


def _callees(ins: Instr) -> list[tuple[str, str]]:
  """(kind, computation) this instruction calls."""
  out = [(k, c) for k, c in _CALLS.findall(ins.rest)]
  for group in _BRANCHES.findall(ins.rest):
    out += [("branch", c.strip().lstrip("%")) for c in group.split(",") if c.strip()]
  return out


@dataclasses.dataclass
class CallGraph:
  """Per computation: executions per step, whether it runs inside a command buffer, and whether only
  through a conditional's branch (so only when that branch is taken)."""

  runs: dict[str, float]
  buffered: dict[str, bool]
  in_branch: dict[str, bool]


def executions(comps: dict[str, list[Instr]], entry: str) -> CallGraph:
  """The call graph from ENTRY. Fusion bodies and reductions' `to_apply` are not kernels of their own and are
  left out; a branch counts as running every time its conditional does, and the body of a loop without a
  known trip count once every time the loop does (upper bounds), both as "in a branch": they may not run
  (the bounded rounds' further rounds run only when some rank needs them)."""
  graph = CallGraph(defaultdict(float), {}, {})
  stack = [(entry, 1.0, False, False)]
  while stack:
    comp, n, buffered, branch = stack.pop()
    graph.runs[comp] += n
    graph.buffered[comp] = graph.buffered.get(comp, False) or buffered
    graph.in_branch[comp] = graph.in_branch.get(comp, True) and branch
    for ins in comps.get(comp, []):
      trip = _TRIP.search(ins.rest)
      for kind, callee in _callees(ins):
        applied = kind == "to_apply" and ins.opcode not in ("call", "call-start")  # a reduction's, not a call's
        if applied or (kind == "calls" and ins.opcode == "fusion"):
          continue
        times = n * (int(trip.group(1)) if trip and kind == "body" else 1)
        inside = buffered or "command_buffer" in callee or "command_buffer" in ins.name
        maybe = ins.opcode == "conditional" or (ins.opcode == "while" and kind == "body" and not trip)
        stack.append((callee, times, inside, branch or maybe))
  return graph


def group_size(rest: str, num_devices: int) -> int:
  """Devices in each replica group of a collective (all of them when it names none)."""
  if m := _GROUPS_IOTA.search(rest):
    return int(m.group(2))
  if m := _GROUPS_LIST.search(rest):
    return len([x for x in m.group(1).split(",") if x])
  if m := _GROUPS_MESH.search(rest):
    sizes = dict(re.findall(r"'(\w+)'=(\d+)", m.group(1)))
    return math.prod(int(sizes.get(axis, 1)) for axis in group_axes(rest))
  return num_devices


def result_shape(ins: Instr) -> str:
  """The shape a collective produces: an async `*-start` is shaped ((operands...), results...), its
  results what the matching `*-done` returns."""
  shape = ins.shape
  if not (ins.opcode.endswith("-start") and shape.startswith("((")):
    return shape
  depth = 0
  for i, ch in enumerate(shape[1:], start=1):
    depth += {"(": 1, ")": -1}.get(ch, 0)
    if depth == 0:
      return shape[i + 1 :].lstrip(", ")[:-1]
  return shape


def group_axes(rest: str, mesh: dict[str, int] | None = None) -> tuple[str, ...]:
  """The named mesh axes a collective's groups span (`replica_groups=mesh[...] {'fsdp', ...}`); () when
  its groups are listed by device id. A collective of our shard_map bodies names its mesh's axes
  `axis_0`, `axis_1`, ...: with `mesh` (the job's axes of size > 1, in MaxText's order, `report`'s
  "layout") whose sizes are the anonymous mesh's in order, each is named after the axis in its place."""
  if not (m := _GROUPS_MESH.search(rest)):
    return ()
  axes = tuple(re.findall(r"'(\w+)'", m.group(2)))
  shape = [(name, int(size)) for name, size in re.findall(r"'(\w+)'=(\d+)", m.group(1))]
  if mesh and all(re.fullmatch(r"axis_\d+", name) for name, _ in shape):
    named = list(mesh.items())
    if [size for _, size in shape] == [size for _, size in named]:
      rename = {anon: name for (anon, _), (name, _) in zip(shape, named, strict=True)}
      return tuple(rename.get(a, a) for a in axes)
  return axes


def _collective(ins: Instr) -> str | None:
  base = ins.opcode.removesuffix("-start")
  if base in COLLECTIVES:
    return base
  return None


_EP_TARGET = re.compile(r'custom_call_target="te_ep_(\w+?)_ffi"')


def _te_ep(ins: Instr) -> str | None:
  """TE's NCCL EP call an instruction is ('prepare', 'dispatch', 'combine_bwd', ...), or None."""
  m = _EP_TARGET.search(ins.rest) if ins.opcode == "custom-call" else None
  return m.group(1) if m else None


def _on_host(shape: str) -> bool:
  return HOST_MEMORY_SPACE in shape


_OPERANDS = re.compile(r"%([\w.\-]+)")


def _host_move(ins: Instr, shapes: dict[str, str]) -> tuple[str, int] | None:
  """('to_host' | 'from_host', bytes moved) for a data movement between device and host memory, else None.
  A dynamic-update-slice into a host buffer (how XLA:GPU writes a scanned layer's offloaded activation,
  inside an async fusion) moves its update; anything else moves what it writes."""
  if ins.opcode not in ("copy-start", "copy", "dynamic-update-slice", "dynamic-slice", "fusion", "bitcast"):
    return None
  names = _OPERANDS.findall(ins.rest.split("),")[0])
  written = _moved(ins)
  if ins.opcode == "dynamic-update-slice" and _on_host(written) and len(names) > 1:
    update = shapes.get(names[1], "")
    return None if _on_host(update) else ("to_host", array_bytes(update))
  from_host = any(_on_host(shapes.get(n, "")) for n in names)
  to_host = _on_host(written)
  if ins.opcode == "bitcast" or to_host == from_host:
    return None
  return ("to_host" if to_host else "from_host"), array_bytes(written)


def _moved(ins: Instr) -> str:
  """The shape of what a data movement writes: a copy-start's first tuple element (its destination)."""
  if ins.opcode == "copy-start":
    first = _ARRAY.search(ins.shape)
    return first.group(0) if first else ""
  return ins.shape


def _add(table: dict, key: str, *, runs: float, nbytes: int, **extra: Any) -> None:
  row = table.setdefault(key, {"count": 0.0, "bytes": 0.0, **extra})
  row["count"] += runs
  row["bytes"] += runs * nbytes


def report(text: str, *, num_devices: int, mesh: dict[str, int] | None = None) -> dict[str, Any]:
  """Per-step figures of one device's program (see the module docstring). `host_syncs_per_step` counts the
  host syncs that run whatever the data (conditionals and unknown-trip loops outside any conditional's
  branch); `host_syncs_per_step_at_most` also those inside branches, as if every branch were taken.
  `mesh`: the job's mesh axes of size > 1, in order, to name the axes of anonymous meshes (`group_axes`);
  collectives of one kind and group size over different axes are rows of their own."""
  comps, entry = parse(text)
  graph = executions(comps, entry)
  collectives: dict[str, dict] = {}
  host: dict[str, dict] = {}
  exchanges: dict[str, dict] = {}  # TE's NCCL EP custom calls
  gemms: dict[str, float] = defaultdict(float)
  formats: dict[str, float] = defaultdict(float)
  out = {"conditionals": 0, "conditionals_in_command_buffers": 0, "while_loops": 0, "unknown_trip_while_loops": 0}
  out |= {"host_syncs_per_step": 0.0, "host_syncs_per_step_at_most": 0.0}
  for comp, instrs in comps.items():
    n = graph.runs.get(comp, 0.0)
    if not n:
      continue
    shapes = {i.name: i.shape for i in instrs}
    for ins in instrs:
      if kind := _collective(ins):
        size = group_size(ins.rest, num_devices)
        is_async = ins.opcode.endswith("-start") or '"is_sync":false' in ins.rest
        key = f"{kind} x{size}{' async' if is_async else ''}{' (in a branch)' if graph.in_branch.get(comp) else ''}"
        nbytes = array_bytes(result_shape(ins))
        axes = group_axes(ins.rest, mesh)
        if key in collectives and collectives[key]["axes"] != list(axes):
          key = f"{key} over {'+'.join(axes) or 'listed groups'}"
        _add(collectives, key, runs=n, nbytes=nbytes, kind=kind, group_size=size, is_async=is_async, axes=list(axes))
      if ep := _te_ep(ins):  # NCCL inside a custom call: its output is what arrives
        _add(exchanges, f"te_ep {ep}", runs=n, nbytes=array_bytes(result_shape(ins)))
      if move := _host_move(ins, shapes):
        _add(host, move[0], runs=n, nbytes=move[1])
      if gemm := gemm_kind(ins):
        gemms[gemm] += n
        formats[f"{gemm} {gemm_format(ins, shapes)}"] += n
      syncs = _syncs(ins, out, buffered=graph.buffered.get(comp, False))
      out["host_syncs_per_step_at_most"] += n * syncs
      out["host_syncs_per_step"] += 0 if graph.in_branch.get(comp) else n * syncs
  return {
    **schedule.exchange_overlap(comps, graph, size=lambda ins: array_bytes(result_shape(ins))),
    "collectives": collectives,
    "te_ep_calls": exchanges,
    "host_transfers": host,
    "gemms": dict(gemms),
    "gemm_formats": dict(formats),
    **out,
    **schedule.streams(comps),
  }


def _syncs(ins: Instr, out: dict[str, Any], *, buffered: bool) -> int:
  """Host syncs one execution of `ins` costs (counting the op kinds into `out`): a conditional outside a
  command buffer one, a while loop without a known trip count at least one."""
  if ins.opcode == "conditional":
    out["conditionals"] += 1
    out["conditionals_in_command_buffers"] += int(buffered)
    return 0 if buffered else 1
  if ins.opcode == "while":
    out["while_loops"] += 1
    unknown = not _TRIP.search(ins.rest)
    out["unknown_trip_while_loops"] += int(unknown)
    return int(unknown)
  return 0
