"""SFT conversations read as the trainer reads them, wherever they are read.

- One rendering: a conversation is judged by one check (`sft.prepare.row_check`: the whole conversation
  through the chat template, as training renders it) in `data check`, at the start and as the run reads
  it, with the same one line; `data check` counts the tokens training sees, a turn's fields other than its
  role and content rendered by none of them (JSONL staging drops them, so Parquet rows drop them too).
- JSONL staged once per node and streamed: row groups of at most ROWS_PER_GROUP, the rows MaxText's reader
  yields those of the whole-file Parquet staged before, and a file many bounds long staged without
  holding more than a bound's worth of rows.
"""

import io
import json
import tracemalloc

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from maxtext.input_pipeline import grain_data_processing
from transformers import AutoTokenizer

from conftest import REPO
from maxtext_moe.config import recipes
from maxtext_moe.data import staging
from maxtext_moe.data.rows import BadRow
from maxtext_moe.errors import UserError
from maxtext_moe.launch import data_stop
from maxtext_moe.sft import conversations
from maxtext_moe.sft import prepare as sft
from maxtext_moe.tools import data_check
from maxtext_moe.upstream.maxtext import data_end, sft_data
from maxtext_moe.upstream.maxtext.config import hyperparameters
from maxtext_moe.upstream.patches import installed

FIXTURES = REPO / "tests" / "fixtures" / "chat_tokenizers"
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")
TURN = pa.struct([("role", pa.string()), ("content", pa.string())])


def _turns(*pairs: str) -> list[dict]:
  return [{"role": ("user", "assistant")[i % 2], "content": c} for i, c in enumerate(pairs)]


def _plain(row: dict) -> list[dict]:
  """A row's conversation as its turns' roles and contents."""
  return [{"role": t["role"], "content": t["content"]} for t in row["messages"]]


def _jsonl(path, rows: list[dict]) -> None:
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _cfg(resolution, family: str, data):
  keys = ["finetune=false", f"tokenizer_path={FIXTURES / family}", f"grain_train_files={data}"]
  keys += [f"grain_eval_files={data}", "max_target_length=512"]
  return resolution.resolve(recipes.recipe_path("cpu/deepseek3-tiny-sft"), keys)


def _dataset(pattern: str):
  """MaxText's grain reader of the training files `pattern`, one process, in order (no shuffle)."""
  return grain_data_processing.get_datasets(
    pattern, "parquet", shuffle=False, shuffle_seed=0, shuffle_buffer_size=0, num_epoch=1, dataloading_host_index=0,
    dataloading_host_count=1, grain_worker_count=0, grain_num_threads=1, grain_prefetch_buffer_size=1,
    grain_data_source_max_workers=1,
  )  # fmt: skip


def _read(pattern: str) -> list[dict]:
  """The rows MaxText's grain reader yields for the training files `pattern`, as Python values."""
  return [{"messages": [dict(t) for t in row["messages"]]} for row in _dataset(pattern)]


def _mid_run(cfg, pattern: str) -> str | None:
  """What the run's row check says as grain reads the files `pattern`: the bad row's line, or None."""
  end = data_stop.for_run(cfg)
  with installed(data_end.patches(end)):
    dataset = _dataset(pattern)
  try:
    list(dataset)
  except BadRow as bad:
    return data_end.DataEndPatches(end).where(bad)
  return None


def _judged(call) -> str | None:
  try:
    call()
  except UserError as e:
    return str(e)
  return None


def test_a_conversation_the_template_refuses_is_one_line_in_data_check_at_the_start_and_mid_run(
  resolution, tmp_path, monkeypatch
):
  """Mixtral's template refuses turns that do not alternate: `data check`, the launcher's checks at the
  start and the run as it reads the staged row each stop on line 2 with the same line, its fix included
  (the start added its own fix; the others none)."""
  monkeypatch.setenv("MAXTEXT_MOE_CACHE", str(tmp_path / "cache"))
  data = tmp_path / "train.jsonl"
  twice = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, {"role": "assistant", "content": "c"}]
  _jsonl(data, [{"messages": _turns("1 + 1?", "2")}, {"messages": twice}])
  cfg = _cfg(resolution, "mixtral", data)
  staged = conversations.read_split("training", [str(data)], keep=0).pattern
  line = (
    f"{data} line 2: the chat template does not render this conversation (After the optional system message, "
    "conversation roles must alternate user/assistant/user/assistant/...); fix or remove the row, or fix the template"
  )
  check = _judged(lambda: data_check.check(cfg, devices=1, epochs=1, out=io.StringIO(), err=io.StringIO()))
  start = _judged(lambda: sft.prepare(cfg, lead=False))
  assert [check, start, _mid_run(cfg, staged)] == [line, line, line]


def _with_other_fields() -> list[dict]:
  """Multi-turn conversations whose turns carry fields Qwen3's template would render (a reasoning) or
  refuses (a tool call that is not an object): neither is the conversation's role and content."""
  first = _turns("What is 2 + 2?", "It is 4.", "And 3 + 3?", "6.")
  first[1]["reasoning_content"] = "two and two make four"
  second = _turns("Add 2 and 2.", "4")
  second[1]["tool_calls"] = ["add(2, 2)"]
  return [{"messages": first}, {"messages": second}, {"messages": _turns("Hi.", "Hello!", "Bye.", "Bye!")}]


def _parquet(path, rows: list[dict]) -> None:
  """`rows` as Parquet whose turns hold every field any turn has (null where a turn has none)."""
  turn = pa.struct([*TURN, ("reasoning_content", pa.string()), ("tool_calls", pa.list_(pa.string()))])
  pq.write_table(pa.table({"messages": pa.array([r["messages"] for r in rows], type=pa.list_(turn))}), path)


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_data_check_counts_the_tokens_training_sees(suffix, resolution, tmp_path, monkeypatch):
  """`data check`'s tokens are the sum of `len(apply_chat_template(...))` over the conversations' roles and
  contents, the tokens MaxText's SFT pipeline packs from the rows as the run reads them (staged JSONL, or
  the Parquet file: apply_chat_template's ids, token for token), and none is a bad row at the start or
  mid-run. Before, `data check` rendered a row's other fields (the reasoning counted, the tool call a
  traceback), and so did the trainer a Parquet row's, where the start did not."""
  monkeypatch.setenv("MAXTEXT_MOE_CACHE", str(tmp_path / "cache"))
  data = tmp_path / f"train{suffix}"
  rows = _with_other_fields()
  (_jsonl if suffix == ".jsonl" else _parquet)(data, rows)
  cfg = _cfg(resolution, "qwen3", data)
  hf = AutoTokenizer.from_pretrained(FIXTURES / "qwen3")
  ids = [t for r in rows for t in hf.apply_chat_template(_plain(r), tokenize=True)["input_ids"]]
  tokens = len(ids)
  out = io.StringIO()
  data_check.check(cfg, devices=1, epochs=1, out=out, err=io.StringIO())
  assert out.getvalue().splitlines() == [
    f"grain_train_files={data}: 1 file(s), 3 rows, every one usable; {tokens:,} tokens an epoch",
    "  an epoch fills at least 1 sequences of max_target_length=512 (packed): at least 0 steps at the global "
    "batch of 16 sequences (1 device(s))",
    "  1 epoch(s): at least 0 steps; steps=0 or fewer never runs out of data (num_epoch=1)",
  ]
  ready = sft.prepare(cfg, lead=False)
  read = _read(ready.grain_train_files)
  batch = next(sft_data.batches(hyperparameters(ready), read, ["messages"]))  # all three packed in row 0
  packed = batch["inputs"][0][batch["inputs_segmentation"][0] != 0].tolist()
  assert (packed, _mid_run(cfg, ready.grain_train_files)) == (ids, None)


def _conversations(n: int, words: int = 1) -> list[dict]:
  return [{"messages": _turns(f"What is {i} + {i}? " * words, f"{2 * i}")} for i in range(n)]


def test_sft_jsonl_is_staged_a_row_group_at_a_time_and_read_as_before(tmp_path, monkeypatch):
  """Two JSONL files (a blank line, a turn with a field of its own) staged with ROWS_PER_GROUP=3: row
  groups of 3, sources.json naming each part's file, and MaxText's reader yields the rows, in order, that
  it yielded from the whole-file Parquet staged before (`pq.write_table` of each file's roles and
  contents); the launcher keeps the first conversations, named by line, and counts them all."""
  monkeypatch.setenv("MAXTEXT_MOE_CACHE", str(tmp_path / "cache"))
  monkeypatch.setattr(staging, "ROWS_PER_GROUP", 3)
  first, second = _conversations(7), _conversations(12)[7:]
  first[2]["messages"][0]["name"] = "a user"
  a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
  _jsonl(a, first)
  lines = [json.dumps(r) for r in second]
  b.write_text("\n".join([*lines[:2], "", *lines[2:]]) + "\n")
  split = conversations.read_split("training", [str(a), str(b)], keep=4)
  before = tmp_path / "before"
  before.mkdir()
  plain = [[_plain(r) for r in rows] for rows in (first, second)]
  for i, turns in enumerate(plain):
    pq.write_table(pa.table({"messages": pa.array(turns, type=pa.list_(TURN))}), before / f"part-{i:05d}.parquet")
  parts = [pq.ParquetFile(p) for p in sorted(tmp_path.glob("cache/sft-staged/*/part-*.parquet"))]
  groups = [[p.metadata.row_group(g).num_rows for g in range(p.num_row_groups)] for p in parts]
  sources = json.loads(next(tmp_path.glob("cache/sft-staged/*/sources.json")).read_text())
  assert (groups, sources) == ([[3, 3, 1], [3, 2]], {"part-00000.parquet": str(a), "part-00001.parquet": str(b)})
  assert _read(split.pattern) == _read(str(before / "*.parquet"))
  assert (split.total, split.conversations) == (12, [(f"{a} line {n + 1}", plain[0][n]) for n in range(4)])


def _peak(paths: list) -> int:
  """Python's peak allocation while `read_split` stages `paths`, over what it held before."""
  tracemalloc.start()
  try:
    held = tracemalloc.get_traced_memory()[0]
    conversations.read_split("training", [str(p) for p in paths], keep=1)
    return tracemalloc.get_traced_memory()[1] - held
  finally:
    tracemalloc.stop()


def test_staging_a_file_many_row_groups_long_holds_one_row_group(tmp_path, monkeypatch):
  """Staging holds a row group's rows, not the file's: with ROWS_PER_GROUP=100, a file of 10,000
  conversations (100 groups) stages at the peak of one of 1,000 (10 groups), within a half; before, every
  conversation was held until the file was written, ten times the peak."""
  monkeypatch.setenv("MAXTEXT_MOE_CACHE", str(tmp_path / "cache"))
  monkeypatch.setattr(staging, "ROWS_PER_GROUP", 100)
  small, large, warm = tmp_path / "small.jsonl", tmp_path / "large.jsonl", tmp_path / "warm.jsonl"
  for path, n in ((warm, 200), (small, 1_000), (large, 10_000)):
    _jsonl(path, _conversations(n, words=10))
  _peak([warm])  # imports and caches first
  small_peak, large_peak = _peak([small]), _peak([large])
  assert large_peak < 1.5 * small_peak, (small_peak, large_peak)
