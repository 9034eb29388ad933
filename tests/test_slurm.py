"""`scripts/slurm/train.sbatch` on a real one-node SLURM cluster (slurm_localhost.py): two tasks join one job
from SLURM's variables, a SIGTERM to the job stops both at one step with a checkpoint, the script requeues
the job, and the requeued job resumes to the losses of an uninterrupted run; the same job submitted again
(same job name and recipe, more steps) continues that run, and a user's run_name is kept."""

import json
import os
import time

import numpy as np
import pytest
import slurm_localhost

from conftest import REPO, run_cli

pytestmark = [
  pytest.mark.slow,
  pytest.mark.extended,
  pytest.mark.skipif(slurm_localhost.missing() is not None, reason=str(slurm_localhost.missing())),
]
FAST = ["per_device_batch_size=1", "max_target_length=128", "learning_rate=1e-2", "warmup_steps_fraction=0.0"]
# Enough steps that the SIGTERM sent at step 3 reaches the tasks before the run ends on its own (a second
# or two; ten steps of 0.2 s once left it too late: the job completed, nothing to requeue).
STEPS = 40


@pytest.fixture
def cluster(tmp_path):
  c = slurm_localhost.Cluster(tmp_path / "slurm").start()
  yield c
  c.stop()


def _wait(predicate, seconds: float, what: str, cluster=None, jobs: tuple[str, ...] = (), log=None) -> None:
  """Until `predicate()`; on a timeout the assertion shows the job's log and what SLURM says of it."""
  deadline = time.monotonic() + seconds
  while not predicate():
    if time.monotonic() >= deadline:
      shown = log.read_text()[-3000:] if log is not None and log.exists() else ""
      pytest.fail(f"timed out waiting for {what}\n{shown}\n{cluster.diagnosis(*jobs) if cluster else ''}")
    time.sleep(1)


def _submit(cluster, tmp_path, args: list[str]) -> str:
  """`sbatch train.sbatch ARGS` as job `req` (one node, two tasks, no GPUs); returns the job id."""
  sub = cluster.run(
    "sbatch", "--parsable", "--nodes=1", "--ntasks=2", "--ntasks-per-node=2", "--gpus-per-node=0", "--job-name=req",
    f"--output={tmp_path}/%x-%j.out", str(REPO / "scripts" / "slurm" / "train.sbatch"), *args,
  )  # fmt: skip
  assert sub.returncode == 0, sub.stderr
  return sub.stdout.strip().split(";")[0]


def test_train_sbatch_requeues_after_sigterm_and_resumes_to_the_same_losses(cluster, tmp_path):
  out = tmp_path / "out"
  env = {"OUT": str(out), "IMAGE": "", "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
  env |= {"PATH": f"{REPO / '.venv' / 'bin'}:{os.environ['PATH']}", "PYTHONUNBUFFERED": "1", "JAX_PLATFORMS": "cpu"}
  cluster.env |= env
  args = ["cpu/deepseek3-tiny", f"steps={STEPS}", "checkpoint_period=1000", "progress=plain", *FAST]
  job = _submit(cluster, tmp_path, args)
  log = tmp_path / f"req-{job}.out"
  _wait(lambda: log.exists() and "step     3/" in log.read_text(), 420, "step 3", cluster, (job,), log)
  text = log.read_text()
  assert "process 0/2" in text and "process 1/2" in text, "both tasks joined one job from SLURM's variables"
  assert cluster.run("scancel", "--signal=TERM", job).returncode == 0
  requeued = lambda: log.read_text().count("maxtext-moe: training ") >= 2  # noqa: E731
  _wait(lambda: requeued() or cluster.state(job) == "COMPLETED", 420, "the requeued run", cluster, (job,), log)
  assert requeued(), f"the run ended before the SIGTERM reached it: raise STEPS\n{log.read_text()[-2000:]}"
  _wait(
    lambda: cluster.state(job) in ("COMPLETED", "FAILED", "CANCELLED"),
    420,
    "the requeued job's end",
    cluster,
    (job,),
    log,
  )
  text = log.read_text()
  assert cluster.state(job) == "COMPLETED", text[-4000:]
  stopped = [line for line in text.splitlines() if "maxtext-moe: stopped by SIGTERM after step" in line]
  assert stopped, text[-4000:]
  assert "maxtext-moe: resuming from checkpoint" in text
  run = out / "req-cpu-deepseek3-tiny"  # JOBNAME-RECIPE: what a resubmission finds again
  rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
  assert [r["step"] for r in rows] == list(range(STEPS)), "every step once, across the stop and the requeue"
  more = [a if not a.startswith("steps=") else f"steps={STEPS + 2}" for a in args]
  job2 = _submit(cluster, tmp_path, more)
  log2 = tmp_path / f"req-{job2}.out"
  _wait(
    lambda: cluster.state(job2) in ("COMPLETED", "FAILED", "CANCELLED"),
    420,
    "the resubmitted job's end",
    cluster,
    (job2,),
    log2,
  )
  text2 = log2.read_text()
  assert cluster.state(job2) == "COMPLETED", text2[-4000:]
  assert f"maxtext-moe: resuming from checkpoint {STEPS - 1}" in text2, text2[-4000:]
  resumed = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
  assert resumed == list(range(STEPS + 2)), "the resubmission continued the run: no step repeated"
  # The same job uninterrupted, as two processes of one device each (launch): the same losses. Not one
  # process with two devices: each process reads its own shard of the data, so the batches differ.
  ref = run_cli(
    [
      "launch",
      "--nproc-per-node",
      "2",
      "--",
      "train",
      f"steps={STEPS}",
      "run_name=ref",
      "checkpoint_period=1000",
      *FAST,
    ],
    cwd=tmp_path,
  )
  assert ref.returncode == 0, ref.stderr[-3000:]
  want = [json.loads(line)["loss"] for line in (tmp_path / "runs" / "ref" / "metrics.jsonl").read_text().splitlines()]
  np.testing.assert_allclose([r["loss"] for r in rows], want, rtol=1e-6)
