"""A run its data ends: the row check it reads its data with (`upstream.maxtext.data_end`), and how that
end is said: in the summary (why, after which step, the checkpoint kept) and, for a row the run cannot use
or a pipeline that failed, as the run's last line with its exit code."""

from pathlib import Path
from typing import Any

from maxtext_moe.errors import EXIT_DATAERR, RunEnded
from maxtext_moe.upstream.maxtext.data_end import BAD_ROW, FAILED, RAN_OUT, DataEnd


def for_run(cfg: Any) -> DataEnd:
  """The run's row check: SFT conversations' (`sft.prepare.row_check`: the checks of `sft.conversations`
  and the chat template, as at the start and in `data check`) or pretraining text's
  (`pretrain.text.row_check`); none for other data (synthetic, pre-tokenized, TFDS)."""
  from maxtext_moe.pretrain import text  # pylint: disable=import-outside-toplevel
  from maxtext_moe.sft import prepare as sft  # pylint: disable=import-outside-toplevel

  if sft.applies(cfg):
    hf, _ = sft.checked_tokenizer(cfg)
    check = sft.row_check(hf)
    return DataEnd(check, check.column)
  if text.applies(cfg):
    check = text.row_check(cfg)
    return DataEnd(check, check.column)
  return DataEnd()


def _kept(end: DataEnd, checkpoint_dir: Path) -> str:
  if end.saved is None:
    return "no checkpoint was saved"
  return f"checkpoint {end.saved} saved in {checkpoint_dir}"


def summary_words(end: DataEnd, cfg: Any, checkpoint_dir: Path) -> str | None:
  """Why the run ended, for its summary's `ended early after step N of M:` line (None: not its data)."""
  if end.kind == RAN_OUT:
    return (
      f"the training data ran out (num_epoch={cfg.num_epoch}); {_kept(end, checkpoint_dir)}; raise num_epoch or "
      "lower steps (maxtext-moe data check prints the steps an epoch takes)"
    )
  if end.kind in (BAD_ROW, FAILED):
    return f"{end.line}; {_kept(end, checkpoint_dir)}"
  return None


def last_line(end: DataEnd, steps: int, checkpoint_dir: Path, command: str) -> RunEnded | None:
  """The run's last line and exit code for a row it cannot use (EXIT_DATAERR) or a pipeline that failed
  (1); None for data that ran out (the summary says it; exit 0)."""
  if end.kind not in (BAD_ROW, FAILED):
    return None
  fix = "once the row is fixed" if end.kind == BAD_ROW else "once that is fixed"
  return RunEnded(
    f"{end.line}; the run stopped after step {end.step} of {steps}, {_kept(end, checkpoint_dir)}; {fix}, "
    f"resume with: {command}",
    EXIT_DATAERR if end.kind == BAD_ROW else 1,
  )
