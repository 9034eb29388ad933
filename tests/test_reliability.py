"""A stop at any moment, one writer per run, a full disk, a run name that escapes: each ends in one line
with a documented exit code, and loses nothing that was complete."""

import os
import resource
import signal
import subprocess
import sys
import time

import pytest

from conftest import run_cli
from maxtext_moe import locks
from maxtext_moe.errors import UserError, no_space

FAST = ["per_device_batch_size=2", "max_target_length=128", "learning_rate=1e-2", "warmup_steps_fraction=0.0"]


def _start(tmp_path, args, *, name="run", limit_bytes=None):
  """`maxtext-moe ARGS` in the background, stdout and stderr to files (a full pipe would block it)."""
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", PYTHONUNBUFFERED="1")
  out, err = open(tmp_path / f"{name}.out", "w"), open(tmp_path / f"{name}.err", "w")  # noqa: SIM115
  limit = (lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit_bytes, limit_bytes))) if limit_bytes else None
  cmd = [sys.executable, "-m", "maxtext_moe", *args]
  return subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=out, stderr=err, preexec_fn=limit)


def _text(tmp_path, name, stream):
  return (tmp_path / f"{name}.{stream}").read_text()


def _wait_for(predicate, seconds=240):
  deadline = time.monotonic() + seconds
  while not predicate():
    assert time.monotonic() < deadline, "timed out"
    time.sleep(0.2)


def test_sigterm_while_starting_up_is_a_clean_resumable_stop(tmp_path):
  """SIGTERM while `train` still imports MaxText: the same exit as later (75, which train.sbatch
  requeues), one line that says nothing was lost, nothing trained."""
  proc = _start(tmp_path, ["train", "steps=3", "run_name=early", *FAST])
  time.sleep(2.0)
  proc.send_signal(signal.SIGTERM)
  assert proc.wait(timeout=120) == 75
  last = _text(tmp_path, "run", "err").strip().splitlines()[-1]
  assert last.startswith("maxtext-moe: stopped by SIGTERM before anything was trained; nothing was lost"), last
  assert not (tmp_path / "runs" / "early" / "checkpoints").exists()


@pytest.mark.extended
def test_a_second_run_with_the_same_name_refuses_and_a_killed_holder_frees_it(tmp_path):
  long = ["train", "steps=100000", "run_name=shared", "progress=plain", "enable_checkpointing=false", *FAST]
  first = _start(tmp_path, long, name="first")
  try:
    _wait_for(lambda: "step     1/" in _text(tmp_path, "first", "out") or first.poll() is not None)
    assert first.poll() is None, _text(tmp_path, "first", "err")[-3000:]
    second = run_cli(["train", "steps=2", "run_name=shared", *FAST], cwd=tmp_path)
    assert second.returncode == 2, second.stderr[-3000:]
    line = second.stderr.strip().splitlines()[-1]
    assert f"is in use by pid {first.pid} on " in line and "choose another name" in line, line
  finally:
    first.kill()  # SIGKILL: no handler runs, the kernel drops the lock
    first.wait(timeout=60)
  again = run_cli(["train", "steps=2", "run_name=shared", *FAST], cwd=tmp_path)
  assert again.returncode == 0, again.stderr[-3000:]


@pytest.mark.extended
def test_a_full_disk_during_a_save_is_one_line_and_keeps_the_earlier_checkpoint(tmp_path):
  """`ulimit -f`: the save that does not fit fails with EFBIG; the run ends with exit 74 and one line, the
  unfinished save is gone, the complete checkpoint before it is intact, and a rerun resumes from it."""
  args = ["train", "steps=6", "checkpoint_period=2", "run_name=full", "progress=plain", *FAST]
  proc = _start(tmp_path, args, limit_bytes=20_000 * 1024)
  assert proc.wait(timeout=600) == 74, _text(tmp_path, "run", "err")[-3000:]
  err = _text(tmp_path, "run", "err")
  assert "Traceback" not in err, err[-3000:]
  line = err.strip().splitlines()[-1]
  assert "save failed: file too large" in line and "free space, then resume with: maxtext-moe train" in line, line
  checkpoints = tmp_path / "runs" / "full" / "checkpoints"
  assert not [p for p in checkpoints.iterdir() if "tmp" in p.name], "no half-written save is left"
  kept = sorted(int(p.name) for p in checkpoints.iterdir())
  if kept:
    assert f"checkpoint {kept[-1]} is intact" in line
    resumed = run_cli([*args[:1], "steps=6", "checkpoint_period=2", "run_name=full", *FAST], cwd=tmp_path)
    assert resumed.returncode == 0 and f"resuming from checkpoint {kept[-1]}" in resumed.stdout, resumed.stderr


def test_a_run_name_is_one_path_component(tmp_path):
  r = run_cli(["train", "run_name=../escape"], cwd=tmp_path)
  assert r.returncode == 2 and "must be a single name (no '/' or '..')" in r.stderr.strip().splitlines()[-1]
  assert not (tmp_path / "escape").exists()


def test_the_run_lock_names_its_holder_and_is_freed_when_the_holder_dies(tmp_path):
  holder = subprocess.Popen(
    [
      sys.executable,
      "-c",
      "import sys, time; from maxtext_moe import locks; locks.acquire(sys.argv[1], what='x');"
      " print('held', flush=True); time.sleep(60)",
      str(tmp_path / ".lock"),
    ],
    stdout=subprocess.PIPE,
    text=True,
  )
  try:
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(UserError, match=f"x is in use by pid {holder.pid} on "):
      locks.acquire(tmp_path / ".lock", what="x")
    start = time.monotonic()
    with pytest.raises(UserError):
      locks.acquire(tmp_path / ".lock", what="x", wait_s=0.5)
    assert time.monotonic() - start >= 0.5, "it waited before giving up"
  finally:
    holder.kill()
    holder.wait()
  locks.acquire(tmp_path / ".lock", what="x")  # SIGKILL freed it
  locks.release(tmp_path / ".lock")


def test_a_lock_removed_by_its_holder_is_taken_afresh_by_a_waiter(tmp_path):
  """The holder unlinks the lock file as it releases (as convert does): a process that was waiting on
  the old file must end up holding the file now at the path, so a third one is still refused."""
  lock = tmp_path / ".lock"
  locks.acquire(lock, what="x")
  waiter = subprocess.Popen(
    [
      sys.executable,
      "-c",
      "import sys, time; from maxtext_moe import locks; print('waiting', flush=True);"
      " locks.acquire(sys.argv[1], what='x', wait_s=60); print('held', flush=True); time.sleep(60)",
      str(lock),
    ],
    stdout=subprocess.PIPE,
    text=True,
  )
  try:
    assert waiter.stdout.readline().strip() == "waiting"
    time.sleep(1.0)  # let it open the old file and block on it
    locks.release(lock, remove=True)
    assert waiter.stdout.readline().strip() == "held"
    with pytest.raises(UserError, match=f"x is in use by pid {waiter.pid} on "):
      locks.acquire(lock, what="x")
  finally:
    waiter.kill()
    waiter.wait()


@pytest.mark.parametrize(
  "err,expected",
  [
    (OSError(28, "No space left on device"), "no space left on device"),
    (OSError(27, "File too large"), "file too large"),
    (ValueError("OUT_OF_RANGE: Failed to write 6049792 bytes to file 13: x [os_error_code='27']"), "file too large"),
    (OSError(13, "Permission denied"), None),
  ],
)
def test_full_disks_are_recognised_whoever_raises_them(err, expected):
  wrapped = RuntimeError("save failed")
  wrapped.__cause__ = err
  assert no_space(err) == expected and no_space(wrapped) == expected


def test_late_results_on_a_closed_event_loop_are_not_reported_but_other_errors_are():
  """TensorStore reports a result that finds Orbax's asyncio loop closed as an unraisable exception (seen:
  eight tracebacks before a full disk's one line, under load). Python's own unraisable reports (an error
  in __del__) and PyErr_Print (PyRun_SimpleString) take the same hooks: that one report is dropped from
  both, any other still shown."""
  script = (
    "import ctypes, gc\n"
    "from maxtext_moe import stderr\n"
    "stderr.hide_closed_loop_reports()\n"
    "class Late:\n"
    "  def __init__(self, message): self.message = message\n"
    "  def __del__(self): raise RuntimeError(self.message)\n"
    "Late('Event loop is closed'); gc.collect()\n"
    "ctypes.pythonapi.PyRun_SimpleString(b\"raise RuntimeError('Event loop is closed')\")\n"
    "Late('something else'); gc.collect()\n"
    "ctypes.pythonapi.PyRun_SimpleString(b\"raise RuntimeError('another thing')\")\n"
  )
  r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
  assert r.returncode == 0, r.stderr
  assert "Event loop is closed" not in r.stderr
  assert r.stderr.count("Traceback") == 2, r.stderr
  assert "RuntimeError: something else" in r.stderr and "RuntimeError: another thing" in r.stderr, r.stderr


def test_an_unfinished_save_is_removed_even_while_a_writer_still_recreates_it(tmp_path):
  """Orbax's async writer threads outlive the error that ends a run on a full disk and create files under
  the unfinished save after it was removed once: the removal waits for them, so what the last line says
  was removed is gone."""
  import threading
  import time

  from maxtext_moe.upstream.maxtext import recovery

  tmp = tmp_path / "4.orbax-checkpoint-tmp"
  stop = time.monotonic() + 1.0

  def writer():
    while time.monotonic() < stop:
      (tmp / "items.orbax-checkpoint-tmp").mkdir(parents=True, exist_ok=True)
      (tmp / "items.orbax-checkpoint-tmp" / "shard").write_bytes(b"x")
      time.sleep(0.05)

  (tmp / "items.orbax-checkpoint-tmp").mkdir(parents=True)
  thread = threading.Thread(target=writer)
  thread.start()
  try:
    assert recovery.remove_incomplete_saves(tmp_path) == ["4.orbax-checkpoint-tmp"]
  finally:
    thread.join()
  assert not tmp.exists()
