"""SFT data before training: every conversation checked, lengths and masking measured with MaxText's own
tokenizer and the rendering the trainer uses (`upstream.maxtext.sft_data`: the conversation whole through
its chat template), JSONL staged as Parquet; and `maxtext-moe data show`.

Checked before anything is compiled, one line each (exit 2): the tokenizer loads and has a chat template,
each row is a conversation (`sft.conversations`), the template renders it, the held-out split exists and is
not empty. Measured, with a note: conversations longer than max_target_length (truncated by MaxText's
pipeline, or refused with sft_overlength=refuse) and completion tokens equal to the pad id (MaxText masks
targets by id, so they would carry no loss).
"""

import sys
from typing import IO, Any

from maxtext_moe.data.rows import ConversationRow
from maxtext_moe.errors import UserError
from maxtext_moe.sft import conversations

CHECK_LIMIT = 20_000  # conversations per split tokenized for the length check (every row is validated)
LOSS_OPEN, LOSS_CLOSE = "[[", "]]"


def _files(pattern: str) -> list[str]:
  from maxtext_moe.config.paths import data_files  # pylint: disable=import-outside-toplevel

  return data_files(pattern)


def checked_tokenizer(cfg: Any) -> tuple[Any, int]:
  from maxtext_moe.upstream.maxtext import sft_data as sft  # pylint: disable=import-outside-toplevel
  from maxtext_moe.upstream.maxtext.config import hyperparameters  # pylint: disable=import-outside-toplevel

  if not cfg.tokenizer_path:
    raise UserError("use_sft needs tokenizer_path: the model's Hugging Face tokenizer directory")
  try:
    hf, pad_id = sft.tokenizer(hyperparameters(cfg))
  except (ValueError, OSError) as e:
    why = str(e).splitlines()[0][:200]
    raise UserError(
      f"tokenizer_path={cfg.tokenizer_path}: no Hugging Face tokenizer loads from there ({why}); "
      "point it at a tokenizer directory (tokenizer.json, tokenizer_config.json)"
    ) from None
  if not getattr(hf, "chat_template", None):
    raise UserError(
      f"the tokenizer at {cfg.tokenizer_path} has no chat template; set chat_template (a Jinja template) "
      "or use a tokenizer directory whose tokenizer_config.json has one"
    )
  return hf, pad_id


def row_check(hf: Any) -> ConversationRow:
  """The check every conversation passes, one line where it fails, the same at the start (`prepare`), in
  `data check` and as the run reads it (`launch.data_stop`): `conversations.check_messages`, then the chat
  template renders it as the trainer does (`sft_data.render`)."""
  from maxtext_moe.upstream.maxtext.sft_data import ChatTemplate  # pylint: disable=import-outside-toplevel

  return ConversationRow(conversations.COLUMN, conversations.check_messages, ChatTemplate(hf))


def _measure(split: conversations.Split, check: ConversationRow, pad_id: int, cfg: Any, note: Any) -> None:
  limit, long, longest, where_longest, pad_hits = int(cfg.max_target_length), 0, 0, "", 0
  for where, messages in split.conversations:
    chunks, is_prompt = check.rendered(messages, where)
    n = sum(len(c) for c in chunks)
    long += n > limit
    if n > longest:
      longest, where_longest = n, where
    pad_hits += sum(t == pad_id for c, p in zip(chunks, is_prompt, strict=True) if not p for t in c)
  checked = len(split.conversations)
  scope = f"{checked:,}" if checked == split.total else f"the first {checked:,} of {split.total:,}"
  scope += f" {split.name} conversations"
  if long and str(cfg.sft_overlength) == "refuse":
    raise UserError(
      f"{long:,} of {scope} are longer than max_target_length={limit} tokens (the longest, {longest}, is "
      f"{where_longest}); raise max_target_length or set sft_overlength=truncate"
    )
  if long:
    note(
      f"{long:,} of {scope} are longer than max_target_length={limit} tokens and are cut to it (the longest, "
      f"{longest}, is {where_longest}); sft_overlength=refuse stops instead"
    )
  if pad_hits:
    note(
      f"{pad_hits:,} completion tokens of {scope} are the pad id {pad_id} and carry no loss (MaxText masks "
      "targets by the pad id); give the tokenizer a pad token of its own"
    )


def read_splits(cfg: Any) -> tuple[conversations.Split, conversations.Split | None]:
  """The training split and (with eval_interval > 0) the held-out one, every row checked."""
  train = conversations.read_split("training", _files(cfg.grain_train_files), keep=CHECK_LIMIT)
  if not train.total:
    raise UserError(f"grain_train_files={cfg.grain_train_files} holds no conversations")
  if int(cfg.eval_interval) <= 0:
    return train, None
  if not cfg.grain_eval_files:
    raise UserError(f"eval_interval={cfg.eval_interval} needs grain_eval_files, the held-out conversations")
  files = _files(cfg.grain_eval_files)
  if not files:
    raise UserError(f"grain_eval_files={cfg.grain_eval_files!r} matches no file; check the path or pattern")
  held_out = conversations.read_split("held-out", files, keep=CHECK_LIMIT)
  if not held_out.total:
    raise UserError(f"grain_eval_files={cfg.grain_eval_files} holds no conversations; the held-out split is empty")
  return train, held_out


def applies(cfg: Any) -> bool:
  """Our checks cover MaxText's conversational layout read by grain (`messages`, text only)."""
  dataset = str(getattr(cfg.dataset_type, "value", cfg.dataset_type))
  return (
    bool(cfg.use_sft) and not cfg.use_multimodal and dataset == "grain" and list(cfg.train_data_columns) == ["messages"]
  )


def require(cfg: Any, command: str) -> None:
  """`command` works on SFT conversations only."""
  if not applies(cfg):
    raise UserError(f"{command} reads SFT conversations: use an *-sft recipe (use_sft=true, a messages column, grain)")


def _notes(lead: bool, err: IO[str] | None) -> Any:
  def note(line: str) -> None:
    if lead:
      print(f"maxtext-moe: note: {line}", file=err or sys.stderr, flush=True)

  return note


def prepare(cfg: Any, *, lead: bool = True, err: IO[str] | None = None) -> Any:
  """The config MaxText should train on: `cfg`, with staged Parquet in place of JSONL files. Raises
  UserError for bad data; prints notes (process 0) about truncation and masking."""
  if not applies(cfg):
    return cfg
  note = _notes(lead, err)
  hf, pad_id = checked_tokenizer(cfg)
  train, held_out = read_splits(cfg)
  for split in (train, held_out):
    if split is not None:
      _measure(split, row_check(hf), pad_id, cfg, note)
  update: dict[str, Any] = {"grain_file_type": "parquet"}
  if train.pattern:
    update["grain_train_files"] = train.pattern
  if held_out is not None and held_out.pattern:
    update["grain_eval_files"] = held_out.pattern
  return cfg.model_copy(update=update)


def _runs(hf: Any, ids: list[int], carries: list[bool]) -> str:
  """The tokens decoded in runs, the loss-carrying runs between LOSS_OPEN and LOSS_CLOSE."""
  text, start = [], 0
  for k in range(1, len(ids) + 1):
    if k == len(ids) or carries[k] != carries[start]:
      piece = hf.decode(ids[start:k], skip_special_tokens=False)
      text.append(f"{LOSS_OPEN}{piece}{LOSS_CLOSE}" if carries[start] else piece)
      start = k
  return "".join(text)


def show_row(hf: Any, batch: dict[str, Any], r: int) -> list[str]:
  """One packed row of a MaxText batch, a line per packed conversation. Input token k carries loss when
  the target at k-1 (its prediction) has a non-zero segment id: MaxText's loss mask after its shift."""
  inputs = [int(t) for t in batch["inputs"][r]]
  segments = [int(s) for s in batch.get("inputs_segmentation", [[1] * len(inputs)] * (r + 1))[r]]
  weights = [int(s) for s in batch["targets_segmentation"][r]]
  carries = [k > 0 and weights[k - 1] != 0 for k in range(len(inputs))]
  ids = sorted({s for s in segments if s})
  used = sum(1 for s in segments if s)
  head = f"row {r}: {len(ids)} conversation(s), {used} of {len(inputs)} positions, {sum(carries)} tokens carry loss"
  lines = [head]
  for seg in ids:
    where = [k for k, s in enumerate(segments) if s == seg]
    lines.append("  " + _runs(hf, [inputs[k] for k in where], [carries[k] for k in where]))
  return lines


def show(cfg: Any, *, rows: int, out: IO[str]) -> None:
  """The first `rows` rows of the first training batch, as MaxText's SFT pipeline builds them."""
  from maxtext_moe.upstream.maxtext import sft_data as sft  # pylint: disable=import-outside-toplevel
  from maxtext_moe.upstream.maxtext.config import hyperparameters  # pylint: disable=import-outside-toplevel

  require(cfg, "data show")
  hf, pad_id = checked_tokenizer(cfg)
  train, _ = read_splits(cfg)
  _measure(train, row_check(hf), pad_id, cfg, _notes(True, None))
  batch = next(sft.batches(hyperparameters(cfg), [{"messages": m} for _, m in train.conversations], ["messages"]))
  print(
    f"{cfg.grain_train_files}: {train.total:,} conversations; the first rows of the first batch as the model "
    f"sees them (max_target_length={cfg.max_target_length}, packing={cfg.packing}); text between "
    f"{LOSS_OPEN} and {LOSS_CLOSE} carries loss, the rest is context only",
    file=out,
  )
  for r in range(min(rows, len(batch["inputs"]))):
    print("\n".join(show_row(hf, batch, r)), file=out)
