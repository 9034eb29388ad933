"""FP8 dense GEMMs with our block, trained: the loss of `cpu/deepseek3-tiny` with `quantization=fp8` against
the same run unquantized (the recipe's float32), same seed, same data (the embedded corpus), same steps.

XLA:CPU runs MaxText's `fp8` path (Flax's FP8 dot with delayed scaling) by widening the FP8 operands after
rounding them to FP8, so the numbers are FP8's and the speed is not: this benchmark is about the loss only.
Transformer Engine's recipes need a GPU. Each run is `maxtext-moe train` in its own process (about
1-2 s per step on 2 cores, plus a minute to start); `--quick` runs 20 steps instead of 100.

The table: the loss of each at steps 1, 10, 20, ...; the FP8 run's difference; and the mean absolute
difference over the last ten steps as a share of the baseline's loss (measured in the same run). A step
whose loss was not finite (`"loss": null` in metrics.jsonl) fails the benchmark, naming the run.
"""

import json
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import IO, Any

from maxtext_moe.bench.report import emit
from maxtext_moe.errors import UserError

RECIPE = "cpu/deepseek3-tiny"
RUNS = {"baseline": [], "fp8": ["quantization=fp8"]}  # the baseline: no quantization, the recipe's float32


def train_losses(name: str, overrides: list[str], *, steps: int, root: Path) -> list[float]:
  """The per-step loss of one `maxtext-moe train` run of RECIPE (in its own process)."""
  args = [RECIPE, f"steps={steps}", f"run_name={name}", f"base_output_directory={root}", "progress=silent"]
  args += ["checkpoint_period=100000", *overrides]
  proc = subprocess.run(
    [sys.executable, "-m", "maxtext_moe", "train", *args], capture_output=True, text=True, check=False
  )
  if proc.returncode != 0:
    tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
    raise UserError(f"bench fp8: the {name} run failed ({tail[0]})")
  rows = [json.loads(line) for line in (root / name / "metrics.jsonl").read_text().splitlines() if line.strip()]
  if any(not isinstance(r.get("loss"), (int, float)) for r in rows) or len(rows) != steps:
    raise UserError(f"bench fp8: the {name} run has {len(rows)} steps of {steps} or a loss that is not finite")
  return [float(r["loss"]) for r in rows]


def compare(losses: dict[str, list[float]]) -> dict[str, Any]:
  """Rows at steps 1, 10, 20, ... and the last-ten-steps mean |FP8 - baseline| relative to the baseline."""
  base, fp8 = losses["baseline"], losses["fp8"]
  steps = len(base)
  marks = sorted({1, *range(10, steps + 1, 10), steps})
  rows = [
    {"step": s, "baseline": base[s - 1], "fp8": fp8[s - 1], "difference": fp8[s - 1] - base[s - 1]} for s in marks
  ]
  tail = range(max(steps - 10, 0), steps)
  mean_abs = sum(abs(fp8[i] - base[i]) for i in tail) / len(tail)
  mean_base = sum(base[i] for i in tail) / len(tail)
  return {"recipe": RECIPE, "steps": steps, "rows": rows, "last10_mean_abs_difference": mean_abs,
          "last10_relative": mean_abs / mean_base}  # fmt: skip


def run(*, out: IO[str], as_json: bool = False, quick: bool = False) -> dict[str, Any]:
  from rich.table import Table  # pylint: disable=import-outside-toplevel

  steps = 20 if quick else 100
  with tempfile.TemporaryDirectory(prefix="bench-fp8-") as tmp:
    losses = {name: train_losses(name, o, steps=steps, root=Path(tmp)) for name, o in RUNS.items()}
  result = compare(losses)
  table = Table(title=f"{RECIPE}, {steps} steps: loss, FP8 dense GEMMs against none", min_width=72)
  for col in ("step", "no quantization (float32)", "quantization=fp8", "difference"):
    table.add_column(col, justify="right")
  for r in result["rows"]:
    table.add_row(str(r["step"]), f"{r['baseline']:.4f}", f"{r['fp8']:.4f}", f"{r['difference']:+.4f}")
  table.caption = (
    f"last 10 steps: mean |difference| {result['last10_mean_abs_difference']:.4f} "
    f"({result['last10_relative']:.2%} of the unquantized loss)"
  )
  emit(table, result, as_json=as_json, out=out)
  return result
