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


def test_train_eight_devices_fsdp(tmp_path):
  r = run_cli(["train", "steps=8", "run_name=fsdp", "per_device_batch_size=1", *FAST[1:]], cwd=tmp_path, devices=8)
  _check_ok(r)
  assert "on 8 cpu device(s)" in r.stdout
  losses = _losses(tmp_path / "runs" / "fsdp")
  assert len(losses) == 8 and sum(losses[-3:]) / 3 < 0.9 * losses[0], losses


def test_flag_profile_is_applied_in_process_and_dump_hlo_still_dumps(tmp_path):
  """A GPU flag profile on CPU: the launcher puts the profile's XLA_FLAGS (which XLA:CPU accepts and
  ignores) into effect before the backend starts, keeping the caller's own flags, without re-executing
  itself; the run records what it ran with."""
  args = ["train", "steps=1", "run_name=flags", "per_device_batch_size=1", "flag_profile=gb200", *FAST[1:]]
  dump = tmp_path / "hlo"
  r = run_cli(
    [*args, "env_extra=[MAXTEXT_MOE_PROBE=1]", "dump_hlo=true", f"dump_hlo_local_dir={dump}"], cwd=tmp_path, devices=2
  )
  _check_ok(r)
  # dump_hlo=true dumps the train step even with a profile's XLA_FLAGS (MaxText adds its dump flags only
  # when XLA_FLAGS is empty, so the launcher adds them).
  assert any(p.name.endswith("jit_train_step.before_optimizations.txt") for p in dump.iterdir())
  env = json.loads((tmp_path / "runs" / "flags" / "flags.json").read_text())["env"]
  xla = env["XLA_FLAGS"].split()
  assert "--xla_gpu_experimental_enable_collective_multi_streaming=true" in xla
  assert "--xla_force_host_platform_device_count=2" in xla
  assert env["MAXTEXT_MOE_PROBE"] == "1" and env["NCCL_MNNVL_ENABLE"] == "1"
  assert "on 2 cpu device(s)" in r.stdout
