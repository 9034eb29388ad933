"""Pretraining on your own text: JSONL or Parquet files with a text column, a Hugging Face tokenizer
directory, and the model's vocabulary sized from it. Checked before anything is compiled, one line each.

The keys (MaxText's grain reader, docs/recipes.md "Your own corpus"):
    dataset_type=grain grain_train_files='/data/corpus/*.jsonl' train_data_columns=[text]
    tokenizer_type=huggingface tokenizer_path=/data/tokenizer vocab_from_tokenizer=true
- JSONL (one JSON object per line with the text column) is written once per node as Parquet under the
  cache, streamed (`data.staging.stream`), and the run reads that (MaxText's grain reader takes Parquet,
  not JSON); Parquet is read as it is, its column's type checked here.
- Every row's text column must be a string (`row_check`): a JSONL row that is not says its file and line
  as it is staged; a Parquet row says its file and row as the run reads it (`data.rows`), and the run
  stops there after saving its last completed step.
- `vocab_from_tokenizer=true` (pretraining from scratch) sizes the embedding and the output layer from the
  tokenizer: its length rounded up to a multiple of 128. Without it, a tokenizer with more tokens than the
  model's vocab_size is refused (its ids past the table would index out of it, silently on GPU).
Pre-tokenized data (a column of token-id lists, `tokenize_train_data=false`, or Megatron's mmap files)
goes to MaxText as it is; the vocabulary check applies the same.
"""

from pathlib import Path
from typing import IO, Any

import pyarrow as pa
import pyarrow.parquet as pq

from maxtext_moe.data import staging
from maxtext_moe.data.rows import TextRow
from maxtext_moe.data.text import tokenizer_size
from maxtext_moe.errors import UserError


def _dataset(cfg: Any) -> str:
  return str(getattr(cfg.dataset_type, "value", cfg.dataset_type))  # MaxText's enum, or its string


def applies(cfg: Any) -> bool:
  """Pretraining text read by grain: not SFT, one text column, tokenized by the pipeline."""
  return (
    _dataset(cfg) == "grain"
    and not cfg.use_sft
    and not getattr(cfg, "use_dpo", False)
    and len(list(cfg.train_data_columns)) == 1
    and bool(cfg.tokenize_train_data)
    and str(cfg.grain_file_type) in ("parquet", "arrayrecord", "tfrecord")
  )


def check_vocab(cfg: Any) -> None:
  """A Hugging Face tokenizer must fit the model's embedding table."""
  kind = str(getattr(cfg.tokenizer_type, "value", cfg.tokenizer_type))
  if kind != "huggingface" or _dataset(cfg) in ("synthetic",):
    return
  size = tokenizer_size(str(cfg.tokenizer_path))
  if size > int(cfg.vocab_size):
    fix = "vocab_from_tokenizer=true (a model trained from scratch)" if not cfg.finetune else "the model's tokenizer"
    raise UserError(
      f"the tokenizer at {cfg.tokenizer_path} has {size:,} tokens but the model's vocab_size is "
      f"{int(cfg.vocab_size):,}: ids past it would index outside the embedding; use {fix}"
    )


def row_check(cfg: Any) -> TextRow:
  """The check every pretraining row passes, in staging, in `data check` and as the run reads it."""
  return TextRow(list(cfg.train_data_columns)[0])


def _check_parquet(path: Path, column: str) -> None:
  try:
    schema = pq.read_schema(path)
  except (pa.ArrowException, OSError) as e:
    raise UserError(f"{path}: not a readable Parquet file ({str(e).splitlines()[0]})") from None
  if column not in schema.names:
    raise UserError(
      f"{path} has no '{column}' column (columns: {', '.join(schema.names)}); set train_data_columns=[NAME]"
    )
  kind = schema.field(column).type
  if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
    raise UserError(f"{path}: column '{column}' holds {kind}, not text; for token ids set tokenize_train_data=false")


def local_files(pattern: str, what: str, column: str, *, text: bool = True) -> list[Path] | None:
  """The files of `pattern`, sorted, all JSONL or all Parquet (with `text`, a Parquet file's column checked
  to hold text), or None where some are remote (MaxText reads them; nothing to check here)."""
  from maxtext_moe.config.paths import data_files  # pylint: disable=import-outside-toplevel

  files = sorted(data_files(pattern))
  if not files:
    raise UserError(f"{what}={pattern} matches no file")
  if any("://" in f for f in files):
    return None
  paths = [Path(f) for f in files]
  if len({p.suffix in staging.JSON_SUFFIXES for p in paths}) > 1:
    raise UserError(f"{what} mixes JSONL and Parquet ({', '.join(files[:4])}); use one format")
  for path in paths:
    if text and path.suffix == ".parquet":
      _check_parquet(path, column)
  return paths


def _staged(pattern: str, column: str, what: str, check: TextRow) -> str | None:
  """The staged Parquet pattern of JSONL files (every row checked on the way), None for Parquet files."""
  paths = local_files(pattern, what, column)
  if not paths or paths[0].suffix not in staging.JSON_SUFFIXES:
    return None
  return staging.stream(paths, kind="text-staged", column=column, check=check)


def prepare(cfg: Any, *, lead: bool = True, err: IO[str] | None = None) -> Any:
  """The config MaxText should pretrain on: `cfg` with staged Parquet in place of JSONL files. Raises
  UserError for bad data or a tokenizer larger than the vocabulary."""
  del lead, err
  if not applies(cfg) and not (_dataset(cfg) == "grain" and not cfg.use_sft):
    return cfg
  check_vocab(cfg)
  if not applies(cfg):
    return cfg
  column = list(cfg.train_data_columns)[0]
  update: dict[str, Any] = {}
  train = _staged(str(cfg.grain_train_files), column, "grain_train_files", row_check(cfg))
  if train:
    update |= {"grain_train_files": train, "grain_file_type": "parquet"}
  if cfg.grain_eval_files and int(cfg.eval_interval) > 0:
    eval_column = list(getattr(cfg, "eval_data_columns", None) or [column])[0]
    held_out = _staged(str(cfg.grain_eval_files), eval_column, "grain_eval_files", TextRow(eval_column))
    if held_out:
      update |= {"grain_eval_files": held_out, "grain_file_type": "parquet"}
  return cfg.model_copy(update=update) if update else cfg


def first_texts(paths: list[Path], column: str, keep: int, check: TextRow) -> list[str]:
  """The first `keep` texts of `paths`, each row checked; nothing else is read."""
  texts: list[str] = []
  for path in paths:
    for where, row in staging.rows(path, column, "text data", f"a '{column}' string"):
      check(row, where)
      texts.append(row[column])
      if len(texts) >= keep:
        return texts
  return texts


def show(cfg: Any, *, rows: int, out: IO[str]) -> None:
  """The first `rows` rows of the first training batch, as MaxText's grain pretraining pipeline builds
  them (tokenized, chunked, packed): each row's documents, decoded."""
  from maxtext_moe.upstream.maxtext import sft_data as grain_paths  # pylint: disable=import-outside-toplevel
  from maxtext_moe.upstream.maxtext.config import hyperparameters  # pylint: disable=import-outside-toplevel

  if not applies(cfg):
    raise UserError(
      "data show reads text data: an *-sft recipe, or dataset_type=grain with one text column "
      "(train_data_columns=[text]) and JSONL or Parquet files"
    )
  check_vocab(cfg)
  column = list(cfg.train_data_columns)[0]
  paths = local_files(str(cfg.grain_train_files), "grain_train_files", column)
  if paths is None:
    raise UserError(f"grain_train_files={cfg.grain_train_files}: data show reads local files")
  hp = hyperparameters(cfg.model_copy(update={"grain_file_type": "parquet"}))  # rows as dicts, not records
  need = max(int(hp.global_batch_size_to_load), rows) * 4
  texts = first_texts(paths, column, need, row_check(cfg))
  batch = next(grain_paths.pretrain_batches(hp, [{column: t} for t in texts], column))
  decode = grain_paths.decoder(hp)
  print(
    f"{cfg.grain_train_files}: the first rows of the first batch as the model sees them, from the first "
    f"{len(texts):,} documents (max_target_length={cfg.max_target_length}, packed; each document on its own "
    "line, cut at 200 characters; `data check` reads every row)",
    file=out,
  )
  for r in range(min(rows, len(batch["inputs"]))):
    inputs = [int(t) for t in batch["inputs"][r]]
    segments = [int(s) for s in batch.get("inputs_segmentation", [[1] * len(inputs)] * (r + 1))[r]]
    docs = sorted({s for s in segments if s})
    used = sum(1 for s in segments if s)
    print(f"row {r}: {len(docs)} document(s), {used} of {len(inputs)} positions", file=out)
    for seg in docs:
      ids = [inputs[k] for k, s in enumerate(segments) if s == seg]
      text = decode(ids).replace("\n", "\\n")
      print(f"  [{len(ids)} tokens] {text[:200]}{'...' if len(text) > 200 else ''}", file=out)
