"""`plan MODEL --gpu GPU --nodes N --search [--write FILE.yml]`: the candidate layouts of a cluster, the
ranking, the refusals, and a written recipe that every command takes; and recipe files outside configs/
(`base_config: ${moe_configs:...}`), which find our model files as the shipped recipes do."""

import json

import kubernetes_validate
import pytest
import yaml

from conftest import REPO, run_cli
from maxtext_moe.config import hardware
from maxtext_moe.config.recipes import recipe_path
from maxtext_moe.errors import UserError
from maxtext_moe.steptime import candidates, search


def test_hgx_candidates_split_each_node_and_go_data_or_fsdp_across():
  found = [c for c in search.layouts(hardware.GPUS["h100"], 2, 128) if c.dcn_ep == 1]
  assert {(c.ep, c.fsdp) for c in found} == {(1, 8), (2, 4), (4, 2), (8, 1)}
  assert {(c.dcn_fsdp, c.dcn_data) for c in found} == {(1, 2), (2, 1)}
  assert {c.remat for c in found} == set(candidates.REMATS) and len(found) == 4 * 2 * len(candidates.REMATS)
  many = search.layouts(hardware.GPUS["h100"], 8, 128)  # FSDP over half the nodes x data 2 besides
  assert {(c.dcn_fsdp, c.dcn_data) for c in many if c.stages == 1 and c.dcn_ep == 1} == {(1, 8), (8, 1), (2, 4), (4, 2)}


def test_expert_parallel_candidates_span_nodes_with_whole_routing_groups():
  """EP across nodes: every GPU of a node on the expert axis, over node counts that divide the nodes and,
  with the node's 8, the experts; with group-limited routing also its groups, or that the groups divide
  (whole groups per node, or each group on whole nodes)."""
  h100 = hardware.GPUS["h100"]
  across = {c.dcn_ep for c in search.layouts(h100, 32, 256) if c.dcn_ep > 1}
  assert across == {2, 4, 8, 16, 32}
  grouped = [c for c in search.layouts(h100, 32, 256, routing_groups=8) if c.dcn_ep > 1 and c.stages == 1]
  assert {c.dcn_ep for c in grouped} == {2, 4, 8, 16, 32} and {(c.ep, c.fsdp) for c in grouped} == {(8, 1)}
  assert {(c.dcn_fsdp, c.dcn_data) for c in grouped if c.dcn_ep == 8} == {(1, 4), (4, 1), (2, 2)}
  assert "dcn_expert_parallelism=8" in next(c for c in grouped if c.dcn_ep == 8).overrides()
  assert {c.dcn_ep for c in search.layouts(h100, 2, 128)} == {1, 2}  # 8 x 2 = 16 divides 128
  assert {c.dcn_ep for c in search.layouts(h100, 4, 60)} == {1}  # 8 x 2 does not divide 60


def test_nvl72_candidates_fill_a_rack_with_whole_nodes():
  gb200 = hardware.GPUS["gb200"]
  racks = search.layouts(gb200, 32, 256)  # 16 trays of a rack (72 GPUs: 18 trays do not divide 32 nodes)
  within = [c for c in racks if c.dcn_ep == 1]
  assert {c.ep * c.fsdp for c in racks} == {64} and {(c.dcn_fsdp, c.dcn_data) for c in within} == {(1, 2), (2, 1)}
  assert {(c.ep, c.dcn_ep, c.dcn_fsdp, c.dcn_data) for c in racks if c.dcn_ep > 1} == {(64, 2, 1, 1)}
  small = search.layouts(gb200, 4, 256)  # 4 trays: one NVLink domain of 16 GPUs
  assert {c.ep * c.fsdp for c in small} == {16} and {(c.dcn_fsdp, c.dcn_data) for c in small} == {(1, 1)}
  assert {c.ep for c in search.layouts(gb200, 4, 6)} == {1, 2}, "EP divides the experts"


@pytest.mark.parametrize(
  ("model", "gpu", "expected"),
  [
    ("qwen3-30b-a3b", "a100", "unknown GPU 'a100'; the planner knows h100, h200"),
    ("llama-7b", "h100", "unknown model 'llama-7b': give a recipe \\(maxtext-moe recipes\\), a model of configs"),
    ("qwen3-30b-a3b", None, "--search for the model qwen3-30b-a3b needs --gpu GPU"),
  ],
)
def test_unknown_models_and_gpus_are_one_line(model, gpu, expected):
  with pytest.raises(UserError, match=expected):
    search.base_of(model, gpu, 1, [])


def test_a_recipe_file_outside_configs_finds_our_model_and_resolves_as_the_shipped_one(resolution, tmp_path):
  """A recipe file anywhere names a shipped recipe by `${moe_configs:...}`; MaxText would not find our
  deepseek3-proxy-16b model file from there (it has none of that name): ours is read all the same, and the
  file resolves to the shipped recipe's whole config but for the keys it sets."""
  shipped = resolution.resolve(recipe_path("h100x8/deepseek3-proxy-16b"), ["nodes=2"])
  mine = tmp_path / "proxy.yml"
  mine.write_text("base_config: ${moe_configs:recipes/h100x8/deepseek3-proxy-16b.yml}\nnodes: 2\n")
  theirs = resolution.resolve(mine, [])
  paths = {"base_config", "run_name", "tensorboard_dir", "checkpoint_dir", "metrics_dir", "metrics_file"}
  paths.add("override_model_config")  # set with our model file's keys, which MaxText would not read from there
  a, b = shipped.model_dump(mode="json"), theirs.model_dump(mode="json")
  differ = {k for k in a if a[k] != b[k] and k not in paths and "dir" not in k}
  assert differ == set(), {k: (a[k], b[k]) for k in differ}
  assert (theirs.num_experts, theirs.base_emb_dim, theirs.recipe_num_devices) == (64, 2048, 16)


def test_a_model_name_with_no_file_anywhere_is_not_ours_to_fill(resolution, tmp_path):
  mine = tmp_path / "mine.yml"
  mine.write_text("base_config: ${moe_configs:recipes/cpu/deepseek3-tiny.yml}\nmodel_name: default\n")
  assert resolution.layer_keys(mine, []).recipe_over_model == []


@pytest.mark.ci
def test_search_writes_a_recipe_every_command_takes(tmp_path):
  """The whole path on the tiny model as if on one H100 node: the table and JSON, the fastest written as a
  recipe file whose layout is the first row's, which `config`, `plan --time` and `k8s` then take, and the
  same file on 2 nodes (its -1 cross-node axis)."""
  out = tmp_path / "tiny.yml"
  args = ["plan", "deepseek3-tiny", "--gpu", "h100", "--nodes", "1", "--search", "--write", str(out), "--json"]
  r = run_cli(args, cwd=tmp_path)
  assert r.returncode == 0, r.stderr[-3000:]
  result = json.loads(r.stdout)
  first = result["layouts"][0]
  rates = [row["tokens_per_s_per_gpu"] for row in result["layouts"]]
  assert rates == sorted(rates, reverse=True) and result["written"] == str(out)
  assert "EP x FSDP (x TP) per domain" in r.stderr, "the table goes to stderr with --json"
  keys = yaml.safe_load(out.read_text())
  assert keys["base_config"] == "${moe_configs:base.yml}" and keys["model_name"] == "deepseek3-tiny"
  assert (keys["ici_expert_parallelism"], keys["ici_fsdp_parallelism"]) == (first["ep"], first["fsdp_per_domain"])
  assert (keys["per_device_batch_size"], keys["nodes"], keys["dcn_data_parallelism"]) == (
    first["per_device_batch_size"],
    1,
    -1,
  )
  plan = run_cli(["plan", str(out), "--time", "--json"], cwd=tmp_path)
  assert plan.returncode == 0, plan.stderr[-2000:]
  timed = json.loads(plan.stdout)["time"]
  assert timed["tokens_per_s_per_gpu"] == pytest.approx(first["tokens_per_s_per_gpu"], rel=1e-3)
  two = run_cli(["config", str(out), "--nodes", "2"], cwd=tmp_path)
  assert two.returncode == 0 and "recipe_num_devices: 16" in two.stdout, two.stderr[-2000:]
  k8s = run_cli(["k8s", str(out), "--nodes", "2", "--image", "reg/x:1", "--name", "tiny"], cwd=tmp_path)
  assert k8s.returncode == 0, k8s.stderr[-2000:]
  config_map, jobset = yaml.safe_load_all(k8s.stdout)
  kubernetes_validate.validate(config_map, "1.33.0", strict=True)
  assert config_map["data"] == {"tiny.yml": out.read_text()}, "the pods get the file as written"
  pod = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
  assert pod["containers"][0]["command"][7:10] == ["train", "/etc/maxtext-moe/recipe/tiny.yml", "--nodes"]
  assert {"name": "recipe", "configMap": {"name": "tiny-recipe"}} in pod["volumes"]
  bad = run_cli([*args[:-3], "--write", str(tmp_path / "no" / "x.yml")], cwd=tmp_path)
  assert bad.returncode == 2 and "the folder" in bad.stderr and not (tmp_path / "no").exists()


def test_k8s_refuses_a_recipe_file_whose_base_the_image_lacks(tmp_path):
  from maxtext_moe.cluster import k8s

  mine = tmp_path / "mine.yml"
  mine.write_text(f"base_config: {REPO / 'configs' / 'recipes' / 'h100x8' / 'deepseek3-proxy-16b.yml'}\n")
  with pytest.raises(UserError, match="is a file of this machine, not of the image; name a shipped recipe"):
    k8s.for_recipe(k8s.Request("mine", str(mine), [], -1, "reg/x:1"))


def test_search_refusals_through_the_cli(tmp_path):
  r = run_cli(["plan", "qwen3-30b-a3b", "--gpu", "a100", "--search"], cwd=REPO)
  assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("maxtext-moe: error: unknown GPU 'a100'")
  r = run_cli(["plan", "h100x8/deepseek3-proxy-16b", "--write", str(tmp_path / "x.yml")], cwd=REPO)
  assert r.returncode == 2 and "--write, --top and --tensor belong to --search" in r.stderr
  r = run_cli(["plan", "qwen3-30b-a3b", "--gpu", "h100", "--gpus", "16"], cwd=REPO)
  assert r.returncode == 2 and "--gpus goes with a RECIPE; with --gpu GPU give the node count: --nodes N" in r.stderr
  r = run_cli(["plan", "qwen3-30b-a3b", "--gpu", "h100", "--check"], cwd=REPO)
  assert r.returncode == 2 and "--check goes with the RECIPE a launcher runs" in r.stderr
  assert not list(tmp_path.iterdir())


def test_plan_a_model_on_a_gpu_without_the_search(capfd):
  """`plan MODEL --gpu GPU --nodes N`: the shipped recipe of MODEL for GPU where there is one, else the
  default layout (the largest EP that divides the experts in a node, FSDP the rest and across), the user's
  overrides on top; named as the user named it, timed with --time."""
  from maxtext_moe import cli

  assert cli.main(["plan", "qwen3-30b-a3b", "--gpu", "h100", "--nodes", "2", "--json"]) == 0
  shipped = json.loads(capfd.readouterr().out)
  assert shipped["planned"] == "the recipe h100x8/qwen3-30b-a3b" and shipped["recipe"] == "h100x8/qwen3-30b-a3b"
  assert shipped["num_devices"] == 16 and shipped["layout"] == {"fsdp": 8, "expert": 2}
  assert cli.main(["plan", "qwen3-30b-a3b", "--gpu", "b300", "--nodes", "2", "--time", "--json"]) in (0, 1)
  default = json.loads(capfd.readouterr().out)
  assert default["recipe"] == "qwen3-30b-a3b on b300" and default["planned"].startswith("a default layout, EP 8")
  assert default["layout"] == {"fsdp": 2, "expert": 8} and default["time"]["tokens_per_s_per_gpu"] > 0
  base, words = search.default_of("qwen3-30b-a3b", "b300", 2, ["ici_tensor_parallelism=2", "ici_expert_parallelism=4"])
  assert base.overrides[-3:] == ["ici_tensor_parallelism=2", "ici_expert_parallelism=4", "nodes=2"]
  assert "your overrides on top" in words


def test_tensor_parallel_candidates_take_the_place_of_fsdp_in_a_node():
  found = [c for c in search.layouts(hardware.GPUS["h100"], 1, 128, tensor=(1, 2, 4)) if c.remat == "full"]
  assert {(c.ep, c.fsdp, c.tp) for c in found if c.tp > 1} == {(4, 1, 2), (2, 1, 4)}
  assert all(c.ep * c.fsdp * c.tp == 8 for c in found) and len(found) == 4 + 2
  assert "ici_tensor_parallelism=4" in next(c for c in found if c.tp == 4).overrides()


@pytest.mark.ci  # kept out of the README suite's 10 minutes; CI runs the ci tier
def test_the_offload_floors_the_search_prunes_with_never_exceed_the_estimates():
  """The search skips an offload whose floor does not fit (`fitting._offloaded_fits`, from another offload's
  estimate, and `_doubled`, from the half batch's): each must fit wherever the estimate it stands for does.
  With the memory limits set to an estimate's own device and host bytes, the floors of it must say it fits.
  (When the planner began counting offloaded parameters on the device, the host side of the doubled
  batch's floor counted them twice, and the search could skip a batch that fits.)"""
  import dataclasses

  from maxtext_moe.planner.planning import estimate_of, planning, resolved
  from maxtext_moe.steptime import fitting

  ctx, _ = planning("h200x8/deepseek3-proxy-16b", ["per_device_batch_size=1"], None, None)

  def planned(offload: str, batch: int):
    cfg = resolved(ctx.path, [*ctx.base_overrides, f"offload={offload}", f"per_device_batch_size={batch}"])
    return estimate_of(ctx, cfg, [])[0]

  def at_limits(est):  # the memory limits an estimate exactly fills
    return dataclasses.replace(ctx, hbm_gib=est.device_total / 2**30 + 1e-6, host_gib=est.host / 2**30 + 1e-6)

  for level, offload in enumerate(candidates.OFFLOADS):
    real, doubled = planned(offload, 1), planned(offload, 2)
    assert fitting._offloaded_fits(at_limits(doubled), fitting._doubled(real), level), offload
    for lower in range(level):
      assert fitting._offloaded_fits(at_limits(real), planned(candidates.OFFLOADS[lower], 1), level), (lower, level)


def test_a_layout_at_the_memorys_edge_ranks_after_those_with_room():
  """The 671B on 32 H100 nodes: the search's fastest layouts were planned at 71.9 and 70.8 GiB of 72.8 and
  compile to 73.5 and 74.7 (XLA:GPU packs a step that needs nearly all the memory 2-5% above its live
  bytes); the one planned at 59.1 compiles to 64.8 and fits. Within 5% of the usable memory a layout comes
  after the rest, faster or not; without a memory to judge by, speed alone ranks."""
  from types import SimpleNamespace

  from maxtext_moe.steptime.fitting import Found

  def found(gib: float, tokens: float) -> Found:
    return Found(SimpleNamespace(), gib, 512, SimpleNamespace(tokens_per_s_per_gpu=tokens))

  edge, room, edge_slower = found(71.9, 1365.0), found(59.1, 1306.0), found(70.8, 1132.0)
  assert search.ranked([edge, edge_slower, room], 72.78) == [room, edge, edge_slower]
  assert search.ranked([room, edge_slower, edge]) == [edge, room, edge_slower]
  assert search.at_edge(edge, 72.78) and not search.at_edge(room, 72.78) and not search.at_edge(edge, None)


def test_plans_verdict_says_when_a_step_is_at_the_memorys_edge():
  from types import SimpleNamespace

  from maxtext_moe.planner.memory_plan import _edge

  assert "XLA's buffer packing decides" in _edge(SimpleNamespace(device_total=71.9, hbm=72.78))
  assert _edge(SimpleNamespace(device_total=59.1, hbm=72.78)) == ""
