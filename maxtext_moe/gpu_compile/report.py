"""The report of `maxtext-moe compile`: XLA:GPU's memory for one device beside the planner's, the
collectives, host transfers and host syncs of one step, GEMM kinds, and what was substituted."""

import json
from pathlib import Path
from typing import Any

from maxtext_moe.gpu_compile import hlo
from maxtext_moe.planner.memory_plan import memory_plan

GIB = 2**30
NOTE = (
  "XLA:GPU compiled without a GPU: program structure, collectives and memory are XLA:GPU's; kernel choices "
  "(GEMM tiles, fusions) are its defaults, not autotuned"
)


def usable_bytes(gpu: Any, recipe: Any) -> int:
  """The device memory JAX's allocator may use on one of the recipe's GPUs: its flag profile's
  XLA_PYTHON_CLIENT_MEM_FRACTION (JAX's default 0.75) of the GPU's memory. JAX also compiles with this as the
  device's memory size (jaxlib's PyClient hands XLA its allocator's limit)."""
  return int(gpu.hbm_bytes * float(recipe.flags.env.get("XLA_PYTHON_CLIENT_MEM_FRACTION", 0.75)))


def build(
  cfg: Any, compiled: Any, *, target: Any, recipe: Any, usable: int, substitutions: list[str], compile_s: float
) -> dict:
  """The report of one compiled step (`compiled`: jax.stages.Compiled, or `upstream.maxtext.compile.HostStateProgram`,
  for `target`'s devices)."""
  from maxtext_moe.upstream.maxtext.compile import memory  # pylint: disable=import-outside-toplevel

  mem = memory(compiled)
  device = mem["argument_bytes"] + mem["output_bytes"] - mem["alias_bytes"] + mem["temp_bytes"]
  host = mem["host_argument_bytes"] + mem["host_output_bytes"] - mem["host_alias_bytes"] + mem["host_temp_bytes"]
  layout = {a: int(n) for a, n in zip(cfg.mesh_axes, _layout(cfg, target), strict=True) if n > 1}
  program = hlo.report(compiled.as_text(), num_devices=target.devices, mesh=layout)
  transfers = program["host_transfers"]
  return {
    "platform": "cuda",
    "gpu": target.name,
    "product": target.gpu.product,
    "devices": target.devices,
    "partitions": target.partitions,
    "layout": layout,
    "memory": mem,
    "device_bytes": device,
    "host_bytes": host,
    "usable_hbm_bytes": usable,
    "fits": device <= usable,
    "collectives": program["collectives"],
    "te_ep_calls": program["te_ep_calls"],
    "host_transfers": transfers,
    "host_transfer_bytes": sum(r["bytes"] for r in transfers.values()),
    "exchange_bytes": program["exchange_bytes"],
    "exchange_beside_gemm_bytes": program["exchange_beside_gemm_bytes"],
    "host_syncs_per_step": program["host_syncs_per_step"],
    "host_syncs_per_step_at_most": program["host_syncs_per_step_at_most"],
    "conditionals": program["conditionals"],
    "conditionals_in_command_buffers": program["conditionals_in_command_buffers"],
    "while_loops": program["while_loops"],
    "unknown_trip_while_loops": program["unknown_trip_while_loops"],
    "gemms": program["gemms"],
    "gemm_formats": program["gemm_formats"],
    "async_starts": program["async_starts"],
    "operation_queues": program["operation_queues"],
    "command_buffers": program["command_buffers"],
    "compile_s": round(compile_s, 1),
    "substitutions": substitutions,
    "xla_flags": recipe.flags.xla_flags,
    "note": NOTE,
  }


def _layout(cfg: Any, target: Any) -> list[int]:
  from maxtext_moe.moe.layout import mesh_sizes  # pylint: disable=import-outside-toplevel

  return list(mesh_sizes(cfg, target.devices).values())


def planner_figures(name: str | None, overrides: list[str], *, target: Any) -> dict[str, Any]:
  """The planner's estimate of the same config (the compile's substitutions included)."""
  plan = memory_plan(name or "cpu/deepseek3-tiny", overrides, gpus=target.devices)
  e = plan.base
  return {
    "device_bytes": e.device_total,
    "host_bytes": e.host,
    "host_state_bytes": e.host_state,
    "dispatch": plan.dispatch,
    "fits": e.fits,
  }


def compare(report: dict[str, Any]) -> None:
  """Adds the planner's figures and its relative error against XLA:GPU's, device to device and host to host:
  the program holds the state MaxText offloads in host memory between steps as a GPU run does
  (`upstream.maxtext.compile.holds_state_on_host`), and both device figures count what the step brings back."""
  planner = report["planner"]
  report["planner_device_bytes"] = planner["device_bytes"]
  report["planner_host_bytes"] = planner["host_bytes"]
  report["rel_error"] = round((planner["device_bytes"] - report["device_bytes"]) / max(report["device_bytes"], 1), 4)


def keep(report: dict[str, Any], text: str, directory: Path) -> None:
  """Writes the optimized HLO and the report's JSON to `directory` (created)."""
  directory.mkdir(parents=True, exist_ok=True)
  (directory / "train_step.after_optimizations.txt").write_text(text)
  (directory / "compile.json").write_text(json.dumps(report, indent=1) + "\n")


def _gib(n: float) -> str:
  return f"{n / GIB:,.2f}"


def _spare_memory_note(r: dict[str, Any]) -> list[str]:
  """A line where the program took more than the planner says it needs, with memory to spare: XLA:GPU's
  scheduler spends memory up to its target (slop x (memory - arguments)) on overlap."""
  planned, scheduled = r["planner_device_bytes"], r.get("scheduled_for_bytes", r["usable_hbm_bytes"])
  if not r["fits"] or r["rel_error"] >= -0.10 or planned >= scheduled:
    return []
  return [
    "  (XLA:GPU spends memory it has to spare on overlap; --memory planned compiles the step for the planner's figure)"
  ]


def format_report(r: dict[str, Any]) -> str:
  """The table `compile` prints."""
  layout = " x ".join(f"{a}={n}" for a, n in r["layout"].items()) or "1 device"
  m = r["memory"]
  where = f"{r['devices']} x {r['product']} ({r['partitions']} NVLink partition(s))"
  planned = f"{_gib(r['planner_device_bytes']):>13}  ({r['rel_error']:+.1%})"
  lines = [
    f"{where}, {layout}; compiled in {r['compile_s']} s",
    "",
    f"  {'per GPU':<36}{'XLA:GPU GiB':>12}{'planner GiB':>13}",
    f"  {'arguments (outputs aliased to them)':<36}{_gib(m['argument_bytes']):>12}",
    f"  {'temporaries':<36}{_gib(m['temp_bytes']):>12}",
    f"  {'device total':<36}{_gib(r['device_bytes']):>12}{planned}",
    f"  {'host (offloaded)':<36}{_gib(r['host_bytes']):>12}{_gib(r['planner_host_bytes']):>13}",
    f"  {'usable HBM':<36}{_gib(r['usable_hbm_bytes']):>12}   {'FITS' if r['fits'] else 'DOES NOT FIT'}",
    *(
      [f"  {'scheduled for (--memory)':<36}{_gib(r['scheduled_for_bytes']):>12}"]
      if r.get("scheduled_for_bytes", r["usable_hbm_bytes"]) != r["usable_hbm_bytes"]
      else []
    ),
    *_spare_memory_note(r),
    "",
    "  collectives per step (one GPU)              count        GiB",
  ]
  for key, row in sorted(r["collectives"].items()):
    lines.append(f"    {key:<40}{row['count']:>8,.0f}{_gib(row['bytes']):>11}")
  for key, row in sorted(r.get("te_ep_calls", {}).items()):
    lines.append(f"    {key + ' (NCCL EP, output)':<40}{row['count']:>8,.0f}{_gib(row['bytes']):>11}")
  for handle in r.get("te_ep_handles", []):
    lines.append(
      f"    te_ep handle: {handle['bytes'] / 2**20:,.1f} MiB per prepare ({handle['nvlink_ranks']} of "
      f"{handle['ep_size']} ranks per NVLink domain, {handle['recv_capacity']:,} receive rows)"
    )
  for key, row in sorted(r["host_transfers"].items()):
    lines.append(f"  host transfers {key:<29}{row['count']:>8,.0f}{_gib(row['bytes']):>11}")
  if r.get("exchange_bytes"):
    beside = r["exchange_beside_gemm_bytes"]
    lines.append(
      f"  expert exchange beside a GEMM: {_gib(beside)} of {_gib(r['exchange_bytes'])} GiB per step "
      f"({beside / r['exchange_bytes']:.0%}; all-to-alls with a GEMM scheduled between their start and done)"
    )
  lines += [
    "",
    f"  host syncs per step: {r['host_syncs_per_step']:,.0f}, at most {r['host_syncs_per_step_at_most']:,.0f} "
    f"when every branch runs ({r['conditionals']} conditionals, "
    f"{r['conditionals_in_command_buffers']} in command buffers; {r['while_loops']} while loops, "
    f"{r['unknown_trip_while_loops']} of unknown trip count)",
    "  GEMMs per step by kind and format: "
    + ", ".join(f"{k} {v:,.0f}" for k, v in sorted(r.get("gemm_formats", r["gemms"]).items())),
    f"  schedule: {r['command_buffers']} command buffers, {r['operation_queues']} operation queue(s), async "
    + ", ".join(f"{k} {v}" for k, v in sorted(r["async_starts"].items())),
  ]
  if "peak" in r:
    lines.append(f"  live at the temporaries' peak ({_gib(r['peak']['peak_bytes'])} GiB), largest first:")
    lines += [f"    {_gib(n):>8} GiB  {shape}  {name}" for name, shape, n in r["peak"]["values"][:12]]
  lines += [f"  substituted: {s}" for s in r["substitutions"]]
  lines.append(f"  note: {r['note']}")
  return "\n".join(lines)
