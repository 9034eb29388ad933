"""`maxtext-moe k8s RECIPE [--nodes N] --image IMAGE`: the Kubernetes manifests for a training job.

One pod per node, each running `maxtext-moe launch --nproc-per-node G --nnodes N -- train RECIPE --nodes N
... run_name=RUN` (one process per GPU). Kubernetes sets JOB_COMPLETION_INDEX (the node rank) in an indexed
Job, and so in each of a JobSet's Jobs; the manifest sets the node count (the recipe's, or --nodes: checked
against its layout here, not on the cluster), the coordinator (pod 0's DNS name) and the flag environment.

The run name is pinned (the user's `run_name`, else the job's name), so every start of these pods, a JobSet
restart or the same manifest applied again, continues the run from its last checkpoint under
/checkpoints/RUN instead of starting a new one, its train step loaded from /checkpoints/RUN/jax_cache.

Two kinds:
- `jobset` (default): a JobSet (jobset.x-k8s.io/v1alpha2). JobSet creates the headless service (named after
  the JobSet) and restarts the whole gang on a failure, up to --max-restarts times.
- `job`: an indexed Job plus a headless Service, for clusters without JobSet; a failed pod fails the Job
  (not retried one by one: the others could not continue without it).
Checkpoints go to a PersistentVolumeClaim at /checkpoints, JSONL is staged at /staging (`k8s_pod.staging`),
/dev/shm is memory-backed (NCCL and XLA use it), and other claims are mounted read-only (--data-claim
NAME[:MOUNT], /data by default). A bad row fails the job without a restart. Before anything is written the
layout is checked as `plan` checks it (fit.py): whole NVLink domains, tensors that divide, memory that fits.

Multi-node NVLink (GB200/GB300 NVL72), where the layout puts one NVLink domain over several nodes:
- a ComputeDomain (resource.nvidia.com/v1beta1, NVIDIA's DRA driver for GPUs) whose IMEX channel every pod
  claims (a ResourceClaimTemplate the driver makes; pods claim it by `resourceClaims`);
- the pods of one NVLink domain kept in one rack by the node label the user names (--topology-key, default
  `nvidia.com/gpu.clique`, which NVIDIA's GPU feature discovery sets per NVLink clique): the JobSet has one
  Job per domain with JobSet's exclusive-topology annotation; an indexed Job (one domain only) a required
  pod affinity. The node rank of a pod is then its Job's index x nodes per domain + its completion index.
RDMA NICs are asked for by the resource name the cluster's device plugin gives them (--rdma-resource).
A recipe file (one `plan --search --write` wrote) travels as a ConfigMap mounted in every pod.
"""

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from maxtext_moe.cluster import k8s_pod, placement, supervisor
from maxtext_moe.config import checkpointing
from maxtext_moe.config.recipes import portable_text, recorded_step_s
from maxtext_moe.errors import UserError

COORDINATOR_PORT = 6123
CHECKPOINT_MOUNT = "/checkpoints"
CHECKPOINT_CLAIM = "maxtext-moe-checkpoints"
RECIPE_MOUNT = "/etc/maxtext-moe/recipe"
JOBSET_API = "jobset.x-k8s.io/v1alpha2"
REPLICATED_JOB = "workers"
JOB_LABEL = "maxtext-moe/job"
COMPUTE_DOMAIN_API = "resource.nvidia.com/v1beta1"
CHANNEL_CLAIM = "imex-channel"
EXCLUSIVE_TOPOLOGY = "alpha.jobset.sigs.k8s.io/exclusive-topology"
JOB_INDEX_ANNOTATION = "jobset.sigs.k8s.io/job-index"


@dataclass(frozen=True)
class Request:
  """What `maxtext-moe k8s` was asked for, with the recipe's node layout resolved (`for_recipe`)."""

  name: str
  recipe: str
  overrides: list[str]  # the user's, without nodes= (the node count is `nodes`)
  nodes: int
  image: str
  kind: str = "jobset"
  gpus_per_node: int = 8
  checkpoint_claim: str = CHECKPOINT_CLAIM
  data_claims: tuple[str, ...] = ()  # "NAME[:MOUNT]": more claims, read-only, at MOUNT (default /data)
  staging_claim: str = ""  # the claim for staged JSONL at /staging ("": node-local disk, an emptyDir)
  max_restarts: int = 3
  run_name: str = ""  # "" -> the job's name
  nodes_per_domain: int = 1  # nodes one NVLink domain spans as laid out (> 1: GB200/GB300 NVL72)
  topology_key: str = "nvidia.com/gpu.clique"
  rdma_resource: str = ""  # "NAME=COUNT" per pod, e.g. "rdma/ib=4"; "" asks for none
  compute_domain: bool = True  # claim an IMEX channel of a ComputeDomain when nodes_per_domain > 1
  recipe_text: str = ""  # a recipe file's text (a ConfigMap the pods mount); "" for a shipped recipe
  fit_check: bool = True  # refuse a layout plan says does not fit device or host memory (for_recipe)
  at_risk: str = ""  # how often the job saves and what a failure costs (config/checkpointing.py)

  @property
  def domains(self) -> int:
    return self.nodes // self.nodes_per_domain

  @property
  def multi_node_nvlink(self) -> bool:
    return self.nodes_per_domain > 1


def _check_name(name: str) -> None:
  """A DNS-1035 label short enough for the pod names built from it."""
  ok = name[:1].isalpha() and all(c.islower() or c.isdigit() or c == "-" for c in name) and not name.endswith("-")
  if not ok or len(name) > 40:
    raise UserError(f"--name {name!r}: use at most 40 lowercase letters, digits and '-', starting with a letter")


def data_mounts(req: Request) -> list[tuple[str, str]]:
  """(claim, mount path) of each --data-claim, checked against the pod's other mounts."""
  taken = {"/dev/shm": "the memory-backed /dev/shm", CHECKPOINT_MOUNT: f"--checkpoint-claim {req.checkpoint_claim}"}
  taken |= {k8s_pod.STAGING_MOUNT: "the staging cache"} | (
    {RECIPE_MOUNT: "the recipe's ConfigMap"} if req.recipe_text else {}
  )
  return k8s_pod.data_mounts(req.data_claims, taken)


def _env(req: Request, coordinator: str, env: dict[str, str]) -> list[dict[str, Any]]:
  variables = env | {placement.COORDINATOR: coordinator, supervisor.NNODES: str(req.nodes)}
  variables |= k8s_pod.staging(req.staging_claim)[2]
  if req.multi_node_nvlink and req.kind == "jobset":
    variables[supervisor.NODES_PER_GROUP] = str(req.nodes_per_domain)
  out = [{"name": k, "value": v} for k, v in sorted(variables.items())]
  if req.multi_node_nvlink and req.kind == "jobset":  # this pod's Job: which NVLink domain it is in
    field = f"metadata.annotations['{JOB_INDEX_ANNOTATION}']"
    out.append({"name": supervisor.GROUP_INDEX, "valueFrom": {"fieldRef": {"fieldPath": field}}})
  return out


def _recipe_in_pod(req: Request) -> str:
  """The recipe as the pods name it: a shipped one by name, a file by its path in the mounted ConfigMap."""
  return f"{RECIPE_MOUNT}/{Path(req.recipe).name}" if req.recipe_text else req.recipe


def command(req: Request) -> list[str]:
  """The container's command: launch one process per GPU, each training the pinned run on `nodes` nodes, its
  compiled programs kept in the run (`k8s_pod.pinned`)."""
  run = ["launch", "--nproc-per-node", str(req.gpus_per_node), "--nnodes", str(req.nodes), "--"]
  train = ["train", _recipe_in_pod(req), "--nodes", str(req.nodes), *req.overrides]
  train += k8s_pod.pinned(req.overrides, req.run_name or req.name, CHECKPOINT_MOUNT)  # the run, its compile cache
  return ["maxtext-moe", *run, *train, f"base_output_directory={CHECKPOINT_MOUNT}"]


def _container(req: Request, coordinator: str, env: dict[str, str]) -> dict[str, Any]:
  resources: dict[str, Any] = {"limits": {"nvidia.com/gpu": req.gpus_per_node, **k8s_pod.rdma(req.rdma_resource)}}
  if req.multi_node_nvlink and req.compute_domain:
    resources["claims"] = [{"name": CHANNEL_CLAIM}]
  return {
    "name": k8s_pod.CONTAINER,
    "image": req.image,
    "command": command(req),
    "env": _env(req, coordinator, env),
    "ports": [{"containerPort": COORDINATOR_PORT, "name": "coordinator"}],
    "resources": resources,
    "volumeMounts": [
      {"name": "dshm", "mountPath": "/dev/shm"},
      {"name": "checkpoints", "mountPath": CHECKPOINT_MOUNT},
      k8s_pod.staging(req.staging_claim)[1],
    ]
    + ([{"name": "recipe", "mountPath": RECIPE_MOUNT, "readOnly": True}] if req.recipe_text else [])
    + [{"name": f"data-{i}", "mountPath": m, "readOnly": True} for i, (_, m) in enumerate(data_mounts(req))],
  }


def pod_spec(req: Request, coordinator: str, env: dict[str, str], *, subdomain: str | None) -> dict:
  spec: dict[str, Any] = {
    "restartPolicy": "Never",
    "containers": [_container(req, coordinator, env)],
    "volumes": [
      {"name": "dshm", "emptyDir": {"medium": "Memory"}},
      {"name": "checkpoints", "persistentVolumeClaim": {"claimName": req.checkpoint_claim}},
      k8s_pod.staging(req.staging_claim)[0],
    ]
    + ([{"name": "recipe", "configMap": {"name": f"{req.name}-recipe"}}] if req.recipe_text else [])
    + [
      {"name": f"data-{i}", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
      for i, (claim, _) in enumerate(data_mounts(req))
    ],
  }
  if req.multi_node_nvlink and req.compute_domain:
    spec["resourceClaims"] = [{"name": CHANNEL_CLAIM, "resourceClaimTemplateName": f"{req.name}-imex-channel"}]
  if req.multi_node_nvlink and req.kind == "job":  # one NVLink domain: every pod in the same rack
    selector = {"matchLabels": {JOB_LABEL: req.name}}
    term = {"labelSelector": selector, "topologyKey": req.topology_key}
    spec["affinity"] = {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [term]}}
  return spec | ({"subdomain": subdomain} if subdomain else {})


def job_spec(req: Request, pod: dict[str, Any], labels: dict[str, str], completions: int) -> dict[str, Any]:
  return {
    "completionMode": "Indexed",
    "completions": completions,
    "parallelism": completions,
    "backoffLimit": 0,
    "podFailurePolicy": k8s_pod.POD_FAILURE_POLICY,
    "template": {"metadata": {"labels": labels}, "spec": pod},
  }


def compute_domain(req: Request, labels: dict[str, str]) -> dict[str, Any]:
  """The ComputeDomain whose IMEX channel the pods claim (numNodes 0: the driver's DNS-name mode, where the
  workload, not the domain, knows how many nodes take part)."""
  return {
    "apiVersion": COMPUTE_DOMAIN_API,
    "kind": "ComputeDomain",
    "metadata": {"name": f"{req.name}-domain", "labels": labels},
    "spec": {"numNodes": 0, "channel": {"resourceClaimTemplate": {"name": f"{req.name}-imex-channel"}}},
  }


def _check(req: Request) -> None:
  _check_name(req.name)
  if req.nodes < 1:
    raise UserError(f"--nodes must be >= 1, got {req.nodes}")
  if req.kind not in ("jobset", "job"):
    raise UserError(f"--kind must be jobset or job, got {req.kind!r}")
  if req.nodes % req.nodes_per_domain:
    raise UserError(f"{req.nodes} nodes are not whole NVLink domains of {req.nodes_per_domain} nodes")
  if req.multi_node_nvlink and req.kind == "job" and req.domains > 1:
    raise UserError(
      f"--kind job keeps one NVLink domain in one rack, and {req.nodes} nodes are {req.domains} domains of "
      f"{req.nodes_per_domain}: use --kind jobset (one Job per rack)"
    )
  if not req.topology_key or " " in req.topology_key:
    raise UserError(f"--topology-key {req.topology_key!r}: give a node label key, e.g. nvidia.com/gpu.clique")


def manifests(req: Request, env: dict[str, str]) -> list[dict[str, Any]]:
  """The documents to apply, in order."""
  _check(req)
  k8s_pod.rdma(req.rdma_resource)
  data_mounts(req)
  labels = {"app.kubernetes.io/name": "maxtext-moe", JOB_LABEL: req.name}
  domain = [compute_domain(req, labels)] if req.multi_node_nvlink and req.compute_domain else []
  if req.recipe_text:  # a recipe file travels with the job, mounted read-only where the command names it
    meta = {"name": f"{req.name}-recipe", "labels": labels}
    config = {
      "apiVersion": "v1",
      "kind": "ConfigMap",
      "metadata": meta,
      "data": {Path(req.recipe).name: req.recipe_text},
    }
    domain = [config, *domain]
  if req.kind == "job":
    coordinator = f"{req.name}-0.{req.name}:{COORDINATOR_PORT}"  # indexed Job pods: NAME-INDEX
    pod = pod_spec(req, coordinator, env, subdomain=req.name)
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
      "spec": job_spec(req, pod, labels, req.nodes),
    }
    return [*domain, service, job]
  coordinator = f"{req.name}-{REPLICATED_JOB}-0-0.{req.name}:{COORDINATOR_PORT}"  # JobSet pod 0's DNS name
  pod = pod_spec(req, coordinator, env, subdomain=None)
  # One Job per NVLink domain, each kept in one rack (JobSet's exclusive placement by the topology label).
  replicas, per_job = (req.domains, req.nodes_per_domain) if req.multi_node_nvlink else (1, req.nodes)
  metadata: dict[str, Any] = {"name": req.name, "labels": labels}
  if req.multi_node_nvlink:
    metadata["annotations"] = {EXCLUSIVE_TOPOLOGY: req.topology_key}
  jobset = {
    "apiVersion": JOBSET_API,
    "kind": "JobSet",
    "metadata": metadata,
    "spec": {
      "failurePolicy": k8s_pod.jobset_failure_policy(req.max_restarts),
      "network": {"enableDNSHostnames": True},
      "replicatedJobs": [
        {"name": REPLICATED_JOB, "replicas": replicas, "template": {"spec": job_spec(req, pod, labels, per_job)}}
      ],
    },
  }
  return [*domain, jobset]


def for_recipe(req: Request) -> tuple[Request, list[dict[str, Any]]]:
  """Resolves the recipe on its node count (bad overrides and node counts fail here, not on the cluster),
  and builds its manifests: (the request with the layout's nodes, GPUs per node and NVLink domains filled
  in, the documents)."""
  from maxtext_moe.upstream import resolution  # pylint: disable=import-outside-toplevel

  run = [] if any(o.startswith("run_name=") for o in req.overrides) else [f"run_name={req.run_name or req.name}"]
  overrides = [*req.overrides, *run, f"base_output_directory={CHECKPOINT_MOUNT}"]
  if req.nodes > 0:
    overrides.append(f"nodes={req.nodes}")
  recipe = resolution.read(req.recipe, k8s_pod.here(overrides), keep_process_flags=False)  # the cluster's flags
  cfg = recipe.resolve()
  layout = recipe.keys.layout
  if layout.gpus_per_node is None:
    raise UserError(
      f"{req.recipe} runs on this machine ('maxtext-moe train'); k8s takes a GPU recipe (maxtext-moe recipes)"
    )
  per_domain = max(int(layout.per_slice or layout.gpus_per_node) // layout.gpus_per_node, 1)
  text = portable_text(req.recipe)
  resolved = replace(req, nodes=layout.nodes, gpus_per_node=layout.gpus_per_node, nodes_per_domain=per_domain)
  resolved = replace(resolved, recipe_text=text, at_risk=checkpointing.at_risk(cfg, recorded_step_s(recipe.path)))
  docs = manifests(resolved, recipe.flags.full_env())  # the request's own checks first: they are quick
  if req.fit_check:  # tensors that divide, memory that fits: plan's verdict, before anything is printed
    from maxtext_moe.cluster import fit  # pylint: disable=import-outside-toplevel

    fit.check(req.recipe, k8s_pod.here(overrides))
  return resolved, docs
