"""A real one-node SLURM cluster on this machine for the tests: munged, slurmctld and slurmd started from a
generated slurm.conf in a temporary directory, stopped afterwards. Needs Debian's slurm-wlm and munge
(`.ci/run` installs them) and root (slurmd runs the jobs' tasks as their user)."""

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

TOOLS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scancel", "sacct")


def missing() -> str | None:
  """Why this machine cannot run the cluster, or None."""
  gone = [t for t in TOOLS if shutil.which(t) is None and not Path(f"/usr/sbin/{t}").exists()]
  if gone:
    return f"needs SLURM and munge (apt-get install slurm-wlm munge): {', '.join(gone)} not found"
  if os.geteuid() != 0:
    return "needs root to start slurmd"
  return None


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _conf(root: Path, host: str, cpus: int) -> str:
  # cred_expire is also how long a requeued job waits before it may start again (120 s by default);
  # UnkillableStepTimeout: a busy machine's slow exit after SIGTERM must not drain the only node.
  return f"""ClusterName=mtmoe
SlurmctldHost={host}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={root}/munge.socket,cred_expire=30
CredType=cred/munge
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
MpiDefault=none
ReturnToService=2
JobRequeue=1
SchedulerType=sched/builtin
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
InactiveLimit=0
KillWait=30
UnkillableStepTimeout=300
MinJobAge=600
NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
"""


class Cluster:
  """munged + slurmctld + slurmd; `env` is what a client command (sbatch, squeue, scancel) needs."""

  def __init__(self, root: Path, cpus: int = 2):
    self.root = root
    for sub in ("state", "spool"):
      (root / sub).mkdir(parents=True, exist_ok=True)
    self.conf = root / "slurm.conf"
    self.conf.write_text(_conf(root, socket.gethostname(), cpus))
    self.env = dict(os.environ, SLURM_CONF=str(self.conf))
    self.procs: list[subprocess.Popen] = []

  def _daemon(self, *cmd: str) -> None:
    log = open(self.root / f"{Path(cmd[0]).name}.out", "w")  # noqa: SIM115 - closed with the process
    self.procs.append(subprocess.Popen(list(cmd), env=self.env, stdout=log, stderr=subprocess.STDOUT))

  def start(self, timeout_s: float = 60) -> "Cluster":
    key = self.root / "munge.key"  # our own key: the cluster needs no /etc/munge set-up
    key.write_bytes(os.urandom(1024))
    key.chmod(0o600)
    munged = [f"--socket={self.root}/munge.socket", f"--key-file={key}", f"--pid-file={self.root}/munged.pid"]
    munged += [f"--log-file={self.root}/munged.log", f"--seed-file={self.root}/munge.seed"]
    self._daemon("munged", "--foreground", "--force", *munged)
    self._daemon("slurmctld", "-D", "-i", "-f", str(self.conf))
    self._daemon("slurmd", "-D", "-f", str(self.conf))
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
      out = subprocess.run(["sinfo", "-h", "-o", "%T"], env=self.env, capture_output=True, text=True, check=False)
      if out.returncode == 0 and out.stdout.strip() in ("idle", "mixed", "allocated"):
        return self
      time.sleep(1)
    self.stop()
    logs = "\n".join(p.read_text()[-1500:] for p in self.root.glob("*.log") if p.is_file())
    raise RuntimeError(f"the SLURM cluster did not come up:\n{logs}")

  def run(self, *cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), env=self.env, capture_output=True, text=True, check=False)

  def state(self, job: str) -> str:
    """The job's state as squeue (while it is known) or scontrol says, e.g. RUNNING, PENDING, COMPLETED."""
    out = self.run("scontrol", "show", "job", job).stdout
    for field in out.split():
      if field.startswith("JobState="):
        return field.split("=", 1)[1]
    return "UNKNOWN"

  def diagnosis(self, *jobs: str) -> str:
    """What a test prints when it times out: the jobs and the node as SLURM sees them, and the daemons' logs'
    last lines (a node drained by a slow kill, a requeued job held, a daemon gone)."""
    parts = [self.run("scontrol", "show", "job", j).stdout for j in jobs]
    parts.append(self.run("sinfo", "-N", "-o", "%N %T %E").stdout)
    for log in ("slurmctld.log", "slurmd.log"):
      path = self.root / log
      if path.exists():
        parts.append(f"--- {log}\n" + "\n".join(path.read_text().splitlines()[-25:]))
    return "\n".join(parts)

  def stop(self) -> None:
    for p in reversed(self.procs):
      p.terminate()
    for p in reversed(self.procs):
      try:
        p.wait(timeout=30)
      except subprocess.TimeoutExpired:
        p.kill()
