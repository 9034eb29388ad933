"""Faults during training, through the real CLI on the tiny model: SIGTERM then resume, an interrupted
save, an unreadable checkpoint, a NaN loss. Each must keep every completed step and say what it did."""

import json
import os
import shlex
import signal
import subprocess
import sys
import time

import pytest

from conftest import run_cli
from maxtext_moe import integrity
from maxtext_moe.runlog.files import read_jsonl

pytestmark = pytest.mark.slow

FAST = ["per_device_batch_size=2", "max_target_length=128", "learning_rate=1e-2", "warmup_steps_fraction=0.0"]


def _rows(tmp_path, name):
  return read_jsonl(tmp_path / "runs" / name / "metrics.jsonl")


def _ok(r):
  assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"


def _sigterm_after(tmp_path, args: list[str], step: int) -> subprocess.CompletedProcess:
  """Runs `maxtext-moe ARGS`, sends SIGTERM once step `step` is shown, and waits for the end."""
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", PYTHONUNBUFFERED="1")
  out, err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
  with open(out, "w", encoding="utf-8") as o, open(err, "w", encoding="utf-8") as e:
    proc = subprocess.Popen([sys.executable, "-m", "maxtext_moe", *args], cwd=tmp_path, env=env, stdout=o, stderr=e)
    deadline = time.monotonic() + 240
    while f"step {step:>5}/" not in out.read_text() and proc.poll() is None and time.monotonic() < deadline:
      time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=240)
  return subprocess.CompletedProcess(args, proc.returncode, out.read_text(), err.read_text())


@pytest.mark.extended
def test_sigterm_saves_and_the_printed_command_resumes_to_the_same_losses(tmp_path):
  common = ["steps=10", "checkpoint_period=5", "progress=plain", *FAST]
  r = run_cli(["train", "run_name=whole", *common], cwd=tmp_path)
  _ok(r)
  whole = [row["loss"] for row in _rows(tmp_path, "whole")]
  assert len(whole) == 10 and sum(whole[-3:]) / 3 < 0.85 * whole[0], whole
  assert "on 1 cpu device(s)" in r.stdout and "run summary" in r.stdout
  saved = sorted(int(p.name) for p in (tmp_path / "runs" / "whole" / "checkpoints").iterdir())
  assert saved == [0, 5, 9], "every checkpoint_period steps and at the end"

  r = _sigterm_after(tmp_path, ["train", "run_name=cut", *common], step=2)
  assert r.returncode == 75, r.stderr[-3000:]
  (line,) = [x for x in r.stderr.splitlines() if x.startswith("maxtext-moe: stopped by SIGTERM")]
  stopped = [row["step"] for row in _rows(tmp_path, "cut")]
  last = stopped[-1]
  assert line.startswith(f"maxtext-moe: stopped by SIGTERM after step {last + 1}; checkpoint {last} saved in ")
  assert stopped == list(range(last + 1)) and last < 9, "every finished step is in the metrics, once"
  checkpoints = tmp_path / "runs" / "cut" / "checkpoints"
  assert str(last) in {p.name for p in checkpoints.iterdir()}
  assert "run summary" in r.stdout and (tmp_path / "runs" / "cut" / "loss.png").is_file()

  command = shlex.split(line.split("resume with: ", 1)[1])
  assert command[:2] == ["maxtext-moe", "train"] and command[-1] == "run_name=cut"
  r = run_cli(command[1:], cwd=tmp_path)
  _ok(r)
  assert f"maxtext-moe: resuming from checkpoint {last} ({checkpoints}/{last})" in r.stdout
  rows = _rows(tmp_path, "cut")
  assert [row["step"] for row in rows] == list(range(10)), "no step lost or repeated"
  assert [row["loss"] for row in rows] == whole, "resumed losses equal the uninterrupted run's, bit for bit"

  r = run_cli(["train", "run_name=cut", *common], cwd=tmp_path)
  assert r.returncode == 2 and "run 'cut' already completed 10 steps" in r.stderr


@pytest.mark.extended
def test_an_interrupted_save_and_an_unreadable_checkpoint_fall_back_and_say_so(tmp_path):
  common = ["checkpoint_period=3", "progress=plain", "run_name=fb", *FAST]
  _ok(run_cli(["train", "steps=7", *common], cwd=tmp_path))
  checkpoints = tmp_path / "runs" / "fb" / "checkpoints"
  assert sorted(int(p.name) for p in checkpoints.iterdir()) == [0, 3, 6]
  # What SIGKILL during a save leaves: Orbax's temporary directory, never renamed to its step.
  (checkpoints / "9.orbax-checkpoint-tmp-1764540000").mkdir()
  # Each complete save recorded its files (sizes and CRC-32) for the restore to check.
  assert all((checkpoints / str(s) / integrity.MANIFEST).is_file() for s in (0, 3, 6))
  # And the newest checkpoint unreadable: its second-largest data file cut short (before the integrity record,
  # a non-largest file cut short went undetected by the restore).
  files = sorted((p for p in (checkpoints / "6").rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
  data = files[-2]
  data.write_bytes(data.read_bytes()[:100])

  r = run_cli(["train", "steps=8", "checkpoint_fallback=false", *common], cwd=tmp_path)
  assert r.returncode == 2
  assert (
    r.stderr.strip().splitlines()[-1].startswith(f"maxtext-moe: error: checkpoint 6 in {checkpoints} cannot be read (")
  )
  assert "set checkpoint_fallback=true" in r.stderr and (checkpoints / "6").is_dir(), "nothing moved"
  assert "maxtext-moe: removed 9.orbax-checkpoint-tmp-1764540000, a checkpoint save that was interrupted" in r.stdout

  r = run_cli(["train", "steps=8", *common], cwd=tmp_path)
  _ok(r)
  out = r.stdout
  assert "maxtext-moe: warning: checkpoint 6 cannot be read (RuntimeError: " in out
  assert f"{data.relative_to(checkpoints / '6')} is 100 bytes, its save wrote " in out
  assert f"maxtext-moe: resuming from checkpoint 3 ({checkpoints}/3)" in out
  moved = list((tmp_path / "runs" / "fb" / "unreadable_checkpoints").iterdir())
  assert len(moved) == 1 and moved[0].name.startswith("6-"), "kept, out of the way"
  assert [row["step"] for row in _rows(tmp_path, "fb")] == list(range(8))
  assert not any(".orbax-checkpoint-tmp" in p.name for p in checkpoints.iterdir())


@pytest.mark.extended
def test_nan_loss_stops_with_one_line_and_skip_mode_carries_on(tmp_path):
  common = ["steps=6", "checkpoint_period=2", "progress=plain", *FAST, "fault_nan_loss_steps=[3]"]
  r = run_cli(["train", "run_name=stop", *common], cwd=tmp_path)
  assert r.returncode == 1, r.stderr[-3000:]
  last = r.stderr.strip().splitlines()[-1]
  assert last.startswith("maxtext-moe: the loss became nan at step 4; the last good checkpoint is 2 (")
  assert "later ones moved to" in last and "or on_nonfinite_loss=skip, then: maxtext-moe train steps=6 " in last
  assert last.endswith(" run_name=stop")
  rows = _rows(tmp_path, "stop")
  assert rows[3]["loss"] is None and rows[3]["loss_nonfinite"] == "nan"
  assert all(r["loss"] is not None for r in rows[:3])
  assert "run summary" in r.stdout and (tmp_path / "runs" / "stop" / "loss.png").is_file()
  assert json.loads((tmp_path / "runs" / "stop" / "metrics.jsonl").read_text().splitlines()[3])["step"] == 3
  kept = {p.name for p in (tmp_path / "runs" / "stop" / "checkpoints").iterdir()}
  assert kept == {"0", "2"}, "checkpoints from the NaN step on are moved out of the resume's way"

  r = run_cli(["train", "run_name=skip", "on_nonfinite_loss=skip", *common], cwd=tmp_path)
  _ok(r)
  rows = _rows(tmp_path, "skip")
  assert [row["step"] for row in rows] == list(range(6))
  assert rows[3]["nonfinite_skipped"] is True and rows[3]["loss"] is None
  assert all(row["loss"] is not None for i, row in enumerate(rows) if i != 3), "the update was skipped: no NaN weights"
  assert "(update skipped)" in r.stdout and "non-finite  1 step(s)" in r.stdout

  r = run_cli(
    [
      "train",
      "run_name=give",
      "on_nonfinite_loss=skip",
      "max_nonfinite_skips=2",
      *common[:-1],
      "fault_nan_loss_steps=[2,3]",
    ],
    cwd=tmp_path,
  )
  assert r.returncode == 1
  assert "maxtext-moe: the loss became nan at step 4 after skipping 2 non-finite step(s)" in r.stderr


def test_the_integrity_record_finds_a_change_in_any_file(tmp_path):
  step = tmp_path / "7"
  (step / "d").mkdir(parents=True)
  for name, size in (("_METADATA", 10), ("d/a", 1000), ("d/b", 5000)):
    (step / name).write_bytes(bytes(range(256)) * (size // 256) + b"x" * (size % 256))
  assert integrity.record_completed(tmp_path, checksums=True) == [7] and integrity.problem(step) is None
  (step / "d" / "a").write_bytes(b"y" + (step / "d" / "a").read_bytes()[1:])  # same size, one byte changed
  assert integrity.problem(step) == "d/a does not match the CRC-32 its save recorded"
  integrity.record(step, checksums=True)
  (step / "d" / "b").unlink()
  assert integrity.problem(step) == "d/b is missing"
  integrity.record(step, checksums=False)
  (step / "_METADATA").write_bytes(b"short")
  assert integrity.problem(step) == "_METADATA is 5 bytes, its save wrote 10"


def test_a_resume_on_another_device_count_says_what_happens_to_the_batch(tmp_path, capfd):
  """The run's job shape (job.json) is kept in its directory; a resume (checkpoints there) on another
  device count is one warning with the global batch before and after and how to keep it."""
  from types import SimpleNamespace

  from maxtext_moe.launch.train import _compare_job

  cfg = SimpleNamespace(run_name="r", per_device_batch_size=2, nodes=1)
  _compare_job(tmp_path, cfg, devices=8, batch=16)
  assert json.loads((tmp_path / "job.json").read_text())["devices"] == 8
  (tmp_path / "checkpoints" / "4").mkdir(parents=True)
  _compare_job(tmp_path, cfg, devices=8, batch=16)
  assert capfd.readouterr().err == "", "the same devices: nothing to say"
  _compare_job(tmp_path, cfg, devices=4, batch=8)
  assert capfd.readouterr().err.strip() == (
    "maxtext-moe: warning: run r last trained on 8 devices (global batch 16 sequences) and resumes on 4 "
    "(global batch 8); the learning-rate schedule counts steps, not tokens. To keep the batch: "
    "per_device_batch_size=4, or resume on 8 devices"
  )
