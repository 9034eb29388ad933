"""The node count as one input: what a recipe's per-node layout makes on N nodes (devices, NVLink domains,
the cross-node axis filled), the nearest node counts when N cannot work, the keys every command passes
MaxText, and two CPU processes trained as two nodes through `launch --nnodes 2`."""

import os
import re
import socket
import subprocess
import sys

import pytest

from conftest import REPO, run_cli
from maxtext_moe.config import nodes, recipes
from maxtext_moe.errors import UserError


def test_hgx_nodes_are_data_parallel_replicas_of_the_per_node_layout():
  layout = nodes.scale("h100", nodes=16, ici={"expert": 8, "fsdp": 1}, dcn={"data": -1, "fsdp": 1})
  assert (layout.devices, layout.slices, layout.per_slice) == (128, 16, 8)
  assert layout.dcn == {"data": 16, "fsdp": 1} and layout.cross_axis == "data"
  assert layout.overrides() == ["nodes=16", "recipe_num_devices=128", "num_slices=16"]
  assert layout.describe() == ("16 node(s) x 8 GPUs = 128 GPUs in 16 NVLink domain(s) of 8; across them: data 16")


def test_an_nvl72_domain_spans_nodes_and_racks_are_the_slices():
  ici, dcn = {"expert": 8, "fsdp": 8}, {"data": -1, "fsdp": 2}
  layout = nodes.scale("gb300", nodes=256, ici=ici, dcn=dcn)
  assert (layout.devices, layout.slices, layout.per_slice, layout.dcn["data"]) == (1024, 16, 64, 8)
  with pytest.raises(UserError, match=r"^15 NVLink domains do not divide by .* product 2; use --nodes 224 or 256$"):
    nodes.scale("gb300", nodes=240, ici=ici, dcn=dcn)


@pytest.mark.parametrize(
  ("hardware", "n", "ici", "dcn", "expected"),
  [
    (
      "gb200",
      20,
      {"expert": 8, "fsdp": 8},
      {"data": -1},
      "80 GPUs is not a whole number of NVLink domains of 64 GPUs; use --nodes 16 or 32",
    ),
    (
      "h100",
      2,
      {"expert": 8, "fsdp": 2},
      {"data": -1},
      "lay out 16 GPUs per NVLink domain, more GPUs than one NVLink domain",
    ),
    ("gb200", 4, {"expert": 2}, {"data": -1}, "lay out 2 GPUs per NVLink domain, part of a node"),
    (
      "h100",
      3,
      {"expert": 8},
      {"data": 2},
      "the DCN degrees lay out 2 NVLink domain(s) but the job has 3; set one dcn_*_parallelism to -1",
    ),
    ("h100", 0, {"expert": 8}, {"data": -1}, "nodes=0: a job has at least one node"),
  ],
)
def test_node_counts_that_cannot_work_are_one_line_with_the_nearest_that_can(hardware, n, ici, dcn, expected):
  with pytest.raises(UserError, match=re.escape(expected)):
    nodes.scale(hardware, nodes=n, ici=ici, dcn=dcn)


def test_the_old_device_count_keys_must_agree_with_nodes():
  ici, dcn = {"expert": 8}, {"data": -1}
  assert nodes.scale("h200", nodes=-1, ici=ici, dcn=dcn, recipe_devices=32).nodes == 4
  with pytest.raises(UserError, match="recipe_num_devices=16 and nodes=4 disagree .*set only nodes"):
    nodes.scale("h200", nodes=4, ici=ici, dcn=dcn, recipe_devices=16)
  with pytest.raises(UserError, match="num_slices=2 but 4 node\\(s\\) make 4 NVLink domain\\(s\\)"):
    nodes.scale("h200", nodes=4, ici=ici, dcn=dcn, num_slices=2)
  half = nodes.scale("h200", nodes=2, ici={"expert": 4}, dcn=dcn, gpus_per_node_override=4)  # pods of 4 GPUs
  assert (half.devices, half.slices) == (8, 2)


def test_global_batch_grows_with_the_nodes():
  assert nodes.global_batch(2, 128) == 256 and nodes.global_batch(0.5, 16, 4) == 32


@pytest.mark.parametrize("recipe", [r for r in recipes.list_recipes() if not r.startswith("cpu/")])
def test_every_gpu_recipe_resolves_on_twice_its_nodes(recipe, resolution, tmp_path):
  """What `--nodes 2N` does to each GPU recipe: twice the devices and NVLink domains, the same per-node
  layout, the cross-node axis doubled."""
  (tmp_path / "items").mkdir()
  (tmp_path / "items" / "_METADATA").write_text("{}")
  extra = [f"load_parameters_path={tmp_path / 'items'}"] if recipe.endswith(("-finetune", "-sft")) else []
  one = resolution.resolve(recipes.recipe_path(recipe), extra)
  two = resolution.resolve(recipes.recipe_path(recipe), [*extra, f"nodes={2 * one.nodes}"])
  assert (two.recipe_num_devices, two.num_slices) == (2 * one.recipe_num_devices, 2 * one.num_slices)
  assert two.ici_parallelism == one.ici_parallelism and two.dcn_parallelism == one.dcn_parallelism


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.ci  # about 90 s on 2 cores: in .ci/run's ci tier, outside the README's 12 minutes
def test_two_cpu_processes_train_as_two_nodes(tmp_path):
  """`launch --nnodes 2` on each of two "nodes" (one process of 4 CPU devices each): the job is 8 devices
  in 2 NVLink domains, the ICI layout inside each process and data parallel across them (MaxText's
  multi-slice mesh, the processes as slices), and it trains to the end."""
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", PYTHONUNBUFFERED="1")
  coordinator = f"127.0.0.1:{_free_port()}"
  train = ["train", "steps=3", "progress=plain", "run_name=two", "per_device_batch_size=1", "max_target_length=128"]
  procs = []
  for rank in (0, 1):
    launch = ["launch", "--nproc-per-node", "1", "--nnodes", "2", "--node-rank", str(rank)]
    log = open(tmp_path / f"node{rank}.txt", "w", encoding="utf-8")  # noqa: SIM115 (closed below)
    cmd = [sys.executable, "-m", "maxtext_moe", *launch, "--coordinator", coordinator, "--", *train]
    procs.append((subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT), log))
  for proc, log in procs:
    try:
      proc.wait(timeout=500)
    finally:
      proc.kill()
      log.close()
  text = (tmp_path / "node0.txt").read_text()
  assert [p.returncode for p, _ in procs] == [0, 0], text[-4000:] + (tmp_path / "node1.txt").read_text()[-2000:]
  assert "on 8 cpu device(s) in 2 processes on 2 nodes; global batch 8 x 128 = 1,024 tokens per step" in text
  assert "step     3/3" in text and "run summary" in text


def test_cpu_nodes_are_processes():
  """On CPU a node is one process: asking for 2 nodes from one process says how to start them."""
  r = run_cli(["train", "--nodes", "2", "steps=1"], cwd=REPO, devices=2)
  assert r.returncode == 2
  assert "nodes=2 on CPU runs one process per node, but this job has 1 process(es)" in r.stderr.strip().splitlines()[-1]


def test_auto_takes_all_to_all_where_te_ep_cannot_serve_the_multi_node_layout():
  """FSDP inside a node and data parallel across nodes splits tokens over three axes, which TE's NCCL EP
  cannot take: `auto` runs all_to_all there (and the planner says so), TE EP where it can."""
  from maxtext_moe.moe.settings import DispatchKind, Platform, resolve_dispatch

  gpu = Platform("gpu", te_ep=True)
  two_nodes = {"data": 2, "fsdp": 4, "expert": 2}
  assert resolve_dispatch("auto", ep=2, platform=gpu, axis_sizes=two_nodes, num_experts=128) == DispatchKind.ALL_TO_ALL
  folded = {"data": 1, "fsdp": 8, "expert": 2}
  assert resolve_dispatch("auto", ep=2, platform=gpu, axis_sizes=folded, num_experts=128) == DispatchKind.TE_EP
  assert resolve_dispatch("te_ep", ep=2, platform=gpu, axis_sizes=two_nodes) == DispatchKind.TE_EP, "asked for"
