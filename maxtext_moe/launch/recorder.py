"""Per-step run outputs: a metrics JSONL file, live progress, a loss-curve PNG and a summary.

MaxText's MetricLogger hands each training step's scalars to `RunRecorder.step`, and each held-out
evaluation's to `RunRecorder.eval` (through the trainer hook, `upstream.trainer`). An evaluation is a row
of its own, `{"step": S, "eval_loss": ..., "eval_tokens": ...}`, written after train step S's row: the
loss of the model after step S on the eval split's loss-bearing tokens (with SFT, the completions).

The JSONL is appended to, so a resumed run continues the same file; lines at or
after the restored step are dropped first, so a crash between checkpoint and log never duplicates steps.
"""

import json
import math
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
  umask = os.umask(0)
  os.umask(umask)
  os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it 0600; the run's other files follow the umask
  os.replace(tmp, path)


class NonFiniteLoss(Exception):
  """A training step's loss was NaN or Inf and the run must stop (on_nonfinite_loss)."""

  def __init__(self, step: int, kind: str, skipped: int):
    super().__init__(f"loss {kind} at step {step + 1}")
    self.step, self.kind, self.skipped = step, kind, skipped


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
  skip_nonfinite: bool = False  # on_nonfinite_loss=skip (the optimizer skips such steps' updates)
  max_nonfinite_skips: int = 3
  start_step: int = 0
  nonfinite_in_a_row: int = 0
  nonfinite_skipped: int = 0
  last_eval: float | None = None
  load_every: int = 0  # moe_load_every: write the per-layer expert load every N steps (0: never)
  load_name: str = "moe_load.jsonl"
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
    for path in (self.metrics_path, self.run_dir / self.load_name):
      if path.exists() or path == self.metrics_path:
        _rewrite_jsonl(path, [r for r in read_jsonl(path) if r["step"] < start_step])
    self._file = open(self.metrics_path, "a", encoding="utf-8")  # noqa: SIM115 - closed in finish()
    self._start_progress()

  def step(self, step: int, scalars: dict[str, float]) -> None:
    """One logged training step's scalars (MaxText's and the moe/* ones)."""
    row = step_row(step, scalars, num_devices=self.num_devices)
    bad = "loss_nonfinite" in row
    self.nonfinite_in_a_row = self.nonfinite_in_a_row + 1 if bad else 0
    if bad and self.skip_nonfinite:
      row["nonfinite_skipped"] = True
      self.nonfinite_skipped += 1
    self._append(row)
    if bad and (not self.skip_nonfinite or self.nonfinite_in_a_row >= self.max_nonfinite_skips):
      raise NonFiniteLoss(step, row["loss_nonfinite"], self.nonfinite_skipped)

  def eval(self, step: int, scalars: dict[str, float]) -> None:
    """The held-out evaluation that followed training step `step`."""
    row = eval_row(step, scalars)
    self.last_eval = row["eval_loss"]
    self._append(row)

  def layers(self, step: int, load_LE: Any, bias_L: Any) -> None:
    """A step's [L, E] expert load and [L] mean |routing bias|: kept every `load_every` steps and at the
    last step, one JSON row each in moe_load.jsonl."""
    if not self.writer or not self.load_every or (step % self.load_every and step != self.total_steps - 1):
      return
    row = {"step": step, "load": [[int(v) for v in layer] for layer in load_LE]}
    row["bias_abs_mean"] = [float(v) for v in bias_L]
    with open(self.run_dir / self.load_name, "a", encoding="utf-8") as f:
      f.write(json.dumps(row) + "\n")

  def _append(self, row: dict[str, Any]) -> None:
    self.rows.append(row)
    if self.writer:
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
    mode = self._mode()
    if is_eval(row):
      loss = f"{row['eval_loss']:.4f}" if row["eval_loss"] is not None else "non-finite"
      line = f"eval after step {row['step'] + 1}: eval_loss {loss} over {row['eval_tokens']:,} tokens"
      if mode == "rich" and self._bar is not None:
        self._bar.console.print(line)
      elif mode == "plain":
        print(f"{'':>11}{line}", file=self.stream, flush=True)
      return
    loss = f"{row['loss']:.4f}" if row.get("loss") is not None else row.get("loss_nonfinite", "-")
    skipped = " (update skipped)" if row.get("nonfinite_skipped") else ""
    held_out = f"  eval_loss {self.last_eval:.4f}" if self.last_eval is not None else ""
    info = f"loss {loss}{skipped}{held_out}  {row.get('tokens_per_s', 0):,.0f} tok/s"
    if mode == "rich" and self._bar is not None:
      self._bar.update(self._task, completed=row["step"] + 1, info=info)
    elif mode == "plain":
      print(f"step {row['step'] + 1:>5}/{self.total_steps}  {info}", file=self.stream, flush=True)

  def finish(self, *, stopped: bool = False) -> dict[str, Any]:
    """Closes the file and progress, writes the loss plot, prints and returns the summary (process 0; the
    others return their own rows' summary and print nothing). `stopped`: the run was told to stop early
    (a signal, a non-finite loss), so ending before `total_steps` needs no explanation."""
    if not self.writer:
      return summarize(self.rows, self.rows)
    if self._bar is not None:
      self._bar.stop()
    if self._file is not None:
      self._file.close()
    from maxtext_moe.launch import report  # pylint: disable=import-outside-toplevel  # report imports us

    all_rows = read_jsonl(self.metrics_path)
    summary = summarize(all_rows, self.rows)
    if self.plot_name and all_rows:
      summary["loss_plot"] = str(report.plot_loss(all_rows, self.run_dir / self.plot_name))
    summary["moe_plots"] = [
      str(p) for p in report.moe_plots(self.run_dir, report.read_layers(self.run_dir / self.load_name))
    ]
    last = max((r["step"] for r in all_rows if not is_eval(r)), default=-1)
    if self.rows and not stopped and last + 1 < self.total_steps:
      summary["ended_early_at"], summary["total_steps"] = last + 1, self.total_steps
    summary["metrics"] = str(self.metrics_path)
    summary["checkpoints"] = str(self.run_dir / "checkpoints")
    print(format_summary(summary), file=self.stream, flush=True)
    return summary


def summarize(all_rows: list[dict[str, Any]], this_run: list[dict[str, Any]]) -> dict[str, Any]:
  """First/final loss over the whole run, and steady-state throughput of this invocation.

  The first step of an invocation includes compilation, so it is left out of the throughput median.
  """
  this_run = [r for r in this_run if not is_eval(r)]
  out: dict[str, Any] = {"steps_this_run": len(this_run)}
  finite = [r for r in all_rows if r.get("loss") is not None]
  if finite:
    out["first_step"], out["final_step"] = finite[0]["step"], finite[-1]["step"]
    out["first_loss"], out["final_loss"] = finite[0]["loss"], finite[-1]["loss"]
  evals = [r for r in all_rows if is_eval(r) and r["eval_loss"] is not None]
  if evals:
    out["first_eval_step"], out["final_eval_step"] = evals[0]["step"], evals[-1]["step"]
    out["first_eval_loss"], out["final_eval_loss"] = evals[0]["eval_loss"], evals[-1]["eval_loss"]
  nonfinite = sum("loss_nonfinite" in r for r in all_rows)
  if nonfinite:
    out["nonfinite_steps"] = nonfinite
  steady = this_run[1:] or this_run
  for key in ("tokens_per_s", "tflops_per_s_per_device"):
    vals = [r[key] for r in steady if key in r]
    if vals:
      out[key] = statistics.median(vals)
  return out


def _drop(first: float, final: float) -> str:
  drop = 100 * (1 - final / first) if first else 0.0
  return f"{drop:.0f}% lower" if drop >= 0 else f"{-drop:.0f}% higher"


def format_summary(s: dict[str, Any]) -> str:
  lines = ["", "run summary"]
  if "final_loss" in s:
    lines.append(
      f"  loss        {s['first_loss']:.4f} (step {s['first_step'] + 1}) -> {s['final_loss']:.4f} "
      f"(step {s['final_step'] + 1}), {_drop(s['first_loss'], s['final_loss'])}"
    )
  if "final_eval_loss" in s:
    lines.append(
      f"  eval loss   {s['first_eval_loss']:.4f} (after step {s['first_eval_step'] + 1}) -> "
      f"{s['final_eval_loss']:.4f} (after step {s['final_eval_step'] + 1}), "
      f"{_drop(s['first_eval_loss'], s['final_eval_loss'])}"
    )
  if "tokens_per_s" in s:
    lines.append(
      f"  throughput  {s['tokens_per_s']:,.0f} tokens/s, {s.get('tflops_per_s_per_device', 0):.3f} "
      "TFLOP/s per device (median, first step excluded)"
    )
  if s.get("nonfinite_steps"):
    lines.append(f"  non-finite  {s['nonfinite_steps']} step(s) with a NaN/Inf loss (loss_nonfinite in the metrics)")
  if s.get("ended_early_at"):
    lines.append(
      f"  ended early after step {s['ended_early_at']} of {s['total_steps']}: MaxText stopped its loop (the "
      "training data ran out, or target_eval_loss was reached); raise num_epoch or lower steps"
    )
  lines.append(f"  metrics     {s['metrics']}")
  if "loss_plot" in s:
    lines.append(f"  loss plot   {s['loss_plot']}")
  if s.get("moe_plots"):
    lines.append(f"  moe plots   {', '.join(s['moe_plots'])}")
  lines.append(f"  checkpoints {s['checkpoints']}")
  return "\n".join(lines)
