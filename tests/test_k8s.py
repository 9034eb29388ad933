"""`maxtext-moe k8s`: the manifests for 1 and 16 nodes, both kinds, validated against Kubernetes' own
schemas (kubernetes-validate; the JobSet's Job template as a Job, JobSet being a CRD it has no schema for)."""

import copy

import kubernetes_validate
import pytest
import yaml

from conftest import REPO, run_cli
from maxtext_moe.cluster import k8s
from maxtext_moe.errors import UserError

K8S_VERSION = "1.33.0"
ENV = {"XLA_FLAGS": "--xla_gpu_enable_latency_hiding_scheduler=true", "NCCL_NVLS_ENABLE": "1"}


def _request(nodes: int, kind: str) -> k8s.Request:
  return k8s.Request("dsv3", "h200x8/deepseek3-proxy-16b", ["steps=10"], nodes, "reg/maxtext-moe:0.1.0", kind)


def _validate(doc: dict) -> None:
  kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def _pod(job_spec: dict) -> dict:
  return job_spec["template"]["spec"]


def _check_pod(pod: dict, nodes: int, coordinator: str) -> None:
  (container,) = pod["containers"]
  assert container["command"] == [
    "maxtext-moe",
    "launch",
    "--nproc-per-node",
    "8",
    "--nnodes",
    str(nodes),
    "--",
    "train",
    "h200x8/deepseek3-proxy-16b",
    "steps=10",
    "base_output_directory=/checkpoints",
  ]
  env = {e["name"]: e["value"] for e in container["env"]}
  assert env == ENV | {"MAXTEXT_MOE_COORDINATOR": coordinator, "MAXTEXT_MOE_NNODES": str(nodes)}
  assert container["resources"] == {"limits": {"nvidia.com/gpu": 8}}
  assert pod["restartPolicy"] == "Never"
  volumes = {v["name"]: v for v in pod["volumes"]}
  assert volumes["dshm"]["emptyDir"] == {"medium": "Memory"}
  assert volumes["checkpoints"]["persistentVolumeClaim"] == {"claimName": "maxtext-moe-checkpoints"}
  assert {m["mountPath"] for m in container["volumeMounts"]} == {"/dev/shm", "/checkpoints"}


@pytest.mark.parametrize("nodes", [1, 16])
def test_jobset(nodes):
  (jobset,) = k8s.manifests(_request(nodes, "jobset"), ENV, "h200", nodes * 8)
  assert jobset["apiVersion"] == "jobset.x-k8s.io/v1alpha2" and jobset["kind"] == "JobSet"
  assert jobset["spec"]["failurePolicy"] == {"maxRestarts": 3}
  (replicated,) = jobset["spec"]["replicatedJobs"]
  assert replicated["name"] == "workers" and replicated["replicas"] == 1
  spec = replicated["template"]["spec"]
  assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Indexed", nodes, nodes)
  _check_pod(_pod(spec), nodes, "dsv3-workers-0-0.dsv3:6123")
  as_job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "dsv3"}, "spec": copy.deepcopy(spec)}
  _validate(as_job)


@pytest.mark.parametrize("nodes", [1, 16])
def test_indexed_job_and_headless_service(nodes):
  service, job = k8s.manifests(_request(nodes, "job"), ENV, "h200", nodes * 8)
  _validate(service)
  _validate(job)
  assert service["spec"]["clusterIP"] == "None" and service["spec"]["selector"] == {"job-name": "dsv3"}
  assert job["spec"]["completions"] == nodes and job["spec"]["completionMode"] == "Indexed"
  assert _pod(job["spec"])["subdomain"] == "dsv3"  # pod NAME-0 resolves as NAME-0.NAME
  _check_pod(_pod(job["spec"]), nodes, "dsv3-0.dsv3:6123")


def test_a_schema_violation_is_caught():
  """The validation has teeth: a Job whose completions is text fails it."""
  _, job = k8s.manifests(_request(2, "job"), ENV, "h200", 16)
  job["spec"]["completions"] = "two"
  with pytest.raises(kubernetes_validate.ValidationError):
    _validate(job)


@pytest.mark.parametrize(
  ("change", "hardware", "devices", "expected"),
  [
    ({"nodes": 3}, "h200", 16, "the recipe lays out 16 GPUs but 3 nodes x 8 GPUs = 24; use --nodes 2"),
    ({"name": "Deep_Seek"}, "h200", 16, "--name 'Deep_Seek': use at most 40 lowercase letters"),
    ({}, "cpu", 16, "recipe hardware cpu has no GPUs per node I know: pass --gpus-per-node"),
  ],
)
def test_bad_requests_are_one_line(change, hardware, devices, expected):
  req = _request(2, "jobset")
  req = k8s.Request(**(req.__dict__ | change))
  with pytest.raises(UserError, match=expected):
    k8s.manifests(req, ENV, hardware, devices)


@pytest.mark.ci
def test_cli_prints_only_the_manifests_for_16_nodes(tmp_path):
  args = ["k8s", "h200x8/deepseek3-proxy-16b", "--nodes", "16", "--image", "reg/x:1", "--kind", "job"]
  r = run_cli([*args, "recipe_num_devices=128", "num_slices=16", "dcn_fsdp_parallelism=16"], cwd=REPO)
  assert r.returncode == 0, r.stderr[-2000:]
  docs = list(yaml.safe_load_all(r.stdout))  # stdout is nothing but the YAML documents
  assert [d["kind"] for d in docs] == ["Service", "Job"]
  for doc in docs:
    _validate(doc)
  env = {e["name"]: e["value"] for e in _pod(docs[1]["spec"])["containers"][0]["env"]}
  assert "--xla_gpu_enable_latency_hiding_scheduler=true" in env["XLA_FLAGS"].split()
  assert "xla_dump" not in env["XLA_FLAGS"] and "xla_force_host_platform" not in env["XLA_FLAGS"]
  r = run_cli([*args, "learning_rat=1"], cwd=tmp_path)
  assert r.returncode == 2 and "unknown config key 'learning_rat'" in r.stderr and r.stdout == ""
