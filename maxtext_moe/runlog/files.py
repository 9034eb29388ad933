"""A run directory's row files: `metrics.jsonl` (one row per training step and per evaluation) and
`moe_load.jsonl` (the per-layer expert load every moe_load_every steps).

A training row is `{"step", "loss", "tokens_per_s", "tflops_per_s_per_device", "step_time_s",
"learning_rate", "grad_norm", ...}` plus the step's `moe/*` scalars; an evaluation row
`{"step": S, "eval_loss", "eval_tokens"}` follows train step S's row. JSON has no NaN: a non-finite loss is
`"loss": null, "loss_nonfinite": "nan" | "inf"`.
"""

import json
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

METRICS, LOAD = "metrics.jsonl", "moe_load.jsonl"
# MaxText scalar name -> our JSONL field.
_FIELDS = {
  "learning/loss": "loss",
  "perf/step_time_seconds": "step_time_s",
  "perf/per_device_tflops_per_sec": "tflops_per_s_per_device",
  "learning/current_learning_rate": "learning_rate",
  "learning/grad_norm": "grad_norm",
  "learning/raw_grad_norm": "raw_grad_norm",
}
_MOE_PREFIX = "moe/"


TORN_SUFFIX = ".torn"  # METRICS + TORN_SUFFIX: the lines a crash cut short, set aside when a run resumes


def split_jsonl(path: Path) -> tuple[list[dict[str, Any]], list[tuple[int, str]]]:
  """(the whole rows of a JSONL file, the (line number, text) of lines that are not one: a line a crash
  or a full disk cut short). Missing file: ([], [])."""
  if not path.is_file():
    return [], []
  rows, torn = [], []
  with open(path, encoding="utf-8", errors="replace") as f:
    for n, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        row = json.loads(line)
      except json.JSONDecodeError:
        row = None
      if isinstance(row, dict):
        rows.append(row)
      else:
        torn.append((n, line.rstrip("\n")))
  return rows, torn


def _torn_line(path: Path, torn: list[tuple[int, str]], kept: Path | None) -> str:
  where = ", ".join(str(n) for n, _ in torn[:5]) + (" ..." if len(torn) > 5 else "")
  fate = f"kept in {kept} and left out" if kept else "left out"
  return f"maxtext-moe: warning: {path} has {len(torn)} cut-short line(s) (line {where}: a crash mid-write); {fate}"


def read_jsonl(path: Path) -> list[dict[str, Any]]:
  """The whole rows of a JSONL file we append to; a cut-short line is left out, with one warning line."""
  rows, torn = split_jsonl(path)
  if torn:
    print(_torn_line(path, torn, None), file=sys.stderr, flush=True)
  return rows


def set_aside_torn(path: Path) -> list[dict[str, Any]]:
  """The whole rows of `path`; its cut-short lines are appended to PATH.torn (named in one warning line),
  so a rewrite of `path` loses nothing a user might want to look at."""
  rows, torn = split_jsonl(path)
  if torn:
    kept = path.with_name(path.name + TORN_SUFFIX)
    with open(kept, "a", encoding="utf-8") as f:
      f.writelines(line + "\n" for _, line in torn)
    print(_torn_line(path, torn, kept), file=sys.stderr, flush=True)
  return rows


def open_append(path: Path) -> Any:
  """`path` opened for appending rows, a newline first when its last line was cut short: a torn line is
  never joined by the next whole row."""
  f = open(path, "a+", encoding="utf-8")  # noqa: SIM115 - the caller closes it
  if f.tell() > 0:
    f.seek(f.tell() - 1)
    if f.read(1) != "\n":
      f.write("\n")
  return f


def rewrite_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
  """Replaces `path` with `rows`, atomically (a crash leaves the old file or the new one)."""
  fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
  with os.fdopen(fd, "w", encoding="utf-8") as f:
    for row in rows:
      f.write(json.dumps(row) + "\n")
  umask = os.umask(0)
  os.umask(umask)
  os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it 0600; the run's other files follow the umask
  os.replace(tmp, path)


def eval_row(step: int, scalars: dict[str, float]) -> dict[str, Any]:
  """One evaluation's JSONL row: MaxText's token-weighted mean loss over the whole eval pass."""
  loss = scalars["eval/avg_loss"]
  row: dict[str, Any] = {"step": step, "eval_loss": loss if math.isfinite(loss) else None}
  row["eval_tokens"] = int(scalars.get("eval/total_weights", 0))
  return row


def is_eval(row: dict[str, Any]) -> bool:
  return "eval_loss" in row


def step_row(step: int, scalars: dict[str, float], *, num_devices: int) -> dict[str, Any]:
  """One JSONL row: step, loss, tokens/s (all devices), TFLOP/s per device, plus any moe/* scalars."""
  row: dict[str, Any] = {"step": step}
  for src, dst in _FIELDS.items():
    if src in scalars:
      row[dst] = scalars[src]
  loss = row.get("loss")
  if loss is not None and not math.isfinite(loss):  # JSON has no NaN: null, and which it was
    row["loss"], row["loss_nonfinite"] = None, "nan" if math.isnan(loss) else "inf"
  if "perf/per_device_tokens_per_sec" in scalars:
    row["tokens_per_s"] = scalars["perf/per_device_tokens_per_sec"] * num_devices
  row.update({k: v for k, v in scalars.items() if k.startswith(_MOE_PREFIX)})
  return row


def load_row(step: int, load_LE: Any, bias_L: Any) -> dict[str, Any]:
  """One moe_load.jsonl row: each MoE layer's [E] routed assignments and mean |routing bias|."""
  return {
    "step": step,
    "load": [[int(v) for v in layer] for layer in load_LE],
    "bias_abs_mean": [float(v) for v in bias_L],
  }


Layers = tuple[np.ndarray, np.ndarray, np.ndarray] | None  # `read_layers`


def read_layers(path: Path) -> Layers:
  """(steps [S], load [S, L, E], bias [S, L]) of a moe_load.jsonl, or None when there is none."""
  rows = read_jsonl(path)
  if not rows:
    return None
  steps = np.array([r["step"] for r in rows])
  return steps, np.array([r["load"] for r in rows], np.float64), np.array([r["bias_abs_mean"] for r in rows])
