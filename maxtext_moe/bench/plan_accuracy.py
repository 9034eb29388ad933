"""`maxtext-moe bench plan`: the planner's per-device memory estimate against XLA's own.

For each case, a child process with 8 fake CPU devices compiles MaxText's train step ahead of time (as
`train_compile.py` does; nothing is allocated) and reports `memory_analysis()`: device bytes = arguments +
outputs - aliased (donated) + temporaries. The planner estimates the same config from the resolved config
alone. `max_rel_error` = max over cases of |estimate - XLA| / XLA.

The cases: the tiny model on FSDP=8 (local dispatch) and on EP=4 x FSDP=2 (all_to_all), the tiny model with
the optimizer on the host (XLA:CPU reports pinned_host buffers in the device space, host_* = 0, so that
case checks the device total only), and the 16B proxy at its H200 recipe's shape (EP=8, 4 x 4096 tokens per device,
about 115 GiB per device) and at 1 x 1024 tokens. On CPU, attention is MaxText's dot-product kernel and the
EP dispatcher is all_to_all; the planner models both. The proxy compiles take about 90 s each on 2 cores.
"""

import json
import os
import subprocess
import sys
import time
from typing import IO, Any

from maxtext_moe.bench.report import emit
from maxtext_moe.errors import UserError
from maxtext_moe.gpu_compile.child import TE_PYTHON, compile_in_child

CASES: dict[str, tuple[str, list[str]]] = {
  "tiny fsdp=8": ("cpu/deepseek3-tiny", []),
  "tiny ep=4 fsdp=2": ("cpu/deepseek3-tiny", ["ici_expert_parallelism=4", "ici_fsdp_parallelism=2"]),
  "tiny offload=optimizer": ("cpu/deepseek3-tiny", ["offload=optimizer"]),
  "proxy-16b ep=8 4x4096": ("h200x8/deepseek3-proxy-16b", ["hardware=cpu", "attention=dot_product"]),
  "proxy-16b ep=8 1x1024": (
    "h200x8/deepseek3-proxy-16b",
    ["hardware=cpu", "attention=dot_product", "per_device_batch_size=1", "max_target_length=1024"],
  ),
}
QUICK = ("tiny fsdp=8", "tiny ep=4 fsdp=2")
DEVICES = 8
# `--gpu`: at least one recipe of every GPU model we ship, at full size, compiled by XLA:GPU for its GPUs.
GPU_CASES: dict[str, tuple[str, list[str]]] = {
  "h100x8 mixtral-8x7b": ("h100x8/mixtral-8x7b", []),
  "h200x8 deepseek3-proxy-16b": ("h200x8/deepseek3-proxy-16b", []),
  "h200x8 qwen3-30b-a3b": ("h200x8/qwen3-30b-a3b", []),
  "h100x8 qwen3-30b-a3b tp=2": ("h100x8/qwen3-30b-a3b", ["ici_tensor_parallelism=2", "ici_fsdp_parallelism=2"]),
  "b200x8 deepseek3-proxy-16b": ("b200x8/deepseek3-proxy-16b", []),
  "gb200-nvl72 deepseek3-671b": ("gb200-nvl72/deepseek3-671b", []),
  "gb300x1024 deepseek3-671b": ("gb300x1024/deepseek3-671b", []),
}
# `--gpu --te`: the container's programs, with Transformer Engine's grouped GEMM and NCCL EP, in the
# environment `./setup.sh --gpu-compile-te` makes; the recipes that keep their state on the host among them.
GPU_TE_CASES: dict[str, tuple[str, list[str]]] = {
  "h200x8 deepseek3-proxy-16b te bf16": ("h200x8/deepseek3-proxy-16b", []),
  "h200x8 deepseek3-proxy-16b te fp8": ("h200x8/deepseek3-proxy-16b", ["moe_gemm_quantization=fp8"]),
  "b200x8 deepseek3-proxy-16b te fp8": ("b200x8/deepseek3-proxy-16b", ["moe_gemm_quantization=fp8"]),
  "gb200-nvl72 deepseek3-671b te": ("gb200-nvl72/deepseek3-671b", []),
  "h100x8 deepseek3-671b te": ("h100x8/deepseek3-671b", []),
  "h200x8 deepseek3-671b te": ("h200x8/deepseek3-671b", []),
}


def xla_memory(recipe: str, overrides: list[str], *, devices: int = DEVICES) -> dict[str, int]:
  """XLA's memory_analysis() of the train step, compiled in a child process on `devices` fake CPU devices."""
  env = dict(os.environ)
  env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}".strip()
  env["JAX_PLATFORMS"] = "cpu"
  cmd = [sys.executable, "-m", "maxtext_moe.bench.plan_accuracy", "--worker", recipe, *overrides]
  proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
  lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
  if proc.returncode != 0 or not lines:
    raise RuntimeError(f"compiling {recipe} {overrides} failed:\n{proc.stderr[-3000:]}")
  return json.loads(lines[-1])


def device_bytes(mem: dict[str, int], prefix: str = "") -> int:
  """Bytes resident at once: arguments + outputs - the outputs that alias donated arguments + temporaries."""
  get = lambda n: mem[f"{prefix}{n}_bytes"]  # noqa: E731
  return get("argument") + get("output") - get("alias") + get("temp")


def compare(name: str, *, devices: int = DEVICES) -> dict[str, Any]:
  """One case: the planner's estimate, XLA's figure and the relative error, device and host."""
  from maxtext_moe.planner.memory_plan import memory_plan

  recipe, overrides = CASES[name]
  t0 = time.perf_counter()
  mem = xla_memory(recipe, overrides, devices=devices)
  compile_s = time.perf_counter() - t0
  est = memory_plan(recipe, overrides, gpus=devices).base
  xla_dev, xla_host = device_bytes(mem), device_bytes(mem, "host_")
  return {
    "estimate_bytes": est.device_total,
    "xla_bytes": xla_dev,
    "rel_error": abs(est.device_total - xla_dev) / xla_dev,
    "estimate_host_bytes": est.host,
    "xla_host_bytes": xla_host,
    "compile_s": compile_s,
  }


def gpu_compile(recipe: str, overrides: list[str], *, python: str = sys.executable) -> dict[str, Any]:
  """`maxtext-moe compile RECIPE --json` in a child process (`gpu_compile.child`), run by `python` (the TE
  environment's for the TE cases)."""
  done = compile_in_child(recipe, overrides, python=python)
  if done.report is None:
    raise RuntimeError(f"compile {recipe} {overrides} failed: {done.error}")
  return done.report


def run_gpu(*, out: IO[str], as_json: bool = False, only: str | None = None, te: bool = False) -> dict[str, Any]:
  """The planner against XLA:GPU at full size for every GPU model (`GPU_CASES`; with `te`, `GPU_TE_CASES`
  in the TE environment), a table and the JSON."""
  from rich.table import Table

  if te and not TE_PYTHON.is_file():
    raise UserError("bench plan --gpu --te compiles with Transformer Engine: run ./setup.sh --gpu-compile-te first")
  table_of = GPU_TE_CASES if te else GPU_CASES
  python = str(TE_PYTHON) if te else sys.executable
  names = [n for n in table_of if only is None or only in n]
  if not names:
    raise UserError(f"no --gpu case contains {only!r}; the cases: {', '.join(table_of)}")
  cases = {name: gpu_compile(*table_of[name], python=python) for name in names}
  result = {"cases": cases, "max_rel_error": max(abs(c["rel_error"]) for c in cases.values())}
  table = Table(title="Planner vs XLA:GPU memory per GPU (compiled without a GPU; kernels not autotuned)")
  cols = ("case", "GPUs", "XLA:GPU GiB", "planner GiB", "rel. error", "fits (XLA / planner)", "host syncs")
  cols += ("grouped GEMM",)
  for col in cols:
    table.add_column(col, justify="left" if col == "case" else "right")
  gib = 2**30
  for name, c in cases.items():
    table.add_row(
      name,
      str(c["devices"]),
      f"{c['device_bytes'] / gib:.1f}",
      f"{c['planner_device_bytes'] / gib:.1f}",
      f"{c['rel_error']:+.1%}",
      f"{c['fits']} / {c['planner']['fits']}",
      f"{c['host_syncs_per_step']:,.0f}",
      _grouped_gemm(c["gemms"]),
    )
  table.add_row("max |rel. error|", "", "", "", f"{result['max_rel_error']:.1%}", "", "", "")
  emit(table, result, as_json=as_json, out=out)
  return result


def _grouped_gemm(gemms: dict[str, float]) -> str:
  """The grouped-GEMM kernels of a compiled step ("te_grouped_gemm 168"), the rest of its GEMMs left out."""
  grouped = {k: v for k, v in gemms.items() if k in ("te_grouped_gemm", "mosaic_gpu")}
  return ", ".join(f"{k} {v:,.0f}" for k, v in sorted(grouped.items())) or "-"


def run(*, out: IO[str], as_json: bool = False, quick: bool = False) -> dict[str, Any]:
  """Runs the cases, prints a table, and with as_json prints one JSON object as the last line."""
  from rich.table import Table

  names = QUICK if quick else tuple(CASES)
  cases = {name: compare(name) for name in names}
  result = {"cases": cases, "max_rel_error": max(c["rel_error"] for c in cases.values())}
  table = Table(title="Planner vs XLA memory_analysis() per device (CPU, 8 fake devices)")
  for col in ("case", "planner GiB", "XLA GiB", "rel. error", "host: planner / XLA GiB"):
    table.add_column(col, justify="left" if col == "case" else "right")
  gib = 2**30
  for name, c in cases.items():
    table.add_row(
      name,
      f"{c['estimate_bytes'] / gib:.3f}",
      f"{c['xla_bytes'] / gib:.3f}",
      f"{c['rel_error']:.1%}",
      f"{c['estimate_host_bytes'] / gib:.3f} / {c['xla_host_bytes'] / gib:.3f}",
    )
  table.add_row("max_rel_error", "", "", f"{result['max_rel_error']:.1%}", "")
  emit(table, result, as_json=as_json, out=out)
  return result


def _worker(argv: list[str]) -> None:
  from maxtext_moe.config.recipes import recipe_path
  from maxtext_moe.upstream.maxtext.compile import compiled_train_memory
  from maxtext_moe.upstream.resolution import resolved

  recipe, overrides = argv[0], argv[1:]
  print(json.dumps(compiled_train_memory(resolved(recipe_path(recipe), overrides))))


if __name__ == "__main__":
  if sys.argv[1:2] == ["--worker"]:
    _worker(sys.argv[2:])
