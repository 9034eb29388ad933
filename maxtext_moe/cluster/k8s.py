"""`maxtext-moe k8s RECIPE --nodes N --image IMAGE`: the Kubernetes manifests for a training job.

One pod per node, each running `maxtext-moe launch --nproc-per-node G -- train RECIPE ...` (one process
per GPU). Kubernetes sets JOB_COMPLETION_INDEX (the node rank) in an indexed Job, and so in each of a
JobSet's Jobs; the manifest sets the node count, the coordinator (pod 0's stable DNS name under the
headless service) and the recipe's flag environment. Two kinds:
- `jobset` (default): a JobSet (jobset.x-k8s.io/v1alpha2) with one indexed Job of N pods. JobSet creates
  the headless service (named after the JobSet) and restarts the whole gang on a failure, up to
  --max-restarts times; training resumes from the last checkpoint.
- `job`: an indexed Job plus a headless Service, for clusters without the JobSet controller; a failed
  pod fails the Job (pod failures are not retried one by one: the others could not continue without it).
Checkpoints go to a PersistentVolumeClaim mounted at /checkpoints; /dev/shm is a memory-backed volume (NCCL
and XLA use shared memory between a node's processes).
"""

from dataclasses import dataclass
from typing import Any

from maxtext_moe.cluster import placement, supervisor
from maxtext_moe.config.hardware import gpu
from maxtext_moe.errors import UserError

COORDINATOR_PORT = 6123
CHECKPOINT_MOUNT = "/checkpoints"
JOBSET_API = "jobset.x-k8s.io/v1alpha2"
REPLICATED_JOB = "workers"


@dataclass(frozen=True)
class Request:
  """What `maxtext-moe k8s` was asked for."""

  name: str
  recipe: str
  overrides: list[str]
  nodes: int
  image: str
  kind: str = "jobset"
  gpus_per_node: int | None = None
  checkpoint_claim: str = "maxtext-moe-checkpoints"
  max_restarts: int = 3


def _check_name(name: str) -> None:
  """A DNS-1035 label short enough for the pod names built from it."""
  ok = name[:1].isalpha() and all(c.islower() or c.isdigit() or c == "-" for c in name) and not name.endswith("-")
  if not ok or len(name) > 40:
    raise UserError(f"--name {name!r}: use at most 40 lowercase letters, digits and '-', starting with a letter")


def _container(req: Request, gpus: int, coordinator: str, env: dict[str, str]) -> dict[str, Any]:
  command = ["maxtext-moe", "launch", "--nproc-per-node", str(gpus), "--nnodes", str(req.nodes), "--"]
  command += ["train", req.recipe, *req.overrides, f"base_output_directory={CHECKPOINT_MOUNT}"]
  variables = env | {placement.COORDINATOR: coordinator, supervisor.NNODES: str(req.nodes)}
  return {
    "name": "trainer",
    "image": req.image,
    "command": command,
    "env": [{"name": k, "value": v} for k, v in sorted(variables.items())],
    "ports": [{"containerPort": COORDINATOR_PORT, "name": "coordinator"}],
    "resources": {"limits": {"nvidia.com/gpu": gpus}},
    "volumeMounts": [
      {"name": "dshm", "mountPath": "/dev/shm"},
      {"name": "checkpoints", "mountPath": CHECKPOINT_MOUNT},
    ],
  }


def pod_spec(req: Request, gpus: int, coordinator: str, env: dict[str, str], *, subdomain: str | None) -> dict:
  spec = {
    "restartPolicy": "Never",
    "containers": [_container(req, gpus, coordinator, env)],
    "volumes": [
      {"name": "dshm", "emptyDir": {"medium": "Memory"}},
      {"name": "checkpoints", "persistentVolumeClaim": {"claimName": req.checkpoint_claim}},
    ],
  }
  return spec | ({"subdomain": subdomain} if subdomain else {})


def job_spec(req: Request, pod: dict[str, Any], labels: dict[str, str]) -> dict[str, Any]:
  return {
    "completionMode": "Indexed",
    "completions": req.nodes,
    "parallelism": req.nodes,
    "backoffLimit": 0,
    "template": {"metadata": {"labels": labels}, "spec": pod},
  }


def manifests(req: Request, env: dict[str, str], hardware: str, num_devices: int) -> list[dict[str, Any]]:
  """The documents to apply, in order."""
  _check_name(req.name)
  if req.nodes < 1:
    raise UserError(f"--nodes must be >= 1, got {req.nodes}")
  if req.kind not in ("jobset", "job"):
    raise UserError(f"--kind must be jobset or job, got {req.kind!r}")
  model = gpu(hardware)
  gpus = req.gpus_per_node or (model.gpus_per_node if model else None)
  if not gpus:
    raise UserError(f"recipe hardware {hardware} has no GPUs per node I know: pass --gpus-per-node")
  if num_devices > 0 and num_devices != req.nodes * gpus:
    raise UserError(
      f"the recipe lays out {num_devices} GPUs but {req.nodes} nodes x {gpus} GPUs = {req.nodes * gpus}; "
      f"use --nodes {num_devices // gpus if num_devices % gpus == 0 else '?'} or override the layout"
    )
  labels = {"app.kubernetes.io/name": "maxtext-moe", "maxtext-moe/job": req.name}
  if req.kind == "job":
    coordinator = f"{req.name}-0.{req.name}:{COORDINATOR_PORT}"  # indexed Job pods: NAME-INDEX
    pod = pod_spec(req, gpus, coordinator, env, subdomain=req.name)
    service = {
      "apiVersion": "v1",
      "kind": "Service",
      "metadata": {"name": req.name, "labels": labels},
      "spec": {
        "clusterIP": "None",
        "selector": {"job-name": req.name},
        "ports": [{"name": "coordinator", "port": COORDINATOR_PORT}],
        "publishNotReadyAddresses": True,
      },
    }
    job = {
      "apiVersion": "batch/v1",
      "kind": "Job",
      "metadata": {"name": req.name, "labels": labels},
      "spec": job_spec(req, pod, labels),
    }
    return [service, job]
  coordinator = f"{req.name}-{REPLICATED_JOB}-0-0.{req.name}:{COORDINATOR_PORT}"  # JobSet pod 0's DNS name
  pod = pod_spec(req, gpus, coordinator, env, subdomain=None)
  jobset = {
    "apiVersion": JOBSET_API,
    "kind": "JobSet",
    "metadata": {"name": req.name, "labels": labels},
    "spec": {
      "failurePolicy": {"maxRestarts": req.max_restarts},
      "network": {"enableDNSHostnames": True},
      "replicatedJobs": [{"name": REPLICATED_JOB, "replicas": 1, "template": {"spec": job_spec(req, pod, labels)}}],
    },
  }
  return [jobset]


def for_recipe(req: Request) -> list[dict[str, Any]]:
  """Resolves the recipe (bad overrides fail here, not on the cluster) and builds its manifests."""
  from maxtext_moe.upstream import recipe as recipes  # pylint: disable=import-outside-toplevel

  overrides = [*req.overrides, f"base_output_directory={CHECKPOINT_MOUNT}"]
  recipe = recipes.read(req.recipe, overrides, keep_process_flags=False)  # the cluster's flags, not ours
  cfg = recipe.resolve()
  env = recipe.flags.full_env()
  return manifests(req, env, str(cfg.recipe_hardware), int(cfg.recipe_num_devices))
