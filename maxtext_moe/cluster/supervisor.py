"""`maxtext-moe launch --nproc-per-node N -- train RECIPE ...`: one process per GPU on this node.

For one pod per node (the Kubernetes manifests run it; SLURM's srun does the same job itself). Each child
is `python -m maxtext_moe COMMAND...` with our variables (`launch.cluster`): the coordinator, the process
count (nodes x N), its process id (node rank x N + local rank) and its local rank, which is its GPU. The
node rank comes from --node-rank, else Kubernetes' JOB_COMPLETION_INDEX (an indexed Job or a JobSet), else
0. SIGTERM and SIGINT are forwarded to every child; when a child fails, the others are stopped and the
supervisor exits non-zero, saying which one failed and how.
"""

import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import IO

from maxtext_moe.cluster import placement
from maxtext_moe.errors import EXIT_RESUMABLE, UserError

NNODES = f"{placement.PREFIX}NNODES"
# A job of several groups of nodes (a JobSet with one Job per NVLink domain): a pod's node rank is its
# group's index x nodes per group + its completion index within the group.
NODES_PER_GROUP = f"{placement.PREFIX}NODES_PER_GROUP"
GROUP_INDEX = f"{placement.PREFIX}GROUP_INDEX"
GRACE_S = 120  # how long children get after a forwarded signal (a checkpoint may be in flight)


@dataclass(frozen=True)
class Plan:
  """Where this node's children sit in the job."""

  nproc_per_node: int
  nnodes: int
  node_rank: int
  coordinator: str

  def child_env(self, local_rank: int, base: dict[str, str]) -> dict[str, str]:
    return base | {
      NNODES: str(self.nnodes),  # train's node count when it is given none (`cli.run_commands.recipe_args`)
      placement.COORDINATOR: self.coordinator,
      placement.NUM_PROCESSES: str(self.nnodes * self.nproc_per_node),
      placement.PROCESS_ID: str(self.node_rank * self.nproc_per_node + local_rank),
      placement.LOCAL_RANK: str(local_rank),
    }


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def plan(
  env: dict[str, str],
  *,
  nproc_per_node: int,
  nnodes: int | None = None,
  node_rank: int | None = None,
  coordinator: str | None = None,
) -> Plan:
  """The job from flags, then the environment (JOB_COMPLETION_INDEX, MAXTEXT_MOE_NNODES,
  MAXTEXT_MOE_COORDINATOR); one node alone gets a free localhost port."""
  if nproc_per_node < 1:
    raise UserError(f"--nproc-per-node must be >= 1, got {nproc_per_node}")
  try:
    nnodes = nnodes if nnodes is not None else int(env.get(NNODES, "1"))
    rank = node_rank if node_rank is not None else int(env.get("JOB_COMPLETION_INDEX", "0"))
    if node_rank is None and GROUP_INDEX in env:
      rank += int(env[GROUP_INDEX]) * int(env.get(NODES_PER_GROUP, "1"))
  except ValueError as e:
    raise UserError(
      f"launch: {NNODES}, JOB_COMPLETION_INDEX, {GROUP_INDEX} and {NODES_PER_GROUP} must be integers ({e})"
    ) from None
  if nnodes < 1 or not 0 <= rank < nnodes:
    raise UserError(f"launch: node rank {rank} is not in 0..{nnodes - 1} ({nnodes} nodes)")
  coordinator = coordinator or env.get(placement.COORDINATOR)
  if coordinator is None:
    if nnodes > 1:
      raise UserError(f"launch: {nnodes} nodes need --coordinator HOST:PORT (node 0's) or {placement.COORDINATOR}")
    coordinator = f"127.0.0.1:{_free_port()}"
  return Plan(nproc_per_node, nnodes, rank, coordinator)


def _describe(code: int) -> str:
  if code < 0:
    return f"was killed by {signal.Signals(-code).name}"
  return f"exited with code {code}"


def supervise(
  job: Plan,
  command: list[str],
  *,
  env: dict[str, str],
  stdout: IO[str] | None = None,
  program: tuple[str, ...] = (sys.executable, "-m", "maxtext_moe"),
) -> int:
  """Runs `program COMMAND` once per local rank to the end (standard output onto `stdout`); returns the
  supervisor's exit code: 0, the first failed child's, 75 when a forwarded signal stopped every child after saving, or
  128 + the signal."""
  if not command:
    raise UserError("launch needs the command to run after '--', e.g. launch --nproc-per-node 8 -- train RECIPE")
  first = job.node_rank * job.nproc_per_node
  children: list[subprocess.Popen] = []
  received: list[int] = []

  def forward(signum, frame):  # noqa: ARG001
    del frame
    received.append(signum)
    for child in children:
      if child.poll() is None:
        child.send_signal(signum)

  # The handler first, then the children: a signal while they start reaches those already started, and
  # each later one at its start.
  previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
  try:
    for i in range(job.nproc_per_node):
      children.append(subprocess.Popen([*program, *command], env=job.child_env(i, env), stdout=stdout))
      if received:
        children[-1].send_signal(received[0])
    return _watch(children, first, received)
  finally:
    for s, handler in previous.items():
      signal.signal(s, handler)


def _watch(children: list[subprocess.Popen], first: int, received: list[int]) -> int:
  """Polls the children: the first failure stops the rest (SIGTERM, SIGKILL after GRACE_S)."""
  failure: tuple[int, int] | None = None  # (process id, exit code) of the first child to fail
  deadline = None
  while any(c.poll() is None for c in children):
    for i, c in enumerate(children):
      if failure is None and not received and c.poll() not in (None, 0):
        failure = (first + i, c.returncode)
        # Killed by a signal (the OOM killer, a node fault): the others cannot finish a step or a save
        # without it, and left alone they end in minutes of collective-timeout stack traces. So they are
        # killed at once; an exit with a code (an error it said) leaves them GRACE_S to end cleanly.
        killed = c.returncode < 0
        how = " at once (they cannot go on without it; rerun to resume from the last checkpoint)" if killed else ""
        print(
          f"maxtext-moe launch: process {first + i} {_describe(c.returncode)}; stopping the other processes{how}",
          file=sys.stderr,
          flush=True,
        )
        for other in children:
          if other.poll() is None:
            other.send_signal(signal.SIGKILL if killed else signal.SIGTERM)
    if (failure or received) and deadline is None:
      deadline = time.monotonic() + GRACE_S
    if deadline is not None and time.monotonic() > deadline:
      for c in children:
        if c.poll() is None:
          c.kill()
    time.sleep(0.2)
  if received:  # stopped on request: resumable if every child saved and said so
    return EXIT_RESUMABLE if all(c.returncode == EXIT_RESUMABLE for c in children) else 128 + received[0]
  if failure is None:  # every child ended in the same poll
    failure = next(((first + i, c.returncode) for i, c in enumerate(children) if c.returncode), None)
    if failure is None:
      return 0
    print(f"maxtext-moe launch: process {failure[0]} {_describe(failure[1])}", file=sys.stderr, flush=True)
  code = failure[1]
  return code if code > 0 else 128 - code
