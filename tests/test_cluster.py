"""Who a process is in a multi-process job: SLURM and Kubernetes variable sets, explicit flags, one GPU
per process, and the supervisor's handling of failing children. Units; real processes are in
test_moe_maxtext_parity.py and test_convert.py."""

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
from jax._src.clusters.slurm_cluster import SlurmCluster

from maxtext_moe.cluster import placement, supervisor
from maxtext_moe.cluster.placement import Cluster
from maxtext_moe.errors import UserError

SLURM = {  # task 5 of an srun step over 2 nodes x 4 tasks
  "SLURM_JOB_ID": "12345",
  "SLURM_STEP_NODELIST": "gpu[003-004]",
  "SLURM_NTASKS": "8",
  "SLURM_PROCID": "5",
  "SLURM_LOCALID": "1",
  "SLURM_NTASKS_PER_NODE": "4(x2)",
}


def test_slurm_step_gives_the_job_and_one_gpu_per_task():
  got = placement.detect(SLURM)
  assert got == Cluster(f"gpu003:{12345 % 4096 + 61440}", 8, 5, 1, "slurm")
  assert got.local_device_id({"CUDA_VISIBLE_DEVICES": "0,1,2,3"}) == 1  # the node's GPUs: this task's is #1
  assert got.local_device_id({}) == 1
  assert got.local_device_id({"CUDA_VISIBLE_DEVICES": "2"}) == 0  # --gpus-per-task=1: SLURM narrowed it
  assert placement.detect(SLURM | {"JAX_COORDINATOR_PORT": "7777"}).coordinator == "gpu003:7777"


@pytest.mark.parametrize("nodelist", ["node001", "node001,host2", "node[001-0015],host2", "node[001,007-015],host2"])
def test_first_slurm_host_agrees_with_jax(nodelist, monkeypatch):
  monkeypatch.setenv("SLURM_STEP_NODELIST", nodelist)
  monkeypatch.setenv("SLURM_JOB_ID", "1")
  jax_host = SlurmCluster.get_coordinator_address(timeout_secs=None, override_coordinator_port="1").rsplit(":", 1)[0]
  assert placement.first_slurm_host(nodelist) == jax_host


@pytest.mark.parametrize(
  ("change", "expected"),
  [
    ({"SLURM_LOCALID": None}, "SLURM: SLURM_LOCALID is not set in this srun step"),
    ({"SLURM_PROCID": "8"}, "SLURM: process id 8 is not in 0..7"),
    ({"SLURM_PROCID": "five"}, "SLURM: SLURM_PROCID='five' is not an integer"),
    ({"SLURM_LOCALID": "4"}, "SLURM: SLURM_LOCALID=4 but SLURM_NTASKS_PER_NODE=4"),
  ],
)
def test_inconsistent_slurm_variables_are_one_line(change, expected):
  env = {k: v for k, v in (SLURM | change).items() if v is not None}
  with pytest.raises(UserError) as e:
    placement.detect(env)
  assert str(e.value).startswith(expected) and "\n" not in str(e.value)


def test_single_task_or_no_step_is_a_single_process():
  assert placement.detect(SLURM | {"SLURM_NTASKS": "1", "SLURM_PROCID": "0", "SLURM_LOCALID": "0"}) is None
  assert placement.detect({k: v for k, v in SLURM.items() if k != "SLURM_STEP_NODELIST"}) is None  # salloc shell
  assert placement.detect({}) is None


def test_kubernetes_node_gives_each_child_its_process_and_gpu():
  """Pod 3 of a 4-node JobSet with 8 GPUs per node: Kubernetes sets JOB_COMPLETION_INDEX, the manifest the
  node count and coordinator, `launch` the rest."""
  env = {"JOB_COMPLETION_INDEX": "3", "MAXTEXT_MOE_NNODES": "4", "MAXTEXT_MOE_COORDINATOR": "job-workers-0-0.job:6123"}
  job = supervisor.plan(env, nproc_per_node=8)
  children = [placement.detect(job.child_env(i, env)) for i in range(8)]
  assert children == [Cluster("job-workers-0-0.job:6123", 32, 24 + i, i, "launch") for i in range(8)]
  assert [c.local_device_id({}) for c in children] == list(range(8))  # one GPU per process, all different


@pytest.mark.parametrize(
  ("env", "kwargs", "expected"),
  [
    ({"MAXTEXT_MOE_NNODES": "2"}, {}, "launch: 2 nodes need --coordinator HOST:PORT"),
    ({"JOB_COMPLETION_INDEX": "4", "MAXTEXT_MOE_NNODES": "4"}, {}, "launch: node rank 4 is not in 0..3"),
    ({"MAXTEXT_MOE_NNODES": "many"}, {}, "launch: MAXTEXT_MOE_NNODES, JOB_COMPLETION_INDEX, .* must be integers"),
    ({}, {"nproc_per_node": 0}, "--nproc-per-node must be >= 1"),
  ],
)
def test_bad_launch_settings_are_one_line(env, kwargs, expected):
  with pytest.raises(UserError, match=expected):
    supervisor.plan(env, **({"nproc_per_node": 2} | kwargs))


def test_explicit_flags_win_and_must_come_together():
  got = placement.detect(SLURM, coordinator="10.0.0.1:1234", num_processes=2, process_id=1)
  assert got == Cluster("10.0.0.1:1234", 2, 1, 0, "flags")
  with pytest.raises(UserError, match="--coordinator, --num-processes and --process-id go together"):
    placement.detect({}, coordinator="10.0.0.1:1234")
  with pytest.raises(UserError, match="coordinator '10.0.0.1' is not HOST:PORT"):
    placement.detect({}, coordinator="10.0.0.1", num_processes=2, process_id=0)
  with pytest.raises(UserError, match=r"MAXTEXT_MOE_\* variables: MAXTEXT_MOE_COORDINATOR is not set"):
    placement.detect({"MAXTEXT_MOE_PROCESS_ID": "1"})


def test_two_processes_on_one_gpu_are_refused():
  assert placement.duplicate_gpus([("a", 0), ("a", 1), ("b", 0)]) is None
  assert placement.duplicate_gpus([("a", 0), ("a", 1), ("a", 0)]) == (
    "processes 0 and 2 both drive GPU 0 on a: give each its own"
  )


def test_an_unreachable_coordinator_is_one_line_not_a_hang():
  start = time.monotonic()
  with pytest.raises(UserError, match=r"process 1 could not reach the coordinator 127.0.0.1:9 within 1 s"):
    placement.wait_for_coordinator("127.0.0.1:9", timeout_s=1, process_id=1)
  assert time.monotonic() - start < 10


def _supervise(code: str, n: int = 2) -> tuple[int, float]:
  job = supervisor.Plan(n, 1, 0, "127.0.0.1:1")
  start = time.monotonic()
  rc = supervisor.supervise(job, [code], env={}, program=(sys.executable, "-c"))
  return rc, time.monotonic() - start


def test_a_failing_child_stops_the_others(capfd):
  # Child 1 fails at once; child 0 would run for a minute but is stopped.
  code = "import os, sys, time; sys.exit(3) if os.environ['MAXTEXT_MOE_LOCAL_RANK'] == '1' else time.sleep(60)"
  rc, seconds = _supervise(code)
  assert rc == 3 and seconds < 20
  err = capfd.readouterr().err
  assert "maxtext-moe launch: process 1 exited with code 3; stopping the other processes" in err


def test_a_child_killed_by_a_signal_has_the_others_killed_at_once(capfd):
  """A peer's death (the OOM killer, a node fault): the others could only hang in a collective and then
  print minutes of timeout traces, so they are killed at once, with one line (the SIGKILL of a training
  process mid-run: tested by hand, docs/failures.md)."""
  code = (
    "import os, signal, sys, time\n"
    "if os.environ['MAXTEXT_MOE_LOCAL_RANK'] == '1': os.kill(os.getpid(), signal.SIGKILL)\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"  # would outlive a SIGTERM and GRACE_S
  )
  rc, seconds = _supervise(code)
  assert rc == 137 and seconds < 20
  err = capfd.readouterr().err
  assert "maxtext-moe launch: process 1 was killed by SIGKILL; stopping the other processes at once" in err


def test_children_that_succeed_give_zero():
  assert _supervise("pass", n=3)[0] == 0


@pytest.mark.slow
@pytest.mark.extended
def test_sigterm_to_launch_reaches_both_training_processes(tmp_path):
  """What Kubernetes does before evicting a pod: SIGTERM to `launch` (PID 1 in the container) reaches both
  training processes, which agree on a step (JAX's preemption service), save there and exit 75; so does
  launch (a JobSet restarts it, and the rerun resumes)."""
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", PYTHONUNBUFFERED="1")
  args = ["launch", "--nproc-per-node", "2", "--", "train", "steps=100000", "dataset_type=synthetic", "run_name=term"]
  args += ["progress=plain"]
  err, out = tmp_path / "stderr.txt", tmp_path / "stdout.txt"
  with open(err, "w", encoding="utf-8") as f, open(out, "w", encoding="utf-8") as o:  # files: a full pipe blocks
    sup = subprocess.Popen([sys.executable, "-m", "maxtext_moe", *args], cwd=tmp_path, env=env, stderr=f, stdout=o)
  deadline = time.monotonic() + 400
  # After the first step: what remains is one step and a save, well inside the supervisor's grace period
  # (before it, the processes' first compile counts too, and a busy machine can take longer than the grace).
  while "step     1/" not in out.read_text() and time.monotonic() < deadline and sup.poll() is None:
    time.sleep(1)
  assert {f"{i}/2" for i in range(2)} <= set(err.read_text().split()), "both training processes must start"
  children = psutil.Process(sup.pid).children()
  assert len(children) == 2
  sup.send_signal(signal.SIGTERM)
  try:
    assert sup.wait(timeout=150) == 75
  finally:
    for child in children:
      if child.is_running():
        child.kill()
  gone, alive = psutil.wait_procs(children, timeout=5)
  assert alive == [] and len(gone) == 2


def test_sigterm_to_launch_while_its_processes_start_is_a_clean_resumable_stop(tmp_path):
  """A SIGTERM before the processes have joined the job: each stops at once (nothing to save yet) with
  75, and so does launch."""
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2", PYTHONUNBUFFERED="1")
  args = ["launch", "--nproc-per-node", "2", "--", "train", "steps=3", "dataset_type=synthetic", "run_name=early"]
  err = tmp_path / "stderr.txt"
  with open(err, "w", encoding="utf-8") as f:
    sup = subprocess.Popen([sys.executable, "-m", "maxtext_moe", *args], cwd=tmp_path, env=env, stderr=f)
  time.sleep(1.5)
  sup.send_signal(signal.SIGTERM)
  assert sup.wait(timeout=120) == 75, err.read_text()[-3000:]
  assert err.read_text().count("stopped by SIGTERM before anything was trained") == 2
