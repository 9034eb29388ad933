"""A run its data ends (issue 60): a row the run cannot use stops it with one line naming the file and row,
its last completed step saved, exit 65; data that runs out saves the last step and the summary says so.
The seam (`upstream/maxtext/data_end.py`) in-process on MaxText's own reader and loader, and one job on
CPU end to end: stopped by a bad Parquet row, resumed once the row is fixed until the data runs out, against
a run that never stopped."""

import json
import types

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from maxtext.common import data_loader
from maxtext.input_pipeline import input_pipeline_utils

from conftest import run_cli
from maxtext_moe.data.arithmetic import example_dir
from maxtext_moe.data.rows import BadRow, ConversationRow, TextRow
from maxtext_moe.errors import UserError
from maxtext_moe.sft.conversations import check_messages
from maxtext_moe.upstream.maxtext import data_end
from maxtext_moe.upstream.maxtext.sft_data import ChatTemplate
from maxtext_moe.upstream.patches import installed

WORDS = "the a expert router token layer gradient batch node rack model weight loss step data text".split()


def _corpus(path, n: int, bad: int | None, words: int = 40) -> list[str | None]:
  rng = np.random.default_rng(0)
  texts: list[str | None] = [" ".join(rng.choice(WORDS, words)) for _ in range(n)]
  if bad is not None:
    texts[bad] = None
  pq.write_table(pa.table({"text": pa.array(texts, type=pa.string())}), path, row_group_size=64)
  return texts


def test_a_null_row_is_named_by_its_file_and_row_as_grain_reads_it(tmp_path):
  """MaxText's Parquet reader, patched, checks each row: the rows before the bad one come through unchanged,
  then BadRow naming the file; its row is found by reading that file again."""
  path = tmp_path / "c.parquet"
  texts = _corpus(path, 100, bad=70)
  end = data_end.DataEnd(TextRow("text"), "text")
  with installed(data_end.patches(end)):
    dataset = input_pipeline_utils.make_parquet_iter_dataset(str(path))
  it = iter(dataset)
  assert [next(it)["text"] for _ in range(70)] == texts[:70]
  with pytest.raises(BadRow) as bad:
    next(it)
  assert (bad.value.path, str(bad.value)) == (str(path), f"{path}: 'text' is null, not a string; fix or remove the row")
  where = data_end.DataEndPatches(end).where(bad.value)
  assert where == f"{path} row 70: 'text' is null, not a string; fix or remove the row"


class _Rows:
  """A MaxText data iterator stand-in: batches from `items`, then whatever `last` is raised; a grain
  iterator's state (the next item's index)."""

  def __init__(self, items: list, last: BaseException):
    self.local_iterator = self
    self.items, self.last, self.at = items, last, 0

  def __next__(self):
    if self.at >= len(self.items):
      self.at += 1  # the failed read moved the reader on
      raise self.last
    self.at += 1
    return self.items[self.at - 1]

  def get_state(self) -> dict:
    return {"at": self.at}

  def set_state(self, state: dict) -> None:
    self.at = state["at"]


def _loader(rows: _Rows) -> data_loader.DataLoader:
  loader = object.__new__(data_loader.DataLoader)
  config = types.SimpleNamespace(reuse_example_batch=False, max_checkify=False, elastic_enabled=False)
  loader.__dict__.update(config=config, goodput_recorder=None, data_iterator=rows, last_batch=None)
  return loader


@pytest.mark.parametrize(
  ("last", "kind", "line"),
  [
    (StopIteration(), "ran_out", "the training data ran out"),
    (BadRow("/d/c.parquet", "/d/c.parquet: 'text' is null"), "bad_row", "/d/c.parquet: 'text' is null"),
    (TypeError("unhashable"), "failed", "MaxText's data pipeline failed (TypeError: unhashable)"),
  ],
)
def test_the_loader_says_how_the_data_ended_and_sets_its_iterator_back(last, kind, line):
  """MaxText's loader would end the loop as if nothing happened (StopTraining, exit 0); patched, it raises
  DataStop with what ended the data, the iterator back where the last whole batch left it (what the
  checkpoint of the last completed step must read on from)."""
  rows = _Rows(["b0", "b1"], last)
  loader = _loader(rows)
  end = data_end.DataEnd()  # no row check: the file of a BadRow is not read again
  with installed(data_end.patches(end)):
    got = [loader.load_next_batch_pre_sharding(), loader.load_next_batch_pre_sharding()]
    with pytest.raises(data_end.DataStop) as stop:
      loader.load_next_batch_pre_sharding()
  assert (got, stop.value.kind, stop.value.line, rows.get_state()) == (["b0", "b1"], kind, line, {"at": 2})


def test_the_processes_of_a_job_agree_on_what_ended_their_data(monkeypatch):
  """Each process reads its own files, so one can meet a bad row while another has its batch: all stop at
  the same step on the worst of what they met, with its line, gathered from the process that met it (here
  this process has its batch, process 1 a bad row; then both have theirs)."""
  import jax
  from jax.experimental import multihost_utils

  other = {np.dtype(np.int32): np.array([3], np.int32)}
  other[np.dtype(np.uint8)] = np.frombuffer(b"/d/p1.parquet row 9: 'text' is null".ljust(1024, b"\0"), np.uint8)

  def gather(x):
    return np.stack([x, other[x.dtype]])

  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(multihost_utils, "process_allgather", gather)
  assert data_end._agree(None) == ("bad_row", "/d/p1.parquet row 9: 'text' is null")
  assert data_end._agree(("ran_out", "the training data ran out")) == ("bad_row", "/d/p1.parquet row 9: 'text' is null")
  other[np.dtype(np.int32)] = np.array([0], np.int32)
  assert data_end._agree(None) is None
  assert data_end._agree(("ran_out", "the training data ran out")) == ("ran_out", "the training data ran out")


def test_a_conversation_the_run_cannot_use_is_one_line(tmp_path):
  """SFT rows as grain's Parquet reader gives them (a list column as an array): an empty conversation and one
  the chat template refuses are each one line naming the row, through the same grain map."""
  from transformers import AutoTokenizer

  hf = AutoTokenizer.from_pretrained(str(example_dir() / "tokenizer"))
  hf.chat_template = (
    "{% for m in messages %}{% if 'forbidden' in m['content'] %}{{ raise_exception('no forbidden words') }}"
    "{% endif %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
  )
  check = ConversationRow("messages", check_messages, ChatTemplate(hf))
  good = np.array([{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "2"}], dtype=object)
  check({"messages": good}, "t.parquet row 0")
  with pytest.raises(UserError) as empty:
    check({"messages": np.array([], dtype=object)}, "t.parquet row 1")
  refused = np.array([{"role": "user", "content": "forbidden"}, {"role": "assistant", "content": "2"}], dtype=object)
  with pytest.raises(UserError) as template:
    check({"messages": refused}, "t.parquet row 2")
  assert [str(empty.value), str(template.value)] == [
    "t.parquet row 1: 'messages' must be a non-empty list of {role, content} turns",
    "t.parquet row 2: the chat template does not render this conversation (no forbidden words); fix or remove the "
    "row, or fix the template",
  ]


def _train(tmp_path, run: str, data) -> tuple:
  r = run_cli(["train", f"grain_train_files={data}", "steps=30", "progress=plain", f"run_name={run}"], cwd=tmp_path)
  run_dir = tmp_path / "runs" / run
  losses = [json.loads(x)["loss"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
  saved = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
  ended = [x.strip() for x in r.stdout.splitlines() if x.strip().startswith("ended early")]
  return r, losses, saved, ended


@pytest.mark.ci
def test_a_bad_row_stops_with_its_line_and_a_checkpoint_and_the_fixed_data_resumes_to_its_end(tmp_path):
  """The issue's run: 400 Parquet rows with a null at row 300 (the reader reaches it at step 8, shuffled
  within grain's window) stops after step 7 of 30 with one line naming the file and row, checkpoint 6
  saved beside the first step's 0, exit 65 (not 0, not the requeue code). With the row fixed the same
  command resumes from 6 until the data runs out after step 10: checkpoint 9 saved, the summary says why.
  Its losses are those of a run on the fixed file that never stopped. `data check` names the row first
  (exit 2), then counts the fixed file."""
  data = tmp_path / "c.parquet"
  texts = _corpus(data, 400, bad=300)
  check = run_cli(["data", "check", "cpu/deepseek3-tiny", f"grain_train_files={data}"], cwd=tmp_path)
  assert (check.returncode, check.stderr.splitlines()[-1]) == (
    2,
    f"maxtext-moe: error: {data} row 300: 'text' is null, not a string; fix or remove the row",
  )
  r, losses, saved, ended = _train(tmp_path, "cpt", data)
  resume = f"maxtext-moe train grain_train_files={data} steps=30 progress=plain run_name=cpt"
  ckpts = tmp_path / "runs" / "cpt" / "checkpoints"
  assert (r.returncode, r.stderr.splitlines()[-1], len(losses), saved, ended) == (
    65,
    f"maxtext-moe: {data} row 300: 'text' is null, not a string; fix or remove the row; the run stopped after step "
    f"7 of 30, checkpoint 6 saved in {ckpts}; once the row is fixed, resume with: {resume}",
    7,
    [0, 6],
    [f"ended early after step 7 of 30: {data} row 300: 'text' is null, not a string; fix or remove the row; "
     f"checkpoint 6 saved in {ckpts}"],
  )  # fmt: skip
  texts[300] = "a fixed row of text"
  pq.write_table(pa.table({"text": pa.array(texts, type=pa.string())}), data, row_group_size=64)
  r, resumed, saved, ended = _train(tmp_path, "cpt", data)
  assert (r.returncode, len(resumed), saved, ended) == (
    0,
    10,
    [0, 6, 9],
    [f"ended early after step 10 of 30: the training data ran out (num_epoch=1); checkpoint 9 saved in {ckpts}; "
     "raise num_epoch or lower steps (maxtext-moe data check prints the steps an epoch takes)"],
  )  # fmt: skip
  r, whole, saved, _ = _train(tmp_path, "whole", data)
  assert (r.returncode, saved, resumed) == (0, [0, 9], whole)
  check = run_cli(["data", "check", "cpu/deepseek3-tiny", f"grain_train_files={data}"], cwd=tmp_path)
  assert (check.returncode, check.stdout.splitlines()) == (
    0,
    [
      f"grain_train_files={data}: 1 file(s), 400 rows, every one usable; 17,784 tokens an epoch",
      "  an epoch fills at least 70 sequences of max_target_length=256 (packed): at least 8 steps at the global "
      "batch of 8 sequences (1 device(s))",
      "  1 epoch(s): at least 8 steps; steps=8 or fewer never runs out of data (num_epoch=1)",
    ],
  )
