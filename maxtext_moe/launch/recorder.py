"""Per-step run outputs: a metrics JSONL file, live progress, a loss-curve PNG and a summary.

MaxText's MetricLogger hands each training step's scalars to `RunRecorder.step` (through the trainer
hook, `upstream.trainer`). The JSONL is appended to, so a resumed run continues the same file; lines at or
after the restored step are dropped first, so a crash between checkpoint and log never duplicates steps.
"""

import json
import os
import statistics
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

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


def read_jsonl(path: Path) -> list[dict[str, Any]]:
  if not path.is_file():
    return []
  with open(path, encoding="utf-8") as f:
    return [json.loads(line) for line in f if line.strip()]


def _rewrite_jsonl(path: Path, rows: list[dict[str, Any]]) -> None:
  fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
  with os.fdopen(fd, "w", encoding="utf-8") as f:
    for row in rows:
      f.write(json.dumps(row) + "\n")
  os.replace(tmp, path)


def step_row(step: int, scalars: dict[str, float], *, num_devices: int) -> dict[str, Any]:
  """One JSONL row: step, loss, tokens/s (all devices), TFLOP/s per device, plus any moe/* scalars."""
  row: dict[str, Any] = {"step": step}
  for src, dst in _FIELDS.items():
    if src in scalars:
      row[dst] = scalars[src]
  if "perf/per_device_tokens_per_sec" in scalars:
    row["tokens_per_s"] = scalars["perf/per_device_tokens_per_sec"] * num_devices
  row.update({k: v for k, v in scalars.items() if k.startswith(_MOE_PREFIX)})
  return row


@dataclass
class RunRecorder:
  """Collects a run's per-step metrics and writes its outputs under `run_dir`."""

  run_dir: Path
  total_steps: int
  num_devices: int
  metrics_name: str = "metrics.jsonl"
  plot_name: str = "loss.png"
  progress: str = "auto"
  stream: IO[str] = field(default_factory=lambda: sys.stdout)
  writer: bool = True  # in a multi-process job only process 0 writes the files and prints
  start_step: int = 0
  rows: list[dict[str, Any]] = field(default_factory=list)
  _file: IO[str] | None = None
  _bar: Any = None

  @property
  def metrics_path(self) -> Path:
    return self.run_dir / self.metrics_name

  def start(self, config: Any, start_step: int) -> None:
    """Called by MaxText's MetricLogger once the checkpoint (if any) is restored."""
    del config
    self.start_step = start_step
    if not self.writer:
      return
    self.run_dir.mkdir(parents=True, exist_ok=True)
    kept = [r for r in read_jsonl(self.metrics_path) if r["step"] < start_step]
    _rewrite_jsonl(self.metrics_path, kept)
    self._file = open(self.metrics_path, "a", encoding="utf-8")  # noqa: SIM115 - closed in finish()
    self._start_progress()

  def step(self, step: int, scalars: dict[str, float]) -> None:
    """One logged training step's scalars (MaxText's and the moe/* ones)."""
    row = step_row(step, scalars, num_devices=self.num_devices)
    self.rows.append(row)
    if not self.writer:
      return
    assert self._file is not None
    self._file.write(json.dumps(row) + "\n")
    self._file.flush()
    self._show(row)

  def _mode(self) -> str:
    if self.progress != "auto":
      return self.progress
    return "rich" if self.stream.isatty() else "plain"

  def _start_progress(self) -> None:
    if self._mode() != "rich":
      return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    self._bar = Progress(
      TextColumn("[bold]train"),
      BarColumn(),
      MofNCompleteColumn(),
      TimeRemainingColumn(),
      TextColumn("{task.fields[info]}"),
    )
    self._bar.start()
    self._task = self._bar.add_task("train", total=self.total_steps, completed=self.start_step, info="compiling")

  def _show(self, row: dict[str, Any]) -> None:
    info = f"loss {row.get('loss', float('nan')):.4f}  {row.get('tokens_per_s', 0):,.0f} tok/s"
    mode = self._mode()
    if mode == "rich" and self._bar is not None:
      self._bar.update(self._task, completed=row["step"] + 1, info=info)
    elif mode == "plain":
      print(f"step {row['step'] + 1:>5}/{self.total_steps}  {info}", file=self.stream, flush=True)

  def finish(self) -> dict[str, Any]:
    """Closes the file and progress, writes the loss plot, prints and returns the summary (process 0; the
    others return their own rows' summary and print nothing)."""
    if not self.writer:
      return summarize(self.rows, self.rows)
    if self._bar is not None:
      self._bar.stop()
    if self._file is not None:
      self._file.close()
    all_rows = read_jsonl(self.metrics_path)
    summary = summarize(all_rows, self.rows)
    if self.plot_name and all_rows:
      summary["loss_plot"] = str(plot_loss(all_rows, self.run_dir / self.plot_name))
    summary["metrics"] = str(self.metrics_path)
    summary["checkpoints"] = str(self.run_dir / "checkpoints")
    print(format_summary(summary), file=self.stream, flush=True)
    return summary


def summarize(all_rows: list[dict[str, Any]], this_run: list[dict[str, Any]]) -> dict[str, Any]:
  """First/final loss over the whole run, and steady-state throughput of this invocation.

  The first step of an invocation includes compilation, so it is left out of the throughput median.
  """
  out: dict[str, Any] = {"steps_this_run": len(this_run)}
  if all_rows:
    out["first_step"], out["final_step"] = all_rows[0]["step"], all_rows[-1]["step"]
    out["first_loss"], out["final_loss"] = all_rows[0].get("loss"), all_rows[-1].get("loss")
  steady = this_run[1:] or this_run
  for key in ("tokens_per_s", "tflops_per_s_per_device"):
    vals = [r[key] for r in steady if key in r]
    if vals:
      out[key] = statistics.median(vals)
  return out


def format_summary(s: dict[str, Any]) -> str:
  lines = ["", "run summary"]
  if "final_loss" in s:
    drop = 100 * (1 - s["final_loss"] / s["first_loss"]) if s.get("first_loss") else 0.0
    lines.append(
      f"  loss        {s['first_loss']:.4f} (step {s['first_step'] + 1}) -> {s['final_loss']:.4f} "
      f"(step {s['final_step'] + 1}), {drop:.0f}% lower"
    )
  if "tokens_per_s" in s:
    lines.append(
      f"  throughput  {s['tokens_per_s']:,.0f} tokens/s, {s.get('tflops_per_s_per_device', 0):.3f} "
      "TFLOP/s per device (median, first step excluded)"
    )
  lines.append(f"  metrics     {s['metrics']}")
  if "loss_plot" in s:
    lines.append(f"  loss plot   {s['loss_plot']}")
  lines.append(f"  checkpoints {s['checkpoints']}")
  return "\n".join(lines)


def plot_loss(rows: list[dict[str, Any]], path: Path) -> Path:
  """Writes the loss curve as a PNG (matplotlib, no display needed)."""
  import matplotlib

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  steps = [r["step"] + 1 for r in rows if "loss" in r]
  losses = [r["loss"] for r in rows if "loss" in r]
  fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
  ax.plot(steps, losses, lw=1.5)
  ax.set_xlabel("step")
  ax.set_ylabel("training loss")
  ax.set_title(path.parent.name)
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path)
  plt.close(fig)
  return path
