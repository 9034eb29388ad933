"""Supervised fine-tuning: MaxText's SFT pipeline through our launcher, with our block.

- the masking, on a worked example: exactly the assistant turns' tokens carry loss;
- the checks before training (every row, lengths, the pad id) and JSONL staged as Parquet;
- the embedded example end to end (slow): convert the tiny HF fixture, SFT, held-out loss falls by >= 30%,
  `eval` agrees with the run's own eval_loss, export, and the export loads back bit-exactly.
"""

import json

import numpy as np
import pytest

from conftest import REPO, run_cli
from maxtext_moe.checkpoint.safetensors_io import HFCheckpoint
from maxtext_moe.config import recipes
from maxtext_moe.data import arithmetic
from maxtext_moe.errors import UserError
from maxtext_moe.sft import conversations

RECIPE = "cpu/deepseek3-tiny-sft"
FIXTURE = REPO / "tests" / "fixtures" / "hf_deepseek3_tiny" / "bf16"
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _cfg(resolution, *overrides):
  return resolution.resolve(recipes.recipe_path(RECIPE), ["finetune=false", *overrides])


def test_the_example_is_deterministic_and_its_splits_are_disjoint():
  train, held_out = arithmetic.splits()
  assert (train, held_out) == arithmetic.splits()
  key = [lambda c: c["messages"][0]["content"]][0]
  assert not {key(c) for c in train} & {key(c) for c in held_out}
  for c in train[:50] + held_out[:50]:
    a, b = (int(x) for x in c["messages"][0]["content"].removeprefix("What is ").removesuffix("?").split(" + "))
    assert c["messages"][1] == {"role": "assistant", "content": str(a + b)}


def test_masking_worked_example(resolution):
  """A two-round conversation with a system turn, through MaxText's own SFT pipeline (chat template,
  completion-only masking, packing, shift): the tokens that carry loss are exactly each assistant turn's
  content and its <|end|> (4 tokens: '4', <|end|>, '6', <|end|>); the system and user turns and the
  generation prompts <|assistant|> are context only."""
  from maxtext_moe.sft import prepare as sft_data
  from maxtext_moe.upstream.maxtext import sft_data as sft
  from maxtext_moe.upstream.maxtext.config import hyperparameters

  cfg = _cfg(resolution, "per_device_batch_size=1", "max_target_length=96")
  messages = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3 + 3?"},
    {"role": "assistant", "content": "6"},
  ]
  hf, pad_id = sft_data.checked_tokenizer(cfg)
  batch = next(sft.batches(hyperparameters(cfg), [{"messages": messages}], ["messages"]))
  lines = sft_data.show_row(hf, batch, 0)
  assert lines[1] == (
    "  <|system|>Be brief.<|end|><|user|>What is 2 + 2?<|end|><|assistant|>[[4<|end|>]]"
    "<|user|>And 3 + 3?<|end|><|assistant|>[[6<|end|>]]"
  )
  assert lines[0].endswith("4 tokens carry loss") and len(lines) == 2
  # The same, read off the arrays: the targets with a non-zero weight are the assistant tokens, in order.
  weights = np.asarray(batch["targets_segmentation"][0]) != 0
  end = hf.convert_tokens_to_ids("<|end|>")
  assert np.asarray(batch["targets"][0])[weights].tolist() == [
    hf.convert_tokens_to_ids("4"),
    end,
    hf.convert_tokens_to_ids("6"),
    end,
  ]
  assert pad_id == 0 and end != pad_id


def test_jsonl_is_checked_and_staged_as_parquet(tmp_path, monkeypatch):
  monkeypatch.setenv("MAXTEXT_MOE_CACHE", str(tmp_path / "cache"))
  rows = [arithmetic.conversation(10 + i, 20) for i in range(7)]
  src = tmp_path / "train.jsonl"
  src.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
  split = conversations.read_split("training", [str(src)], keep=3)
  assert split.total == 7 and len(split.conversations) == 3
  assert split.conversations[0] == (f"{src} line 1", rows[0]["messages"])
  staged = sorted((tmp_path / "cache").rglob("*.parquet"))
  assert len(staged) == 1 and split.pattern.endswith("*.parquet")
  back = conversations.read_split("training", [str(staged[0])], keep=10)
  assert [m for _, m in back.conversations] == [r["messages"] for r in rows]
  assert conversations.read_split("training", [str(src)], keep=3).pattern == split.pattern  # cached


def test_overlength_is_counted_truncated_or_refused(resolution, tmp_path, monkeypatch, capsys):
  from maxtext_moe.sft import prepare as sft_data

  monkeypatch.setenv("MAXTEXT_MOE_CACHE", str(tmp_path / "cache"))
  data = tmp_path / "t.jsonl"
  long = {"messages": [{"role": "user", "content": "x" * 40}, {"role": "assistant", "content": "y"}]}
  data.write_text("\n".join(json.dumps(r) for r in [arithmetic.conversation(11, 12), long, long]) + "\n")
  files = [f"grain_train_files={data}", f"grain_eval_files={data}", "max_target_length=32"]
  cfg = sft_data.prepare(_cfg(resolution, *files))
  note = capsys.readouterr().err
  assert "2 of 3 training conversations are longer than max_target_length=32 tokens and are cut to it" in note
  assert f"(the longest, 45, is {data} line 2)" in note
  assert cfg.grain_train_files.endswith("*.parquet") and cfg.grain_file_type == "parquet"
  with pytest.raises(UserError, match="2 of 3 training conversations are longer than max_target_length=32"):
    sft_data.prepare(_cfg(resolution, *files, "sft_overlength=refuse"))


@pytest.mark.slow
@pytest.mark.extended
def test_sft_example_learns_evaluates_and_exports(tmp_path):
  """The README's loop on the embedded example: convert the tiny HF fixture, SFT 21 steps (evaluated after
  steps 1 and 21), `eval` the result, export it, and import and export again."""
  ckpt, runs = tmp_path / "ckpt", tmp_path / "runs"
  model = [f"model_file={ckpt}/model.yml"]
  proc = run_cli(
    ["convert", "hf-to-maxtext", "--hf", str(FIXTURE), "--out", str(ckpt), "--dtype", "float32"], cwd=tmp_path
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  # Relative checkpoint paths, as a user types them (Orbax itself refuses relative paths).
  args = ["train", RECIPE, *model, "load_parameters_path=ckpt/items", f"base_output_directory={runs}"]
  proc = run_cli([*args, "run_name=sft", "steps=21", "checkpoint_period=20", "progress=plain"], cwd=tmp_path)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert "eval after step 21: eval_loss" in proc.stdout and "Traceback" not in proc.stderr
  rows = [json.loads(line) for line in (runs / "sft" / "metrics.jsonl").read_text().splitlines()]
  evals = [r for r in rows if "eval_loss" in r]
  assert [r["step"] for r in evals] == [0, 20]
  assert evals[-1]["eval_loss"] <= 0.7 * evals[0]["eval_loss"], evals
  assert {r["eval_tokens"] for r in evals} == {913}  # the held-out answers and their <|end|>: nothing else

  def evaluate(items):
    out = run_cli(["eval", RECIPE, *model, f"load_parameters_path={items}", "--json"], cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)

  before, after = evaluate(f"{ckpt}/items"), evaluate("runs/sft/checkpoints/20/items")
  assert after["completion_tokens"] == 913 and after["conversations"] == 256
  # Two computations of one number: MaxText's packed eval in the run, our teacher forcing here.
  assert after["completion_loss"] == pytest.approx(evals[-1]["eval_loss"], abs=2e-4)
  assert after["completion_loss"] < 0.7 * before["completion_loss"]
  print(f"exact match before {before['exact_match']:.3f}, after {after['exact_match']:.3f}")

  hf1, hf2 = tmp_path / "hf1", tmp_path / "hf2"
  proc = run_cli(["convert", "maxtext-to-hf", "--ckpt", "runs/sft/checkpoints/20", "--out", str(hf1)], cwd=tmp_path)
  assert proc.returncode == 0, proc.stderr[-2000:]
  src, out = HFCheckpoint(FIXTURE), HFCheckpoint(hf1)
  assert set(out.tensors) == set(src.tensors)
  changed = [
    n for n in src.tensors if not np.array_equal(np.asarray(src.raw(n), np.float32), np.asarray(out.raw(n), np.float32))
  ]
  for name in src.tensors:  # the dtype rules: the routing bias is always float32 (this source has bf16)
    dtype = np.float32 if name.endswith("e_score_correction_bias") else src.raw(name).dtype
    assert out.raw(name).shape == src.raw(name).shape and out.raw(name).dtype == dtype, name
  assert len(changed) > len(src.tensors) // 2, changed
  # ... and it loads back: imported again and exported again, bit for bit.
  for cmd in (
    ["convert", "hf-to-maxtext", "--hf", str(hf1), "--out", str(tmp_path / "back"), "--dtype", "float32"],
    ["convert", "maxtext-to-hf", "--ckpt", str(tmp_path / "back"), "--out", str(hf2)],
  ):
    proc = run_cli(cmd, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
  again = HFCheckpoint(hf2)
  assert set(again.tensors) == set(out.tensors)
  for name in out.tensors:
    np.testing.assert_array_equal(np.asarray(again.raw(name)), np.asarray(out.raw(name)), name)
  assert json.loads((hf2 / "config.json").read_text()) == json.loads((hf1 / "config.json").read_text())
