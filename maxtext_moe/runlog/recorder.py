"""`RunRecorder`: a run's per-step outputs, written as MaxText's logger hands them over.

MaxText's MetricLogger hands each training step's scalars to `RunRecorder.step`, and each held-out
evaluation's to `RunRecorder.eval` (through the trainer hook, `upstream.maxtext.trainer`). An evaluation is a row
of its own, written after train step S's row: the loss of the model after step S on the eval split's
loss-bearing tokens (with SFT, the completions).

The JSONL is appended to, so a resumed run continues the same file; lines at or after the restored step
are dropped first, so a crash between checkpoint and log never duplicates steps. In a multi-process job
only process 0 writes (`writer`).
"""

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from maxtext_moe.runlog import files, plots
from maxtext_moe.runlog.progress import Progress
from maxtext_moe.runlog.summary import format_summary, summarize


@dataclass
class RunRecorder:
  """Collects a run's per-step metrics and writes its outputs under `run_dir`."""

  run_dir: Path
  total_steps: int
  num_devices: int
  metrics_name: str = files.METRICS
  plot_name: str = plots.LOSS_PNG
  progress: str = "auto"
  stream: IO[str] = field(default_factory=lambda: sys.stdout)
  writer: bool = True  # in a multi-process job only process 0 writes the files and prints
  start_step: int = 0
  load_every: int = 0  # moe_load_every: write the per-layer expert load every N steps (0: never)
  load_name: str = files.LOAD
  rows: list[dict[str, Any]] = field(default_factory=list)
  _file: IO[str] | None = None
  _progress: Progress | None = None

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
      if path.exists() or path == self.metrics_path:  # cut-short lines set aside in PATH.torn, with a warning
        kept = [r for r in files.set_aside_torn(path) if isinstance(r.get("step"), int) and r["step"] < start_step]
        files.rewrite_jsonl(path, kept)
    self._file = files.open_append(self.metrics_path)  # closed in finish()
    self._progress = Progress(self.stream, self.total_steps, self.progress)
    self._progress.start(start_step)

  def step(self, step: int, scalars: dict[str, float], notes: dict[str, Any] | None = None) -> dict[str, Any]:
    """One logged training step's scalars (MaxText's and the moe/* ones), with the recovery policy's
    `notes` (e.g. nonfinite_skipped); returns its row."""
    row = files.step_row(step, scalars, num_devices=self.num_devices) | (notes or {})
    self._append(row)
    return row

  def eval(self, step: int, scalars: dict[str, float]) -> None:
    """The held-out evaluation that followed training step `step`."""
    self._append(files.eval_row(step, scalars))

  def layers(self, step: int, load_LE: Any, bias_L: Any) -> None:
    """A step's [L, E] expert load and [L] mean |routing bias|: kept every `load_every` steps and at the
    last step, one JSON row each in moe_load.jsonl."""
    if not self.writer or not self.load_every or (step % self.load_every and step != self.total_steps - 1):
      return
    with files.open_append(self.run_dir / self.load_name) as f:
      f.write(json.dumps(files.load_row(step, load_LE, bias_L)) + "\n")

  def _append(self, row: dict[str, Any]) -> None:
    self.rows.append(row)
    if self.writer:
      assert self._file is not None
      self._file.write(json.dumps(row) + "\n")
      self._file.flush()
      if self._progress is not None:
        self._progress.show(row)

  def finish(self, *, stopped: bool = False, ended: str | None = None) -> dict[str, Any]:
    """Closes the file and progress, writes the plots, prints and returns the summary (process 0; the
    others return their own rows' summary and print nothing). `stopped`: the run was told to stop early
    (a signal, a non-finite loss), so ending before `total_steps` needs no explanation; `ended`: why the
    run ended before `total_steps` when its data ended it (the data ran out, a bad row)."""
    if not self.writer:
      return summarize(self.rows)
    if self._progress is not None:
      self._progress.stop()
    if self._file is not None:
      self._file.close()
    all_rows = files.read_jsonl(self.metrics_path)
    layers = files.read_layers(self.run_dir / self.load_name)
    summary = summarize(all_rows, this_run=self.rows, layers=layers)
    if self.plot_name and all_rows:
      summary["loss_plot"] = str(plots.plot_loss(all_rows, self.run_dir / self.plot_name))
    summary["moe_plots"] = [str(p) for p in plots.moe_plots(self.run_dir, layers)]
    last = max((r["step"] for r in all_rows if not files.is_eval(r)), default=-1)
    if (ended or (self.rows and not stopped)) and last + 1 < self.total_steps:
      summary["ended_early_at"], summary["total_steps"] = last + 1, self.total_steps
      summary |= {"ended_because": ended} if ended else {}
    summary["metrics"] = str(self.metrics_path)
    summary["checkpoints"] = str(self.run_dir / "checkpoints")
    print(format_summary(summary), file=self.stream, flush=True)
    return summary
