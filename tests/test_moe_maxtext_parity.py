"""The patched block inside MaxText's trainer: same numbers as stock MaxText, and EP=8 equals EP=1."""

import pytest

from conftest import run_cli
from maxtext_moe.runlog.files import read_jsonl

pytestmark = pytest.mark.slow

# A large bias-update rate makes routing change between steps, so a wrong bias update would show in the loss.
COMMON = [
  "steps=3",
  "max_target_length=128",
  "learning_rate=1e-2",
  "progress=silent",
  "checkpoint_period=100",
  "override_model_config=true",
  "routed_bias_update_rate=0.05",
]


def _train(tmp_path, name, *extra, devices=1, processes=1):
  """One run; with processes > 1 through `maxtext-moe launch`, each process with `devices` CPU devices."""
  launch = ["launch", "--nproc-per-node", str(processes), "--"] if processes > 1 else []
  r = run_cli([*launch, "train", f"run_name={name}", *COMMON, *extra], cwd=tmp_path, devices=devices)
  assert r.returncode == 0, f"{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
  if processes > 1:  # one start line per process; the rest of the output from process 0 alone
    for i in range(processes):
      assert f"maxtext-moe: process {i}/{processes} on " in r.stderr
    assert r.stdout.count("run summary") == 1 and f"in {processes} processes" in r.stdout
  return read_jsonl(tmp_path / "runs" / name / "metrics.jsonl")


def _assert_same_training(a, b):
  assert len(a) == len(b) == 3
  for x, y in zip(a, b, strict=True):
    assert x["loss"] == pytest.approx(y["loss"], rel=1e-5)
    assert x["raw_grad_norm"] == pytest.approx(y["raw_grad_norm"], rel=1e-5)


@pytest.mark.ci  # kept out of the README suite's 10 minutes; CI runs the ci tier
def test_dropless_block_matches_stock_maxtext(tmp_path):
  stock = _train(tmp_path, "stock", "per_device_batch_size=2", "moe_impl=maxtext", "sparse_matmul=false")
  ours = _train(tmp_path, "ours", "per_device_batch_size=2")
  _assert_same_training(ours, stock)
  assert all(r["moe/tokens_dropped"] == 0 for r in ours)
  assert all("moe/tokens_dropped" not in r for r in stock), "stock MaxText does not run our block"


@pytest.fixture(scope="module")
def fsdp8(tmp_path_factory):
  """FSDP=8 in one process on MaxText's synthetic batch: no expert parallelism, so no buffers at all."""
  return _train(tmp_path_factory.mktemp("fsdp8"), "ep1", "per_device_batch_size=1", "dataset_type=synthetic", devices=8)


@pytest.mark.extended
def test_expert_parallel_8_over_two_processes_matches_fsdp_8_in_one(tmp_path, fsdp8):
  """EP=8 over two `maxtext-moe launch` processes of 4 CPU devices each (gloo collectives): the
  all-to-all crosses the process boundary; the training equals FSDP=8 in one process. MaxText's synthetic
  batch is the same global batch however many processes load it (the grain pipeline shards files by
  process and chunks them after, so its batches differ with the process count)."""
  ep8 = _train(
    tmp_path,
    "ep8",
    "per_device_batch_size=1",
    "dataset_type=synthetic",
    "ici_expert_parallelism=8",
    "ici_fsdp_parallelism=1",
    devices=4,
    processes=2,
  )
  _assert_same_training(ep8, fsdp8)
  for row in ep8:
    assert row["moe/tokens_dropped"] == 0
    assert 0 < row["moe/dispatch_rows"] < row["moe/dispatch_rows_no_dedup"]
    assert row["moe/dispatch_bytes"] == row["moe/dispatch_rows"] * 64 * 4  # emb 64, float32


@pytest.mark.extended
def test_bounded_memory_ep_trains_like_no_expert_parallelism(tmp_path, fsdp8):
  """EP=4 x FSDP=2 in MaxText's trainer with buffers so tight (moe_buffer_factor=0.3) that every step takes
  several rounds trains exactly like FSDP=8 (no EP, no buffers; the worst-case buffers equal it too, as the
  block's tests show at EP 2/4/8 for both modes), dropping nothing."""
  layout = ["per_device_batch_size=1", "dataset_type=synthetic", "ici_expert_parallelism=4", "ici_fsdp_parallelism=2"]
  tight = _train(tmp_path, "tight", *layout, "moe_buffer_factor=0.3", devices=8)
  _assert_same_training(tight, fsdp8)
  assert all(r["moe/rounds"] > 1 and r["moe/tokens_dropped"] == 0 for r in tight), [r["moe/rounds"] for r in tight]
  assert all(r["moe/load_over_budget"] > 1 for r in tight)
