"""Joining a multi-process job: who this process is, where the coordinator is, which GPU is its own.

Sources, first match wins:
1. explicit flags: `train --coordinator HOST:PORT --num-processes N --process-id I [--local-rank R]`;
2. our variables, set by `maxtext-moe launch` (and through it by the Kubernetes manifests):
   MAXTEXT_MOE_COORDINATOR, MAXTEXT_MOE_NUM_PROCESSES, MAXTEXT_MOE_PROCESS_ID, MAXTEXT_MOE_LOCAL_RANK;
3. SLURM inside an `srun` step with more than one task: coordinator = the step's first node (JAX's rule:
   port JAX_COORDINATOR_PORT or 61440 + job id mod 4096), SLURM_PROCID, SLURM_NTASKS, and SLURM_LOCALID as
   the local rank.
Every process drives exactly one GPU: its local rank's, or device 0 where the scheduler already narrowed
CUDA_VISIBLE_DEVICES to one GPU per task. So "only GPU 0 is used" (MaxText's own GPU start without
CUDA_VISIBLE_DEVICES) cannot happen, and two processes on one GPU are refused after the start.

JAX aborts the whole process (no exception) when the coordinator cannot be reached in time, so processes
other than 0 first wait for its port themselves, within the same timeout, and fail with one line.
"""

import socket
import sys
import time
import zlib
from dataclasses import dataclass
from typing import Any

from maxtext_moe.errors import UserError

PREFIX = "MAXTEXT_MOE_"
COORDINATOR, NUM_PROCESSES, PROCESS_ID, LOCAL_RANK = (
  f"{PREFIX}COORDINATOR",
  f"{PREFIX}NUM_PROCESSES",
  f"{PREFIX}PROCESS_ID",
  f"{PREFIX}LOCAL_RANK",
)
SLURM_VARS = ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID")


@dataclass(frozen=True)
class Cluster:
  """This process's place in a multi-process job."""

  coordinator: str  # host:port of process 0's coordination service
  num_processes: int
  process_id: int
  local_rank: int  # which of the node's GPUs is this process's (before CUDA_VISIBLE_DEVICES narrowing)
  source: str  # "flags", "launch" or "slurm"

  def local_device_id(self, env: dict[str, str]) -> int:
    """The GPU this process drives, as JAX numbers the GPUs it can see."""
    visible = [d for d in env.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return 0 if len(visible) == 1 else self.local_rank


def _int(env: dict[str, str], name: str, where: str) -> int:
  try:
    return int(env[name])
  except KeyError:
    raise UserError(f"{where}: {name} is not set") from None
  except ValueError:
    raise UserError(f"{where}: {name}={env[name]!r} is not an integer") from None


def _check(c: Cluster) -> Cluster:
  where = {"flags": "--process-id/--num-processes", "launch": f"{PREFIX}*", "slurm": "SLURM"}[c.source]
  if c.num_processes < 1:
    raise UserError(f"{where}: the process count must be >= 1, got {c.num_processes}")
  if not 0 <= c.process_id < c.num_processes:
    raise UserError(f"{where}: process id {c.process_id} is not in 0..{c.num_processes - 1}")
  if c.local_rank < 0:
    raise UserError(f"{where}: local rank {c.local_rank} is negative")
  host, sep, port = c.coordinator.rpartition(":")
  if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise UserError(f"{where}: coordinator {c.coordinator!r} is not HOST:PORT")
  return c


def first_slurm_host(nodelist: str) -> str:
  """The first host of a SLURM node list: 'node[003-007,9],gpu1' -> 'node003'. (JAX's parser is private.)"""
  head = nodelist.split(",")[0] if "[" not in nodelist.split(",")[0] else nodelist
  prefix, bracket, rest = head.partition("[")
  if not bracket:
    return prefix.strip()
  first = rest.split(",")[0].split("-")[0].rstrip("]")
  return f"{prefix}{first}".strip()


def from_slurm(env: dict[str, str]) -> Cluster | None:
  """The job an `srun` step describes; None outside a multi-task step."""
  if "SLURM_STEP_NODELIST" not in env or int(env.get("SLURM_NTASKS", "1") or 1) <= 1:
    return None
  missing = [v for v in SLURM_VARS if v not in env]
  if missing:
    raise UserError(f"SLURM: {missing[0]} is not set in this srun step; run training with srun, one task per GPU")
  port = env.get("JAX_COORDINATOR_PORT") or str(_int(env, "SLURM_JOB_ID", "SLURM") % 4096 + 61440)
  host = first_slurm_host(env["SLURM_STEP_NODELIST"])
  cluster = Cluster(
    f"{host}:{port}",
    _int(env, "SLURM_NTASKS", "SLURM"),
    _int(env, "SLURM_PROCID", "SLURM"),
    _int(env, "SLURM_LOCALID", "SLURM"),
    "slurm",
  )
  per_node = env.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]
  if per_node.isdigit() and cluster.local_rank >= int(per_node):
    raise UserError(f"SLURM: SLURM_LOCALID={cluster.local_rank} but SLURM_NTASKS_PER_NODE={per_node}")
  return _check(cluster)


def from_launch(env: dict[str, str]) -> Cluster | None:
  """The job `maxtext-moe launch` (or a manifest) describes in our variables; None when none is set."""
  ours = [v for v in (COORDINATOR, NUM_PROCESSES, PROCESS_ID, LOCAL_RANK) if v in env]
  if not ours:
    return None
  where = f"{PREFIX}* variables"
  if COORDINATOR not in env:
    raise UserError(f"{where}: {COORDINATOR} is not set (with {ours[0]})")
  return _check(
    Cluster(
      env[COORDINATOR],
      _int(env, NUM_PROCESSES, where),
      _int(env, PROCESS_ID, where),
      int(env.get(LOCAL_RANK, "0") or 0),
      "launch",
    )
  )


def detect(
  env: dict[str, str],
  *,
  coordinator: str | None = None,
  num_processes: int | None = None,
  process_id: int | None = None,
  local_rank: int | None = None,
) -> Cluster | None:
  """This process's job from flags, our variables or SLURM, in that order; None for a single process."""
  given = [a for a in (coordinator, num_processes, process_id) if a is not None]
  if given:
    if len(given) < 3:
      raise UserError("--coordinator, --num-processes and --process-id go together: pass all three")
    rank = local_rank if local_rank is not None else 0
    cluster = _check(Cluster(coordinator, num_processes, process_id, rank, "flags"))
  else:
    cluster = from_launch(env) or from_slurm(env)
  return cluster if cluster is not None and cluster.num_processes > 1 else None


def wait_for_coordinator(address: str, *, timeout_s: float, process_id: int) -> None:
  """Waits until process 0's coordinator accepts connections; one line if it does not in time."""
  host, _, port = address.rpartition(":")
  deadline = time.monotonic() + timeout_s
  while True:
    try:
      with socket.create_connection((host, int(port)), timeout=2):
        return
    except OSError as e:
      if time.monotonic() > deadline:
        raise UserError(
          f"process {process_id} could not reach the coordinator {address} within {timeout_s:.0f} s ({e}); "
          "check that process 0 is running there and the address is right, or raise --init-timeout"
        ) from None
      time.sleep(0.5)


def start(cluster: Cluster, *, cpu: bool, timeout_s: int, env: dict[str, str]) -> None:
  """jax.distributed.initialize for this process: gloo collectives on CPU, one GPU per process on GPU."""
  import jax  # pylint: disable=import-outside-toplevel

  if cpu:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  if cluster.process_id != 0:
    wait_for_coordinator(cluster.coordinator, timeout_s=timeout_s, process_id=cluster.process_id)
  else:
    _check_port_free(cluster.coordinator)
  jax.distributed.initialize(
    coordinator_address=cluster.coordinator,
    num_processes=cluster.num_processes,
    process_id=cluster.process_id,
    local_device_ids=None if cpu else [cluster.local_device_id(env)],
    initialization_timeout=timeout_s,
  )


def _check_port_free(address: str) -> None:
  _, _, port = address.rpartition(":")
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
      s.bind(("", int(port)))
    except OSError as e:
      raise UserError(f"process 0 cannot serve the coordinator on port {port} ({e}): pick another port") from None


def duplicate_gpus(claims: list[tuple[str, int]]) -> str | None:
  """claims[i] = (host, physical GPU) of process i -> a one-line complaint if two processes share a GPU."""
  seen: dict[tuple[str, int], int] = {}
  for process, claim in enumerate(claims):
    if claim in seen:
      return f"processes {seen[claim]} and {process} both drive GPU {claim[1]} on {claim[0]}: give each its own"
    seen[claim] = process
  return None


def check_distinct_gpus() -> None:
  """After the start, on GPU: every process's device must be a different physical GPU."""
  import jax  # pylint: disable=import-outside-toplevel
  import numpy as np  # pylint: disable=import-outside-toplevel
  from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

  host = socket.gethostname()
  mine = np.array([zlib.crc32(host.encode()) % (2**31), jax.local_devices()[0].local_hardware_id], np.int32)
  table = np.asarray(multihost_utils.process_allgather(mine)).reshape(-1, 2)
  problem = duplicate_gpus([(f"host#{h}" if h != mine[0] else host, int(g)) for h, g in table])
  if problem:
    raise UserError(problem)


def hello(cluster: Cluster, out: Any = sys.stderr) -> None:
  """The one line each process prints at start: who it is, where, on which device."""
  import jax  # pylint: disable=import-outside-toplevel

  devices = ", ".join(str(d) for d in jax.local_devices())
  print(
    f"maxtext-moe: process {cluster.process_id}/{cluster.num_processes} on {socket.gethostname()} "
    f"({cluster.source}, coordinator {cluster.coordinator}): {devices}",
    file=out,
    flush=True,
  )
