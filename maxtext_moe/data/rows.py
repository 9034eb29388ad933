"""A training row the run cannot use, found as grain reads it, and named by its file and row.

Every row of a Parquet file goes through `Checked` (a grain map) on its way into MaxText's pipeline, which
calls the run's row check: `TextRow` for pretraining text, `ConversationRow` for SFT conversations (the
checks of `sft.conversations` and the chat template, handed in by the launcher). A row the check refuses
raises `BadRow` there, where MaxText's pipeline would fail somewhere inside its tokenizer and its data
loader would end the run as if the data had run out.

Why the map is hand-written and knows its file but not its row: grain's `map_with_index` would count rows,
but it keeps the count in the iterator's state, which MaxText saves in every checkpoint, so a run saved
before would no longer resume. The row is found when a file has a bad one: `first_bad` reads that file again
(a staged Parquet part: its JSONL file) up to the first row the same check refuses.
"""

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from maxtext_moe.data import staging
from maxtext_moe.errors import UserError

RowCheck = Callable[[dict, str], None]  # (row, where) -> None, or UserError naming `where`


class BadRow(Exception):
  """A row of `path` that `why` says the run cannot use (picklable: grain raises a worker process's
  exception again in the trainer's)."""

  def __init__(self, path: str, why: str):
    super().__init__(path, why)
    self.path, self.why = path, why

  def __str__(self) -> str:
    return self.why


@dataclass(frozen=True)
class Checked:
  """A grain map over the rows of the file at `path`: each row unchanged, or BadRow."""

  path: str
  check: RowCheck

  def __call__(self, row: dict) -> dict:
    try:
      self.check(row, self.path)
    except UserError as e:
      raise BadRow(self.path, str(e)) from None
    return row


@dataclass(frozen=True)
class TextRow:
  """A pretraining row: its `column` holds a string."""

  column: str

  def __call__(self, row: dict, where: str) -> None:
    value = row.get(self.column)
    if not isinstance(value, str):
      kind = "null" if value is None else type(value).__name__
      raise UserError(f"{where}: '{self.column}' is {kind}, not a string; fix or remove the row")


@dataclass(frozen=True)
class ConversationRow:
  """An SFT row: its `column` passes `check(messages, where)` (`sft.conversations.check_messages`) and, when
  given, the chat template (`template(messages)`, which raises whatever its Jinja raises). One object,
  `sft.prepare.row_check`, checks a conversation at the start, in `data check` and as the run reads it."""

  column: str
  check: Callable[[Any, str], None]
  template: Callable[[list[dict]], Any] | None = None

  def __call__(self, row: dict, where: str) -> None:
    self.rendered(row.get(self.column), where)

  def rendered(self, messages: Any, where: str) -> Any:
    """What `template` makes of `messages` (None without one), once they pass `check`; else UserError, the
    one line such a conversation gets wherever it is found."""
    if isinstance(messages, np.ndarray):  # grain's Parquet reader gives a list column as an array
      messages = list(messages)
    self.check(messages, where)
    if self.template is None:
      return None
    try:
      return self.template(messages)
    except Exception as e:  # pylint: disable=broad-except  # a template raises whatever its Jinja raises
      why = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
      raise UserError(
        f"{where}: the chat template does not render this conversation ({why}); fix or remove the row, or fix "
        "the template"
      ) from None


def first_bad(path: str, column: str, check: RowCheck) -> str | None:
  """The one line of the first row of `path` that `check` refuses (a staged part: of the JSONL file it was
  written from, by line), or None if none does now."""
  source = staging.source_of(Path(path)) or Path(path)
  try:
    for where, row in staging.rows(source, column, "training data", f"a '{column}' field"):
      check(row, where)
  except UserError as e:
    return str(e)
  except OSError:
    return None
  return None
