"""End-to-end: the real CLI trains the tiny model through MaxText's trainer on CPU, then resumes."""

import json

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


def test_flag_profile_is_applied_in_process(tmp_path):
  """A GPU flag profile on CPU: the launcher puts the profile's XLA_FLAGS (which XLA:CPU accepts and
  ignores) into effect before the backend starts, keeping the caller's own flags, without re-executing
  itself; the run records what it ran with."""
  args = ["train", "steps=1", "run_name=flags", "per_device_batch_size=1", "flag_profile=gb200", *FAST[1:]]
  r = run_cli([*args, "env_extra=[MAXTEXT_MOE_PROBE=1]"], cwd=tmp_path, devices=2)
  _check_ok(r)
  env = json.loads((tmp_path / "runs" / "flags" / "flags.json").read_text())["env"]
  xla = env["XLA_FLAGS"].split()
  assert "--xla_gpu_experimental_enable_collective_multi_streaming=true" in xla
  assert "--xla_force_host_platform_device_count=2" in xla
  assert env["MAXTEXT_MOE_PROBE"] == "1" and env["NCCL_MNNVL_ENABLE"] == "1"
  assert "on 2 cpu device(s)" in r.stdout
