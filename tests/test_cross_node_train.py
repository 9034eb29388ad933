"""Expert parallelism across nodes in MaxText's trainer: two CPU processes standing for two nodes (`launch
--nnodes 2`, 4 devices each), EP 8 as 4 per node x 2 nodes, the exchange in two levels (`moe.levels`),
against EP 8 inside one process; and resumed from its own checkpoint."""

import os
import socket
import subprocess
import sys

import pytest

from conftest import run_cli
from maxtext_moe.runlog.files import read_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.ci]  # about 5 minutes on 2 cores: .ci/run's ci tier

# MaxText's synthetic batch is the same global batch however many processes load it. The tiny model's 4
# routing groups, one chosen per token (topk_routing_group=1): each node holds 2 whole groups, so a token's
# experts live on one node. A large bias-update rate makes routing change between steps.
COMMON = [
  "per_device_batch_size=1",
  "max_target_length=128",
  "dataset_type=synthetic",
  "override_model_config=true",
  "topk_routing_group=1",
  "routed_bias_update_rate=0.05",
  "learning_rate=1e-2",
  "learning_rate_schedule_steps=5",  # the 3-step run and its resume to 5 on the 5-step run's schedule
  "checkpoint_period=3",
  "progress=plain",
]
# Two chunks, not the default four across nodes: still chunked and chained (the chunks' own parity is
# tests/test_moe_cross_node.py's); a two-process run of 3 steps took 145 s with four chunks and 89 s with one.
TWO_NODES = [
  "ici_expert_parallelism=4",
  "ici_fsdp_parallelism=1",
  "dcn_expert_parallelism=2",
  "dcn_data_parallelism=1",
  "moe_exchange_chunks=2",
]


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _two_nodes(tmp_path, name: str, steps: int) -> list[str]:
  """`train` on two `launch --nnodes 2` processes of 4 CPU devices each; returns their outputs."""
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", PYTHONUNBUFFERED="1")
  coordinator = f"127.0.0.1:{_free_port()}"
  train = ["train", f"run_name={name}", f"steps={steps}", *COMMON, *TWO_NODES]
  procs = []
  for rank in (0, 1):
    launch = [
      "launch",
      "--nproc-per-node",
      "1",
      "--nnodes",
      "2",
      "--node-rank",
      str(rank),
      "--coordinator",
      coordinator,
    ]
    log = open(tmp_path / f"{name}-{steps}-node{rank}.txt", "w+", encoding="utf-8")  # noqa: SIM115 (closed below)
    cmd = [sys.executable, "-m", "maxtext_moe", *launch, "--", *train]
    procs.append((subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT), log))
  texts = []
  for proc, log in procs:
    try:
      proc.wait(timeout=600)
    finally:
      proc.kill()
      log.seek(0)
      texts.append(log.read())
      log.close()
  assert [p.returncode for p, _ in procs] == [0, 0], texts[0][-4000:] + texts[1][-2000:]
  return texts


def test_cross_node_training_matches_one_process_and_resumes(tmp_path):
  one = run_cli(
    ["train", "run_name=one", "steps=5", *COMMON, "ici_expert_parallelism=8", "ici_fsdp_parallelism=1"],
    cwd=tmp_path,
    devices=8,
  )
  assert one.returncode == 0, one.stderr[-4000:]
  want = read_jsonl(tmp_path / "runs" / "one" / "metrics.jsonl")

  first = _two_nodes(tmp_path, "two", 3)
  assert "on 8 cpu device(s) in 2 processes on 2 nodes" in first[0]
  _two_nodes(tmp_path, "two", 5)  # the same command with more steps resumes at step 3
  got = read_jsonl(tmp_path / "runs" / "two" / "metrics.jsonl")
  assert [r["step"] for r in got] == [0, 1, 2, 3, 4]
  for a, b in zip(got, want, strict=True):
    assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    assert a["raw_grad_norm"] == pytest.approx(b["raw_grad_norm"], rel=1e-5)
  tokens = 8 * 128 * 3  # a step's tokens through each of the 3 MoE layers
  for row in got:
    assert row["moe/tokens_dropped"] == 0
    assert row["moe/nodes_per_token"] == 1.0  # topk_routing_group: one group, one node
    # about half the tokens' group lives on the other node: one row each crosses, none twice
    assert 0.25 * tokens < row["moe/dispatch_rows_network"] < 0.75 * tokens
    assert row["moe/dispatch_rows"] == pytest.approx(
      next(r for r in want if r["step"] == row["step"])["moe/dispatch_rows"]
    )
  assert all("moe/dispatch_rows_network" not in r for r in want), "inside one node nothing crosses the network"
