"""Pretraining on your own corpus: a JSONL text file and a Hugging Face tokenizer directory (made here by the
`tokenizers` library), through the documented keys; the vocabulary sized from the tokenizer; bad rows,
columns and tokenizers refused in one line; `data show` for pretraining rows; a real run on CPU."""

import glob
import io
import json
import random
import subprocess
import sys
import threading

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import run_cli
from maxtext_moe import cli
from maxtext_moe.config.recipes import recipe_path
from maxtext_moe.data import staging
from maxtext_moe.data.text import tokenizer_size, vocab_for
from maxtext_moe.errors import UserError
from maxtext_moe.pretrain import text
from maxtext_moe.tools import data_check

WORDS = "the a expert router token layer gradient batch node rack model weight loss step data text".split()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
  """(a JSONL corpus of 400 documents, a 300-token byte-level BPE tokenizer trained on it)."""
  from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
  from transformers import PreTrainedTokenizerFast

  root = tmp_path_factory.mktemp("corpus")
  rng = random.Random(0)
  texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 200))) + "." for _ in range(400)]
  with open(root / "corpus.jsonl", "w", encoding="utf-8") as f:
    for t in texts:
      f.write(json.dumps({"text": t, "source": "test"}) + "\n")
  tok = Tokenizer(models.BPE(unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  tok.decoder = decoders.ByteLevel()
  specials = ["<pad>", "<unk>", "<s>", "</s>"]
  alphabet = pre_tokenizers.ByteLevel.alphabet()
  tok.train_from_iterator(
    texts, trainers.BpeTrainer(vocab_size=300, special_tokens=specials, initial_alphabet=alphabet)
  )
  hf = PreTrainedTokenizerFast(
    tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", bos_token="<s>", eos_token="</s>"
  )
  hf.save_pretrained(str(root / "tokenizer"))
  return root / "corpus.jsonl", root / "tokenizer"


def _keys(corpus) -> list[str]:
  data, tokenizer = corpus
  return [
    f"grain_train_files={data}",
    "tokenizer_type=huggingface",
    f"tokenizer_path={tokenizer}",
    "vocab_from_tokenizer=true",
  ]


def test_vocab_size_comes_from_the_tokenizer(corpus, resolution):
  cfg = resolution.resolve(recipe_path("cpu/deepseek3-tiny"), _keys(corpus))
  assert tokenizer_size(str(corpus[1])) == 300 and cfg.vocab_size == 384 == vocab_for(300)
  with pytest.raises(UserError, match="vocab_from_tokenizer=true sizes the vocabulary from the tokenizer"):
    resolution.resolve(recipe_path("cpu/deepseek3-tiny"), [*_keys(corpus), "vocab_size=512"])
  with pytest.raises(UserError, match="is for training from scratch"):
    resolution.resolve(recipe_path("cpu/deepseek3-tiny-finetune"), _keys(corpus))


def test_a_tokenizer_larger_than_the_vocabulary_is_refused(corpus, resolution):
  keys = [k for k in _keys(corpus) if not k.startswith("vocab_from")] + ["vocab_size=256", "override_model_config=true"]
  cfg = resolution.resolve(recipe_path("cpu/deepseek3-tiny"), keys)
  with pytest.raises(UserError, match="has 300 tokens but the model's vocab_size is 256: .*vocab_from_tokenizer=true"):
    text.check_vocab(cfg)


def test_jsonl_is_staged_as_parquet_once_with_every_row_kept(corpus, resolution):
  cfg = resolution.resolve(recipe_path("cpu/deepseek3-tiny"), _keys(corpus))
  ready = text.prepare(cfg)
  assert ready.grain_file_type == "parquet" and ready.grain_train_files.endswith("*.parquet")
  (staged,) = __import__("glob").glob(ready.grain_train_files)
  rows = [json.loads(line)["text"] for line in corpus[0].read_text().splitlines()]
  assert pq.read_table(staged).column("text").to_pylist() == rows, "every document, in order, text only"
  assert text.prepare(cfg).grain_train_files == ready.grain_train_files, "staged once"


@pytest.mark.parametrize(
  ("content", "expected"),
  [
    ('{"text": "fine"}\n{"text": 3}\n', r"corpus.jsonl line 2: 'text' is int, not a string"),
    ('{"body": "x"}\n', r"corpus.jsonl line 1: no 'text' field \(has: body\); each line needs a 'text' string"),
    ("not json\n", r"corpus.jsonl line 1: not valid JSON"),
  ],
)
def test_bad_rows_are_one_line_naming_the_file_and_line(content, expected, corpus, resolution, tmp_path):
  bad = tmp_path / "corpus.jsonl"
  bad.write_text(content)
  keys = [*_keys(corpus)[1:], f"grain_train_files={bad}"]
  cfg = resolution.resolve(recipe_path("cpu/deepseek3-tiny"), keys)
  with pytest.raises(UserError, match=expected):
    text.prepare(cfg)


def test_a_parquet_column_of_the_wrong_name_or_kind_is_refused(corpus, resolution, tmp_path):
  wrong = tmp_path / "ids.parquet"
  pq.write_table(pa.table({"text": pa.array([[1, 2, 3]], type=pa.list_(pa.int32()))}), wrong)
  cfg = resolution.resolve(recipe_path("cpu/deepseek3-tiny"), [*_keys(corpus)[1:], f"grain_train_files={wrong}"])
  with pytest.raises(
    UserError, match="column 'text' holds list<element: int32>, not text; for token ids set tokenize_train_data=false"
  ):
    text.prepare(cfg)
  cfg = resolution.resolve(
    recipe_path("cpu/deepseek3-tiny"), [*_keys(corpus)[1:], f"grain_train_files={wrong}", "train_data_columns=[body]"]
  )
  with pytest.raises(UserError, match="has no 'body' column \\(columns: text\\); set train_data_columns"):
    text.prepare(cfg)


# Another process of the node, staging: it holds the staging lock while it writes the staged copy.
_OTHER_STAGER = """
import sys, time
from pathlib import Path
import pyarrow as pa, pyarrow.parquet as pq
from maxtext_moe import locks
lock, out = Path(sys.argv[1]), Path(sys.argv[2])
locks.acquire(lock, what="staging")
print("holding", flush=True)
time.sleep(3)
out.mkdir(parents=True, exist_ok=True)
pq.write_table(pa.table({"text": ["staged by the other process"]}), out / "part-00000.parquet")
locks.release(lock, remove=True)
"""


def test_jsonl_is_staged_once_per_node_the_others_waiting_for_it(corpus, resolution, tmp_path, monkeypatch):
  """While another process of the node stages the corpus (it holds the lock next to the staged directory),
  prepare waits for it and reads what it staged instead of staging a copy of its own."""
  monkeypatch.setenv("MAXTEXT_MOE_CACHE", str(tmp_path / "cache"))
  cfg = resolution.resolve(recipe_path("cpu/deepseek3-tiny"), _keys(corpus))
  out = staging.staged_dir([corpus[0]], "text-staged")
  other = subprocess.Popen(
    [sys.executable, "-c", _OTHER_STAGER, str(out.parent / f".{out.name}.lock"), str(out)], stdout=subprocess.PIPE
  )
  assert other.stdout.readline() == b"holding\n"
  ready = text.prepare(cfg)
  (staged,) = glob.glob(ready.grain_train_files)  # read as prepare returns, before the other process ends
  assert pq.read_table(staged).column("text").to_pylist() == ["staged by the other process"]
  assert other.wait(timeout=60) == 0


def test_jsonl_is_staged_a_row_group_at_a_time_and_names_its_source(corpus, resolution, tmp_path, monkeypatch):
  """Staging streams: rows go to disk in row groups of at most ROWS_PER_GROUP (never the whole file in
  memory), and sources.json names the JSONL file each part came from."""
  monkeypatch.setenv("MAXTEXT_MOE_CACHE", str(tmp_path / "cache"))
  monkeypatch.setattr(staging, "ROWS_PER_GROUP", 150)
  ready = text.prepare(resolution.resolve(recipe_path("cpu/deepseek3-tiny"), _keys(corpus)))
  (staged,) = glob.glob(ready.grain_train_files)
  parquet = pq.ParquetFile(staged)
  assert [parquet.metadata.row_group(i).num_rows for i in range(parquet.num_row_groups)] == [150, 150, 100]
  rows = [json.loads(line)["text"] for line in corpus[0].read_text().splitlines()]
  assert parquet.read().column("text").to_pylist() == rows
  sources = json.loads((tmp_path / "cache" / "text-staged").glob("*/sources.json").__next__().read_text())
  assert sources == {"part-00000.parquet": str(corpus[0].resolve())}


def test_data_check_reads_every_row_and_counts_an_epoch(corpus, resolution, tmp_path):
  """`data check`: every row checked and tokenized as the pipeline does, the epoch's rows, tokens, sequences
  and steps at the global batch of the devices given; the first bad row of a JSONL file is one line."""
  cfg = resolution.resolve(recipe_path("cpu/deepseek3-tiny"), _keys(corpus))
  out = io.StringIO()
  data_check.check(cfg, devices=4, epochs=3, out=out, err=io.StringIO())
  assert out.getvalue().splitlines() == [
    f"grain_train_files={corpus[0]}: 1 file(s), 400 rows, every one usable; 110,188 tokens an epoch",
    "  an epoch fills at least 431 sequences of max_target_length=256 (packed): at least 13 steps at the global "
    "batch of 32 sequences (4 device(s))",
    "  3 epoch(s): at least 39 steps; steps=39 or fewer never runs out of data (num_epoch=3)",
  ]
  bad = tmp_path / "bad.jsonl"
  lines = corpus[0].read_text().splitlines()
  bad.write_text("\n".join([*lines[:249], json.dumps({"text": None}), *lines[250:]]) + "\n")
  cfg = resolution.resolve(recipe_path("cpu/deepseek3-tiny"), [*_keys(corpus)[1:], f"grain_train_files={bad}"])
  with pytest.raises(UserError) as e:
    data_check.check(cfg, devices=1, epochs=None, out=io.StringIO(), err=io.StringIO())
  assert str(e.value) == f"{bad} line 250: 'text' is null, not a string; fix or remove the row"


def test_data_show_takes_nodes_and_checks_the_config_before_it_reads_a_row(corpus, tmp_path, monkeypatch, capfd):
  """`--nodes` works on `data show` as on every command (eval refuses it in one line: it has no meaning
  there); a config MaxText refuses is one line before any row is read or staged (nothing under the cache)."""
  monkeypatch.setenv("MAXTEXT_MOE_CACHE", str(tmp_path / "cache"))
  monkeypatch.setattr(cli, "last_word", lambda line, verbose: print(line, file=sys.stderr))  # stderr kept open
  monkeypatch.setattr(sys, "unraisablehook", sys.unraisablehook)
  monkeypatch.setattr(threading, "excepthook", threading.excepthook)
  assert cli.main(["data", "show", "cpu/deepseek3-tiny", "--nodes", "2", *_keys(corpus), "--rows", "1"]) == 0
  shown = capfd.readouterr().out.splitlines()
  assert shown[0].startswith(f"{corpus[0]}: the first rows of the first batch as the model sees them")
  assert shown[1].startswith("row 0: ")
  assert cli.main(["data", "show", "cpu/deepseek3-tiny", *_keys(corpus), "steps=0"]) == 2
  assert capfd.readouterr().err.splitlines()[-1] == (
    "maxtext-moe: error: MaxText refuses this config: You must set steps or learning_rate_schedule_steps to a "
    "positive integer."
  )
  assert not (tmp_path / "cache" / "text-staged").exists()
  assert cli.main(["eval", "cpu/deepseek3-tiny-sft", "--nodes", "2"]) == 2
  assert capfd.readouterr().err.splitlines()[-1] == (
    "maxtext-moe: error: --nodes 2: eval scores the checkpoint on this machine's devices, whatever the job's "
    "nodes (the checkpoint loads on any device count); leave --nodes out"
  )


@pytest.mark.ci  # kept out of the README suite's 10 minutes; CI runs the ci tier
@pytest.mark.slow
def test_pretraining_from_a_text_file_and_a_tokenizer_directory(corpus, tmp_path):
  """The documented path end to end on CPU: `data show` packs the corpus's rows with the tokenizer, and
  `train` trains on them (the loss falls from about ln 384)."""
  show = run_cli(["data", "show", "cpu/deepseek3-tiny", *_keys(corpus), "--rows", "2"], cwd=tmp_path)
  assert show.returncode == 0, show.stderr[-3000:]
  lines = show.stdout.splitlines()
  assert lines[0].startswith(f"{corpus[0]}: the first rows of the first batch as the model sees them, from the first")
  assert lines[1].startswith("row 0: ") and "<s>" in lines[2] and any(w in lines[2] for w in WORDS)
  r = run_cli(["train", *_keys(corpus), "steps=4", "progress=plain", "run_name=own"], cwd=tmp_path)
  assert r.returncode == 0, r.stderr[-3000:]
  losses = [json.loads(x)["loss"] for x in (tmp_path / "runs" / "own" / "metrics.jsonl").read_text().splitlines()]
  assert len(losses) == 4 and losses[0] < 8 and losses[-1] < losses[0], losses
