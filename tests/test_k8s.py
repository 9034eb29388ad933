"""`maxtext-moe k8s`: the manifests for 1 and 16 nodes, both kinds, and GB200 racks, validated against
Kubernetes' own schemas (kubernetes-validate; the JobSet's Job template as a Job, JobSet being a CRD it has
no schema for) and NVIDIA's ComputeDomain CRD schema (its published v1beta1 spec, tests/fixtures)."""

import copy
import json
import os
import shlex
import signal
import subprocess
import sys
import time

import jsonschema
import kubernetes_validate
import pytest
import yaml

from conftest import REPO, run_cli
from maxtext_moe.cluster import k8s, supervisor
from maxtext_moe.errors import UserError

K8S_VERSION = "1.33.0"
ENV = {"XLA_FLAGS": "--xla_gpu_enable_latency_hiding_scheduler=true", "NCCL_NVLS_ENABLE": "1"}


def _request(nodes: int, kind: str) -> k8s.Request:
  return k8s.Request("dsv3", "h200x8/deepseek3-proxy-16b", ["steps=10"], nodes, "reg/maxtext-moe:0.1.0", kind)


def _rack_request(nodes: int, kind: str, **change) -> k8s.Request:
  """GB200: 4 GPUs per node, an NVLink domain of 16 nodes (the recipe's 64-GPU layout)."""
  base = k8s.Request("dsv3", "gb200-nvl72/deepseek3-671b", [], nodes, "reg/maxtext-moe:0.1.0", kind, 4)
  return k8s.Request(**(base.__dict__ | {"nodes_per_domain": 16} | change))


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
    "--nodes",
    str(nodes),
    "steps=10",
    "run_name=dsv3",  # pinned: every start of the pods continues the same run
    "jax_cache_dir=/checkpoints/dsv3/jax_cache",  # and loads its compiled step (MaxText's is ~/jax_cache)
    "base_output_directory=/checkpoints",
  ]
  env = {e["name"]: e["value"] for e in container["env"]}
  staged = {"MAXTEXT_MOE_CACHE": "/staging"}  # JSONL staged once per pod, on the node's disk
  assert env == ENV | staged | {"MAXTEXT_MOE_COORDINATOR": coordinator, "MAXTEXT_MOE_NNODES": str(nodes)}
  assert container["resources"] == {"limits": {"nvidia.com/gpu": 8}}
  assert pod["restartPolicy"] == "Never"
  volumes = {v["name"]: v for v in pod["volumes"]}
  assert volumes["dshm"]["emptyDir"] == {"medium": "Memory"}
  assert volumes["checkpoints"]["persistentVolumeClaim"] == {"claimName": "maxtext-moe-checkpoints"}
  assert volumes["staging"] == {"name": "staging", "emptyDir": {}}
  assert {m["mountPath"] for m in container["volumeMounts"]} == {"/dev/shm", "/checkpoints", "/staging"}


# A trainer that stops on a bad row (exit 65) or on bad input (2) fails its Job at once, and a JobSet does not
# restart it.
DATA_ERROR = {
  "rules": [{"action": "FailJob", "onExitCodes": {"containerName": "trainer", "operator": "In", "values": [2, 65]}}]
}


@pytest.mark.parametrize("nodes", [1, 16])
def test_jobset(nodes):
  (jobset,) = k8s.manifests(_request(nodes, "jobset"), ENV)
  assert jobset["apiVersion"] == "jobset.x-k8s.io/v1alpha2" and jobset["kind"] == "JobSet"
  assert jobset["spec"]["failurePolicy"] == {
    "maxRestarts": 3,
    "rules": [{"name": "data-error", "action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"]}],
  }
  (replicated,) = jobset["spec"]["replicatedJobs"]
  assert replicated["name"] == "workers" and replicated["replicas"] == 1
  spec = replicated["template"]["spec"]
  assert spec["podFailurePolicy"] == DATA_ERROR
  assert (spec["completionMode"], spec["completions"], spec["parallelism"]) == ("Indexed", nodes, nodes)
  _check_pod(_pod(spec), nodes, "dsv3-workers-0-0.dsv3:6123")
  as_job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "dsv3"}, "spec": copy.deepcopy(spec)}
  _validate(as_job)


@pytest.mark.parametrize("nodes", [1, 16])
def test_indexed_job_and_headless_service(nodes):
  service, job = k8s.manifests(_request(nodes, "job"), ENV)
  _validate(service)
  _validate(job)
  assert service["spec"]["clusterIP"] == "None" and service["spec"]["selector"] == {"job-name": "dsv3"}
  assert job["spec"]["completions"] == nodes and job["spec"]["completionMode"] == "Indexed"
  assert job["spec"]["podFailurePolicy"] == DATA_ERROR
  assert _pod(job["spec"])["subdomain"] == "dsv3"  # pod NAME-0 resolves as NAME-0.NAME
  _check_pod(_pod(job["spec"]), nodes, "dsv3-0.dsv3:6123")


def test_a_schema_violation_is_caught():
  """The validation has teeth: a Job whose completions is text fails it."""
  _, job = k8s.manifests(_request(2, "job"), ENV)
  job["spec"]["completions"] = "two"
  with pytest.raises(kubernetes_validate.ValidationError):
    _validate(job)


@pytest.mark.parametrize(
  ("change", "expected"),
  [
    ({"name": "Deep_Seek"}, "--name 'Deep_Seek': use at most 40 lowercase letters"),
    ({"nodes": 0}, "--nodes must be >= 1, got 0"),
    ({"rdma_resource": "ib"}, "--rdma-resource 'ib': give the NICs' resource name and count per pod, e.g. rdma/ib=4"),
    ({"kind": "pod"}, "--kind must be jobset or job, got 'pod'"),
    ({"data_claims": ("data.",)}, "--data-claim 'data.': give a PersistentVolumeClaim's name"),
    ({"data_claims": ("ds:data",)}, "--data-claim 'ds:data': the mount path must be absolute, e.g. ds:/data/ds"),
    ({"data_claims": ("ds:/",)}, "--data-claim 'ds:/': the mount path must be absolute"),
    ({"data_claims": ("ds:/dev",)}, "--data-claim 'ds:/dev': /dev would share a path with the memory-backed /dev/shm"),
    ({"data_claims": ("a:/d", "b:/d/x")}, "--data-claim 'b:/d/x': /d/x would share a path with --data-claim a:/d"),
  ],
)
def test_bad_requests_are_one_line(change, expected):
  req = _request(2, "jobset")
  req = k8s.Request(**(req.__dict__ | change))
  with pytest.raises(UserError, match=expected):
    k8s.manifests(req, ENV)


COMPUTE_DOMAIN_SCHEMA = json.loads((REPO / "tests" / "fixtures" / "computedomain-v1beta1.schema.json").read_text())


@pytest.mark.parametrize("racks", [1, 4])
def test_gb200_racks_claim_a_compute_domain_and_keep_each_domain_in_one_rack(racks):
  """4 NVL72 racks of 16 trays (the recipe's 64-GPU domain): a ComputeDomain whose IMEX channel each pod
  claims, one Job per rack placed exclusively on one value of the clique label, RDMA NICs by the given
  name, and each pod's node rank from its Job's index (the downward API) x 16 + its completion index."""
  req = _rack_request(16 * racks, "jobset", rdma_resource="rdma/ib=4")
  domain, jobset = k8s.manifests(req, ENV)
  jsonschema.validate(domain, COMPUTE_DOMAIN_SCHEMA)
  assert domain["kind"] == "ComputeDomain" and domain["apiVersion"] == "resource.nvidia.com/v1beta1"
  template = domain["spec"]["channel"]["resourceClaimTemplate"]["name"]
  assert jobset["metadata"]["annotations"] == {"alpha.jobset.sigs.k8s.io/exclusive-topology": "nvidia.com/gpu.clique"}
  (replicated,) = jobset["spec"]["replicatedJobs"]
  assert replicated["replicas"] == racks and replicated["template"]["spec"]["completions"] == 16
  spec = replicated["template"]["spec"]
  _validate({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "dsv3"}, "spec": copy.deepcopy(spec)})
  pod = _pod(spec)
  assert pod["resourceClaims"] == [{"name": "imex-channel", "resourceClaimTemplateName": template}]
  (container,) = pod["containers"]
  assert container["resources"] == {
    "limits": {"nvidia.com/gpu": 4, "rdma/ib": 4},
    "claims": [{"name": "imex-channel"}],
  }
  env = {e["name"]: e for e in container["env"]}
  assert env["MAXTEXT_MOE_NNODES"]["value"] == str(16 * racks)
  assert env["MAXTEXT_MOE_GROUP_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == (
    "metadata.annotations['jobset.sigs.k8s.io/job-index']"
  )
  # What launch makes of that environment in the last pod of the last rack: node rank 16 x racks - 1.
  pod_env = {k: e["value"] for k, e in env.items() if "value" in e}
  pod_env |= {"MAXTEXT_MOE_GROUP_INDEX": str(racks - 1), "JOB_COMPLETION_INDEX": "15"}
  plan = supervisor.plan(pod_env, nproc_per_node=4)
  assert (plan.nnodes, plan.node_rank) == (16 * racks, 16 * racks - 1)
  assert plan.coordinator == "dsv3-workers-0-0.dsv3:6123"


def test_gb200_one_rack_as_an_indexed_job_uses_pod_affinity_and_more_racks_are_refused():
  domain, service, job = k8s.manifests(_rack_request(16, "job", topology_key="example.com/rack"), ENV)
  jsonschema.validate(domain, COMPUTE_DOMAIN_SCHEMA)
  _validate(service)
  _validate(job)
  (term,) = _pod(job["spec"])["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
  assert term == {"labelSelector": {"matchLabels": {"maxtext-moe/job": "dsv3"}}, "topologyKey": "example.com/rack"}
  with pytest.raises(UserError, match="32 nodes are 2 domains of 16: use --kind jobset"):
    k8s.manifests(_rack_request(32, "job"), ENV)
  (jobset,) = k8s.manifests(_rack_request(16, "jobset", compute_domain=False), ENV)
  assert "resourceClaims" not in _pod(jobset["spec"]["replicatedJobs"][0]["template"]["spec"])


def test_the_compute_domain_schema_has_teeth():
  (domain, _) = k8s.manifests(_rack_request(16, "jobset"), ENV)
  del domain["spec"]["channel"]["resourceClaimTemplate"]["name"]
  with pytest.raises(jsonschema.ValidationError):
    jsonschema.validate(domain, COMPUTE_DOMAIN_SCHEMA)


@pytest.mark.ci
def test_cli_prints_only_the_manifests_for_16_nodes(tmp_path):
  args = ["k8s", "h200x8/deepseek3-proxy-16b", "--nodes", "16", "--image", "reg/x:1", "--kind", "job"]
  r = run_cli(args, cwd=REPO)
  assert r.returncode == 0, r.stderr[-2000:]
  docs = list(yaml.safe_load_all(r.stdout))  # stdout is nothing but the YAML documents
  assert [d["kind"] for d in docs] == ["Service", "Job"]
  # what a failure costs, on standard error beside the manifests (the recipe's 50 steps, a period of 2,500)
  assert r.stderr.strip().splitlines()[-1] == (
    "maxtext-moe: note: checkpoint_period=2500 >= steps=50: the run saves at its last step only; a failure loses it "
    "all, under a minute by the step-time model"
  )
  for doc in docs:
    _validate(doc)
  env = {e["name"]: e["value"] for e in _pod(docs[1]["spec"])["containers"][0]["env"]}
  assert "--xla_gpu_enable_latency_hiding_scheduler=true" in env["XLA_FLAGS"].split()
  assert "xla_dump" not in env["XLA_FLAGS"] and "xla_force_host_platform" not in env["XLA_FLAGS"]
  assert docs[1]["spec"]["completions"] == 16 and env["MAXTEXT_MOE_NNODES"] == "16"
  r = run_cli([*args, "learning_rat=1"], cwd=tmp_path)
  assert r.returncode == 2 and "unknown config key 'learning_rat'" in r.stderr and r.stdout == ""
  r = run_cli(["k8s", "gb200-nvl72/deepseek3-671b", "--nodes", "20", "--image", "reg/x:1"], cwd=tmp_path)
  assert r.returncode == 2 and r.stdout == "", r.stderr[-2000:]
  assert r.stderr.strip().endswith("use --nodes 16 or 32"), r.stderr


def _pod_command(docs: list[dict]) -> list[str]:
  return _pod(docs[-1]["spec"]["replicatedJobs"][0]["template"]["spec"])["containers"][0]["command"]


@pytest.mark.ci
def test_the_same_manifest_run_twice_continues_the_run(tmp_path):
  """A JobSet restart (or the manifest applied again) reruns the pods' command as it is. Here that command,
  from `maxtext-moe k8s` for a 1-node job, is run on this machine with what only a GPU node has swapped for
  the CPU's (the recipe for the tiny model, 1 process, /checkpoints for a local folder): the first start is
  stopped by SIGTERM after its first checkpoint, the second, the same command, continues from it."""
  args = ["k8s", "h200x8/deepseek3-proxy-16b", "--nodes", "1", "--image", "reg/x:1", "--name", "fine-tune"]
  r = run_cli([*args, "steps=6", "checkpoint_period=2"], cwd=REPO)
  assert r.returncode == 0, r.stderr[-2000:]
  command = _pod_command(list(yaml.safe_load_all(r.stdout)))
  assert "run_name=fine-tune" in command and command[-1] == "base_output_directory=/checkpoints"
  cpu = ["cpu/deepseek3-tiny" if a == "h200x8/deepseek3-proxy-16b" else "1" if a == "8" else a for a in command[1:]]
  cpu = [
    f"jax_cache_dir={tmp_path / 'checkpoints' / 'fine-tune' / 'jax_cache'}" if "jax_cache" in a else a for a in cpu
  ]
  cpu = [*cpu[:-1], f"base_output_directory={tmp_path / 'checkpoints'}", "progress=plain", "max_target_length=128"]
  assert cpu[:5] == ["launch", "--nproc-per-node", "1", "--nnodes", "1"]
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1", PYTHONUNBUFFERED="1")
  log = tmp_path / "first.txt"
  with open(log, "w", encoding="utf-8") as out:
    proc = subprocess.Popen([sys.executable, "-m", "maxtext_moe", *cpu], cwd=tmp_path, env=env, stdout=out, stderr=out)
    deadline = time.monotonic() + 300
    while "step     3/" not in log.read_text() and proc.poll() is None and time.monotonic() < deadline:
      time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=240)
  first = log.read_text()
  assert proc.returncode != 0 and "stopped by SIGTERM" in first, first[-3000:]
  second = subprocess.run(
    [sys.executable, "-m", "maxtext_moe", *cpu], cwd=tmp_path, env=env, capture_output=True, text=True, check=False
  )
  assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
  saved = tmp_path / "checkpoints" / "fine-tune" / "checkpoints"
  assert "maxtext-moe: resuming from checkpoint" in second.stdout and str(saved) in second.stdout, shlex.join(cpu)
  steps = [json.loads(x)["step"] for x in (tmp_path / "checkpoints" / "fine-tune" / "metrics.jsonl").open()]
  assert steps == list(range(6)), "the second start continued the first: no step repeated or lost"


def test_checkpoint_paths_that_exist_only_in_the_pods_are_passed_not_checked_here():
  """A fine-tune's model_file and load_parameters_path are on the cluster's checkpoint volume: `k8s`
  checks the recipe here without them (on its own model) and gives them to the pods as written."""
  ckpt = ["load_parameters_path=/checkpoints/dsv3/items", "model_file=/checkpoints/dsv3/model.yml"]
  req = k8s.Request("dsv3-ft", "gb200-nvl72/deepseek3-671b-finetune", ckpt, 64, "reg/maxtext-moe:0.1.0")
  resolved, docs = k8s.for_recipe(req)
  assert (resolved.nodes, resolved.gpus_per_node, resolved.nodes_per_domain, resolved.domains) == (64, 4, 16, 4)
  command = _pod_command(docs)
  assert command[command.index("--nodes") + 2 :][:2] == ckpt and "finetune=false" not in command
  tok = ["tokenizer_type=huggingface", "tokenizer_path=/checkpoints/tok", "vocab_from_tokenizer=true"]
  _, docs = k8s.for_recipe(k8s.Request("proxy", "h200x8/deepseek3-proxy-16b", tok, 2, "reg/maxtext-moe:0.1.0"))
  assert all(t in _pod_command(docs) for t in tok), "the pods' tokenizer: passed on, not read here"


# JAX's persistent compilation cache: the GPU profiles' knobs, read when JAX is imported (configs/flags).
CACHE_ENV = {
  "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "10",
  "JAX_REMOVE_CUSTOM_PARTITIONING_PTR_FROM_CACHE_KEY": "true",
}


@pytest.mark.parametrize(
  ("given", "added"),
  [
    ([], ["run_name=proxy", "jax_cache_dir=/checkpoints/proxy/jax_cache"]),
    (["run_name=mine"], ["jax_cache_dir=/checkpoints/mine/jax_cache"]),
    (["jax_cache_dir=/data/cache"], ["run_name=proxy"]),
  ],
)
def test_a_restart_loads_the_compiled_step_from_the_run_on_the_checkpoint_volume(given, added):
  """The pods keep JAX's persistent compilation cache in the run (process 0 writes it, every pod reads it),
  so a JobSet restart loads the train step instead of compiling it; a jax_cache_dir of the user's stays."""
  req = k8s.Request("proxy", "h200x8/deepseek3-proxy-16b", given, 2, "reg/maxtext-moe:0.1.0", fit_check=False)
  _, docs = k8s.for_recipe(req)
  command = _pod_command(docs)
  assert command[command.index("train") :] == [
    "train", "h200x8/deepseek3-proxy-16b", "--nodes", "2", *given, *added, "base_output_directory=/checkpoints"
  ]  # fmt: skip
  env = {
    e["name"]: e.get("value")
    for e in _pod(docs[-1]["spec"]["replicatedJobs"][0]["template"]["spec"])["containers"][0]["env"]
  }
  assert {k: env[k] for k in CACHE_ENV} == CACHE_ENV


def test_what_a_failure_costs_is_in_minutes_where_the_recipe_records_its_step_time():
  """k8s does not import the step-time model: the minutes come from the step time a recipe's
  checkpoint_period line records; a fine-tune's own period without one is said in steps."""
  said = {}
  weights = ["load_parameters_path=/checkpoints/dsv3/items"]  # the pods' (`k8s_pod.here`)
  for recipe, over in (("h100x8/deepseek3-671b", ["steps=1000"]), ("h100x8/deepseek3-671b-finetune", weights)):
    req = k8s.Request("dsv3", recipe, over, 32, "reg/maxtext-moe:0.1.0", fit_check=False)
    said[recipe] = k8s.for_recipe(req)[0].at_risk
  assert said == {
    "h100x8/deepseek3-671b": "checkpoints every 265 steps of 1000: a failure costs at most 265 steps, about 25 "
    "minutes by the step-time model",
    "h100x8/deepseek3-671b-finetune": "checkpoints every 250 steps of 2000: a failure costs at most 250 steps",
  }


@pytest.mark.parametrize("kind", ["jobset", "job"])
def test_data_claims_are_mounted_read_only_beside_the_checkpoints(kind):
  """--data-claim NAME[:MOUNT]: each claim a read-only volume at its path (/data by default), the checkpoint
  claim (default maxtext-moe-checkpoints) unchanged; the pod validates as Kubernetes' own schema says."""
  req = k8s.Request(**(_request(2, kind).__dict__ | {"data_claims": ("datasets", "tokenizers:/models/tok")}))
  *_, job = k8s.manifests(req, ENV)
  spec = job["spec"]["replicatedJobs"][0]["template"]["spec"] if kind == "jobset" else job["spec"]
  _validate({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "dsv3"}, "spec": copy.deepcopy(spec)})
  pod = _pod(spec)
  volumes = {v["name"]: v for v in pod["volumes"]}
  assert volumes["checkpoints"]["persistentVolumeClaim"] == {"claimName": "maxtext-moe-checkpoints"}
  assert volumes["data-0"]["persistentVolumeClaim"] == {"claimName": "datasets", "readOnly": True}
  assert volumes["data-1"]["persistentVolumeClaim"] == {"claimName": "tokenizers", "readOnly": True}
  mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
  assert mounts["data-0"] == {"name": "data-0", "mountPath": "/data", "readOnly": True}
  assert mounts["data-1"] == {"name": "data-1", "mountPath": "/models/tok", "readOnly": True}
  assert mounts["checkpoints"]["mountPath"] == "/checkpoints" and "readOnly" not in mounts["checkpoints"]


@pytest.mark.ci  # kept out of the README suite's 10 minutes; CI runs the ci tier
def test_a_layout_plan_says_does_not_fit_is_refused_before_anything_is_written():
  """for_recipe takes plan's verdict: the proxy at a micro-batch of 32 needs ~363 GiB per H200 (one line,
  plan's cheapest fix); --no-fit-check (fit_check=False) writes it anyway, the node layout still checked."""
  big = ["offload=none", "per_device_batch_size=32"]
  req = k8s.Request("proxy", "h200x8/deepseek3-proxy-16b", big, 1, "reg/x:1")
  with pytest.raises(UserError, match=r"on 1 node\(s\) does not fit: .* cheapest fix \(smaller micro-batch\): "):
    k8s.for_recipe(req)
  resolved, docs = k8s.for_recipe(k8s.Request(**(req.__dict__ | {"fit_check": False})))
  assert resolved.nodes == 1 and [d["kind"] for d in docs] == ["JobSet"]
  assert "per_device_batch_size=32" in _pod_command(docs)


@pytest.mark.parametrize("kind", ["jobset", "job"])
def test_a_staging_claim_holds_the_staged_data_for_the_whole_job(kind):
  """--staging-claim NAME: the staging cache at /staging is that claim (staged once for the job, kept across
  restarts), not the pod's own disk; a bad claim name or a data claim over /staging is one line."""
  req = k8s.Request(**(_request(2, kind).__dict__ | {"staging_claim": "corpus-staged"}))
  *_, job = k8s.manifests(req, ENV)
  spec = job["spec"]["replicatedJobs"][0]["template"]["spec"] if kind == "jobset" else job["spec"]
  _validate({"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "dsv3"}, "spec": copy.deepcopy(spec)})
  pod = _pod(spec)
  volumes = {v["name"]: v for v in pod["volumes"]}
  assert volumes["staging"] == {"name": "staging", "persistentVolumeClaim": {"claimName": "corpus-staged"}}
  mounts = {m["name"]: m for m in pod["containers"][0]["volumeMounts"]}
  assert mounts["staging"] == {"name": "staging", "mountPath": "/staging"}
  env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
  assert env["MAXTEXT_MOE_CACHE"] == "/staging"
  with pytest.raises(UserError, match=r"^--staging-claim 'Corpus': give a PersistentVolumeClaim's name"):
    k8s.manifests(k8s.Request(**(req.__dict__ | {"staging_claim": "Corpus"})), ENV)
  with pytest.raises(UserError, match=r"^--data-claim 'ds:/staging': /staging would share a path with the staging"):
    k8s.manifests(k8s.Request(**(req.__dict__ | {"data_claims": ("ds:/staging",)})), ENV)
