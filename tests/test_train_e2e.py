"""End-to-end: the real CLI trains the tiny model through MaxText's trainer on CPU, then resumes."""

import pytest

from conftest import run_cli
from maxtext_moe.launch.recorder import read_jsonl

pytestmark = pytest.mark.slow

FAST = ["per_device_batch_size=2", "max_target_length=128", "learning_rate=1e-2", "warmup_steps_fraction=0.0"]


def _losses(run_dir):
  return [r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl")]


def _check_ok(r):
  assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"


def test_train_one_device_then_resume(tmp_path):
  r = run_cli(["train", "steps=10", "checkpoint_period=5", "run_name=e2e", *FAST], cwd=tmp_path)
  _check_ok(r)
  run_dir = tmp_path / "runs" / "e2e"
  losses = _losses(run_dir)
  assert len(losses) == 10
  assert sum(losses[-3:]) / 3 < 0.85 * losses[0], losses
  assert "on 1 cpu device(s)" in r.stdout and "run summary" in r.stdout
  assert (run_dir / "loss.png").is_file()
  assert sorted(p.name for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit()) == ["0", "5", "9"]

  r = run_cli(["train", "steps=13", "checkpoint_period=5", "run_name=e2e", *FAST], cwd=tmp_path)
  _check_ok(r)
  rows = read_jsonl(run_dir / "metrics.jsonl")
  assert [row["step"] for row in rows] == list(range(13)), "resumed at step 10, no step repeated or lost"
  assert "step    11/13" in r.stdout and "step     1/13" not in r.stdout
  assert rows[10]["loss"] < losses[0]

  r = run_cli(["train", "steps=13", "run_name=e2e", *FAST], cwd=tmp_path)
  assert r.returncode == 2 and "already completed 13 steps" in r.stderr


def test_train_eight_devices_fsdp(tmp_path):
  r = run_cli(["train", "steps=8", "run_name=fsdp", "per_device_batch_size=1", *FAST[1:]], cwd=tmp_path, devices=8)
  _check_ok(r)
  assert "on 8 cpu device(s)" in r.stdout
  losses = _losses(tmp_path / "runs" / "fsdp")
  assert len(losses) == 8 and sum(losses[-3:]) / 3 < 0.9 * losses[0], losses
