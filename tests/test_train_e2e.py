"""End-to-end: the real CLI trains the tiny model through MaxText's trainer on CPU, then resumes."""

import json

import numpy as np
import pytest

from conftest import run_cli
from maxtext_moe.runlog.files import read_jsonl

pytestmark = pytest.mark.slow

FAST = ["per_device_batch_size=2", "max_target_length=128", "learning_rate=1e-2", "warmup_steps_fraction=0.0"]


def _losses(run_dir):
  return [r["loss"] for r in read_jsonl(run_dir / "metrics.jsonl")]


def _check_ok(r):
  assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-5000:]}"


def _tensorboard_scalars(run_dir) -> dict[str, dict[int, float]]:
  """{tag: {step: value}} of the run's events file, read with TensorBoard's own loader."""
  from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
  from tensorboard.util import tensor_util

  (events,) = (run_dir / "tensorboard").glob("events.out.tfevents.*")
  out: dict[str, dict[int, float]] = {}
  for event in EventFileLoader(str(events)).Load():
    for value in event.summary.value:
      kind = value.WhichOneof("value")
      array = np.asarray(value.simple_value if kind == "simple_value" else tensor_util.make_ndarray(value.tensor))
      if array.size == 1 and array.dtype.kind == "f":  # scalars only (MaxText also writes its config as text)
        out.setdefault(value.tag, {})[event.step] = float(array)
  return out


@pytest.mark.ci  # kept out of the README suite's 10 minutes; CI runs the ci tier
def test_train_eight_devices_fsdp(tmp_path):
  """Eight FSDP devices; TensorBoard, the per-expert load and `report` read off the same run."""
  args = ["train", "steps=8", "run_name=fsdp", "per_device_batch_size=1", "moe_load_every=3", *FAST[1:]]
  r = run_cli(args, cwd=tmp_path, devices=8)
  _check_ok(r)
  assert "on 8 cpu device(s)" in r.stdout
  run = tmp_path / "runs" / "fsdp"
  losses = _losses(run)
  assert len(losses) == 8 and sum(losses[-3:]) / 3 < 0.9 * losses[0], losses

  # TensorBoard (on by default, MaxText's writer, in RUN/tensorboard) holds metrics.jsonl's values.
  board, rows = _tensorboard_scalars(run), read_jsonl(run / "metrics.jsonl")
  for tag, key in [
    ("learning/loss", "loss"),
    ("learning/current_learning_rate", "learning_rate"),
    ("learning/grad_norm", "grad_norm"),
    ("moe/load_max_over_mean", "moe/load_max_over_mean"),
    ("moe/tokens_dropped", "moe/tokens_dropped"),
  ]:
    assert board[tag] == {row["step"]: float(np.float32(row[key])) for row in rows}, tag

  # The per-expert load of every recorded step: each MoE layer's counts add up to tokens x top-k.
  layers = read_jsonl(run / "moe_load.jsonl")
  assert [row["step"] for row in layers] == [0, 3, 6, 7]  # every 3 steps, and the last
  for row in layers:
    load = np.array(row["load"])
    assert load.shape == (3, 16) and (load.sum(axis=1) == 8 * 128 * 4).all(), row["step"]
    assert len(row["bias_abs_mean"]) == 3
  assert layers[0]["bias_abs_mean"] == [0.0] * 3 and min(layers[-1]["bias_abs_mean"]) > 0  # the bias moves

  # `report` rebuilds the same pictures from the files alone, and the summary.
  pictures = {name: (run / name).read_bytes() for name in ("loss.png", "moe_load.png", "moe_balance.png")}
  for name in pictures:
    (run / name).unlink()
  rep = run_cli(["report", str(run), "--json"], cwd=tmp_path)
  assert rep.returncode == 0, rep.stderr[-2000:]
  summary = json.loads(rep.stdout)
  assert {name: (run / name).read_bytes() for name in pictures} == pictures
  assert summary["first_loss"] == losses[0] and summary["final_loss"] == losses[-1] and summary["tokens_dropped"] == 0
  worst = summary["worst_balance"]
  load = np.array(layers[[r["step"] + 1 for r in layers].index(worst["step"])]["load"][worst["moe_layer"]])
  assert worst["max_over_mean"] == pytest.approx(load.max() / load.mean())


@pytest.mark.extended
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
