"""Live progress of a run: one plain line per step (and per evaluation), or a rich bar on a terminal."""

from dataclasses import dataclass, field
from typing import IO, Any

from maxtext_moe.runlog.files import is_eval


@dataclass
class Progress:
  """Shows rows as they are written. `mode`: auto (rich on a terminal, plain otherwise), rich, plain, silent."""

  stream: IO[str]
  total_steps: int
  mode: str = "auto"
  last_eval: float | None = None
  _bar: Any = field(default=None, repr=False)
  _task: Any = field(default=None, repr=False)

  def _mode(self) -> str:
    if self.mode != "auto":
      return self.mode
    return "rich" if self.stream.isatty() else "plain"

  def start(self, start_step: int) -> None:
    if self._mode() != "rich":
      return
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
    from rich.progress import Progress as RichProgress

    self._bar = RichProgress(
      TextColumn("[bold]train"),
      BarColumn(),
      MofNCompleteColumn(),
      TimeRemainingColumn(),
      TextColumn("{task.fields[info]}"),
    )
    self._bar.start()
    self._task = self._bar.add_task("train", total=self.total_steps, completed=start_step, info="compiling")

  def show(self, row: dict[str, Any]) -> None:
    if is_eval(row):
      self.last_eval = row["eval_loss"]
      loss = f"{row['eval_loss']:.4f}" if row["eval_loss"] is not None else "non-finite"
      self._line(f"eval after step {row['step'] + 1}: eval_loss {loss} over {row['eval_tokens']:,} tokens")
      return
    loss = f"{row['loss']:.4f}" if row.get("loss") is not None else row.get("loss_nonfinite", "-")
    skipped = " (update skipped)" if row.get("nonfinite_skipped") else ""
    held_out = f"  eval_loss {self.last_eval:.4f}" if self.last_eval is not None else ""
    info = f"loss {loss}{skipped}{held_out}  {row.get('tokens_per_s', 0):,.0f} tok/s"
    if self._mode() == "rich" and self._bar is not None:
      self._bar.update(self._task, completed=row["step"] + 1, info=info)
    elif self._mode() == "plain":
      print(f"step {row['step'] + 1:>5}/{self.total_steps}  {info}", file=self.stream, flush=True)

  def _line(self, line: str) -> None:
    if self._mode() == "rich" and self._bar is not None:
      self._bar.console.print(line)
    elif self._mode() == "plain":
      print(f"{'':>11}{line}", file=self.stream, flush=True)

  def stop(self) -> None:
    if self._bar is not None:
      self._bar.stop()
