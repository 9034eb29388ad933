"""Every shipped YAML parses and resolves; recipes are consistent with their model files."""

import math
import re
import shutil

import pytest
import yaml

from conftest import CONFIGS, REPO
from maxtext_moe.config import hardware as hw
from maxtext_moe.config import recipes

ALL_RECIPES = recipes.list_recipes()
MODEL_FILES = sorted((CONFIGS / "models").glob("*.yml"))


def test_shipped_recipes_cover_the_hardware():
  hardware = {r.split("/")[0] for r in ALL_RECIPES}
  assert {"cpu", "h100x8", "h200x8", "b200x8", "gb200-nvl72", "gb300x1024"} <= hardware
  assert recipes.DEFAULT_RECIPE in ALL_RECIPES


@pytest.mark.parametrize("page", ["checkpoints.md", "fine-tuning.md"])
def test_the_docs_name_every_fine_tuning_and_sft_recipe(page):
  """Issue 60: docs/checkpoints.md's table of recipes to train a converted checkpoint with missed
  h100x8/deepseek3-671b-finetune. Both pages name exactly the shipped *-finetune and *-sft recipes."""
  named = set(re.findall(r"`([\w.-]+/[\w.-]+-(?:finetune|sft))`", (REPO / "docs" / page).read_text()))
  assert named == {r for r in ALL_RECIPES if r.endswith(("-finetune", "-sft"))}


def _fake_checkpoint(tmp_path):
  (tmp_path / "items").mkdir()
  (tmp_path / "items" / "_METADATA").write_text("{}")
  return tmp_path / "items"


@pytest.mark.parametrize("name", ALL_RECIPES)
def test_recipe_resolves_and_validates(name, resolution, tmp_path):
  """Config resolution only: nothing is allocated, so the 671B recipes are checked on CPU too."""
  finetune = name.endswith(("-finetune", "-sft"))
  overrides = [f"load_parameters_path={_fake_checkpoint(tmp_path)}"] if finetune else []
  cfg = resolution.resolve(recipes.recipe_path(name), overrides)
  assert cfg.finetune == finetune
  model = name.split("/")[1].removesuffix("-finetune").removesuffix("-sft").removesuffix("-nvidia").removesuffix("-fp8")
  assert cfg.model_name == model
  assert str(cfg.recipe_hardware) in name.split("/")[0]
  # Issue 60: the GPU recipes keep the newest two checkpoints (every save stayed: 8.2 TB each for the 671B)
  assert cfg.max_num_checkpoints_to_keep == (None if name.startswith("cpu/") else 2)
  if cfg.recipe_num_devices > 0:
    from maxtext_moe.moe.layout import fixed_layout_size, mesh_sizes

    ici, ici_auto = fixed_layout_size(cfg, prefix="ici_")
    assert (ici * cfg.num_slices, ici_auto) == (cfg.recipe_num_devices, False), "GPU recipes lay out each domain"
    assert cfg.recipe_num_devices == cfg.nodes * hw.GPUS[str(cfg.recipe_hardware)].gpus_per_node
    dcn = [d for d in cfg.dcn_parallelism if d != 1]
    assert dcn.count(-1) == 1, "a GPU recipe says which DCN axis takes the nodes beyond its own"
    assert math.prod(mesh_sizes(cfg, cfg.recipe_num_devices).values()) == cfg.recipe_num_devices


CONFIG_FILES = sorted(p for p in CONFIGS.rglob("*.yml") if "flags" not in p.relative_to(CONFIGS).parts)


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: str(p.relative_to(CONFIGS)))
def test_every_yaml_parses_and_uses_known_keys(path, resolution):
  data = yaml.safe_load(path.read_text())
  assert isinstance(data, dict) and data
  unknown = set(data) - set(resolution.MoEMaxTextConfig.model_fields)
  assert unknown == set()


@pytest.mark.ci
def test_a_recipe_key_its_model_file_also_sets_wins_and_the_command_line_is_still_checked(tmp_path, resolution):
  """MaxText merges models/<model_name>.yml over the recipe, so n_routing_groups: -1 in a recipe for
  deepseek3-671b (whose model file says 8) trained with 8 and said nothing. The recipe wins now; a
  command-line key the model file sets is still refused unless override_model_config=true, as MaxText does."""
  from maxtext_moe.errors import UserError

  recipe = tmp_path / "mine.yml"
  base = CONFIGS / "recipes" / "gb200-nvl72" / "deepseek3-671b.yml"
  recipe.write_text(
    f"base_config: {base}\nn_routing_groups: -1\ntopk_routing_group: -1\nrouted_bias_update_rate: 0.0\n"
  )
  cfg = resolution.resolve(recipe, [])
  assert (cfg.n_routing_groups, cfg.topk_routing_group, cfg.routed_bias_update_rate) == (-1, -1, 0.0)
  assert resolution.resolve(base, []).n_routing_groups == 8, "the shipped recipe keeps its model's value"
  with pytest.raises(UserError, match=r"Keys \['num_experts'\] are overridden by both model config and CLI"):
    resolution.resolve(recipe, ["num_experts=128"])
  assert resolution.resolve(recipe, ["num_experts=128", "override_model_config=true"]).num_experts == 128
  nvidia = resolution.layer_keys(recipes.recipe_path("gb300x128/deepseek3-671b-nvidia"), [])
  assert nvidia.recipe_over_model == ["routed_bias_update_rate=0.0", "n_routing_groups=-1", "topk_routing_group=-1"]


def test_finetune_recipe_refuses_to_start_from_random_weights(resolution, tmp_path):
  from maxtext_moe.errors import UserError

  path = recipes.recipe_path("cpu/deepseek3-tiny-finetune")
  with pytest.raises(UserError, match="finetune=true needs weights to start from: set load_parameters_path"):
    resolution.resolve(path, [])
  with pytest.raises(UserError, match="does not exist"):
    resolution.resolve(path, [f"load_parameters_path={tmp_path / 'nope'}"])
  with pytest.raises(UserError, match="is not an Orbax checkpoint"):
    resolution.resolve(path, [f"load_parameters_path={tmp_path}"])


def test_every_model_file_is_used_by_a_recipe():
  """The families' <name>-from-hf files are the models of converted checkpoints, used through model_file."""
  from maxtext_moe.checkpoint.families import FAMILIES

  used = {r.split("/")[1] for r in ALL_RECIPES} | {f.model_name for f in FAMILIES.values()}
  assert {p.stem for p in MODEL_FILES} <= used


def test_deepseek_v3_671b_hyperparameters(resolution):
  cfg = resolution.resolve(recipes.recipe_path("gb200-nvl72/deepseek3-671b"), [])
  assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.shared_experts) == (256, 8, 1)
  assert (cfg.n_routing_groups, cfg.topk_routing_group) == (8, 4)
  assert cfg.routed_score_func == "sigmoid" and cfg.routed_bias
  assert cfg.routed_scaling_factor == 2.5 and cfg.routed_bias_update_rate > 0
  assert cfg.attention_type == "mla" and (cfg.q_lora_rank, cfg.kv_lora_rank) == (1536, 512)
  assert (cfg.emb_dim, cfg.num_decoder_layers, cfg.first_num_dense_layers) == (7168, 61, 3)
  assert (cfg.moe_mlp_dim, cfg.vocab_size, cfg.mtp_num_layers) == (2048, 129280, 1)


def test_our_model_file_shadows_maxtexts(resolution):
  """MaxText's own deepseek3-tiny has 61 layers and a 129k vocab; ours must win."""
  cfg = resolution.resolve(recipes.recipe_path("cpu/deepseek3-tiny"), [])
  assert (cfg.num_decoder_layers, cfg.vocab_size) == (4, 32000)


def test_proxy_is_about_16b_parameters(resolution):
  cfg = resolution.resolve(recipes.recipe_path("h200x8/deepseek3-proxy-16b"), [])
  d, f, moe_layers = cfg.emb_dim, cfg.moe_mlp_dim, cfg.num_decoder_layers - cfg.first_num_dense_layers
  experts = moe_layers * (cfg.num_experts + cfg.shared_experts) * 3 * d * f
  embeddings = 2 * cfg.vocab_size * d
  assert 14e9 < experts + embeddings < 17e9


def test_overrides_win_over_the_recipe(resolution):
  cfg = resolution.resolve(recipes.recipe_path("cpu/deepseek3-tiny"), ["steps=7", "learning_rate=1e-4"])
  assert (cfg.steps, cfg.learning_rate) == (7, 1e-4)


def test_config_command_reports_changes_vs_maxtext():
  from maxtext_moe.tools.show import show_config

  text = show_config("cpu/deepseek3-tiny", [])
  parsed = yaml.safe_load(text)
  assert parsed["plugin_keys"]["recipe_hardware"] == "cpu" and parsed["plugin_keys"]["offload"] is None
  assert parsed["changed_vs_maxtext"]["num_experts"] == 16
  assert "  num_experts: 16  # maxtext: 1" in text.splitlines()  # ours, then MaxText's default
  assert "dump_hlo_xla_flags" not in parsed["changed_vs_maxtext"], "MaxText's HLO-dump default stays off"


def test_the_value_none_of_an_enum_key_that_has_it_is_that_member(resolution):
  """MaxText turns the string none into None before our keys are validated: moe_gemm_quantization=none
  (bf16, the documented value) was refused as 'got None'."""
  from maxtext_moe.moe.settings import GemmQuantization

  cfg = resolution.resolve(recipes.recipe_path("cpu/deepseek3-tiny"), ["moe_gemm_quantization=none"])
  assert cfg.moe_gemm_quantization == GemmQuantization.NONE


def test_a_recipe_path_in_another_copy_of_configs(tmp_path, monkeypatch, resolution):
  """A second clone run with this package (its .venv linked to the first): a shipped recipe given by its
  path in that clone's configs/ was refused as 'not layered on maxtext-moe's base', so its runs could not be
  resumed, evaluated or exported from there. Where the files it is read from are the same as ours, it is our
  recipe of the same path; where one differs, one line says which configs/ this package reads and how to
  run the copy, and MAXTEXT_MOE_CONFIGS runs it. A file of the copy layered on ours is left as it is."""
  from maxtext_moe.errors import UserError

  copy = tmp_path / "clone" / "configs"
  shutil.copytree(CONFIGS, copy, symlinks=True)
  tiny, ours = copy / "recipes" / "cpu" / "deepseek3-tiny.yml", recipes.configs_dir().resolve()
  assert recipes.recipe_path(str(tiny)) == ours / "recipes" / "cpu" / "deepseek3-tiny.yml"
  assert resolution.layer_keys(recipes.recipe_path(str(tiny)), []).plugin.recipe_hardware == "cpu"
  mine = copy / "recipes" / "cpu" / "mine.yml"
  mine.write_text("base_config: ${moe_configs:recipes/cpu/deepseek3-tiny.yml}\nsteps: 3\n")
  assert recipes.recipe_path(str(mine)) == mine

  where = f"is in another copy of configs/ ({copy}); this maxtext-moe reads {ours}, where"
  fix = f"set MAXTEXT_MOE_CONFIGS={copy} to use that copy"
  with (copy / "models" / "deepseek3-tiny.yml").open("a") as f:
    f.write("# changed in the clone\n")
  with pytest.raises(UserError) as e:
    recipes.recipe_path(str(tiny))
  assert (
    str(e.value)
    == f"{tiny} {where} models/deepseek3-tiny.yml differs: {fix}, or give it as cpu/deepseek3-tiny to use this one's"
  )
  mine.write_text("base_config: deepseek3-tiny.yml\nsteps: 3\n")
  with pytest.raises(UserError) as e:
    recipes.recipe_path(str(mine))
  assert str(e.value) == f"{mine} {where} recipes/cpu/mine.yml is missing: {fix}"
  outside = tmp_path / "outside.yml"
  outside.write_text(f"base_config: {tiny}\nsteps: 3\n")
  with pytest.raises(UserError) as e:
    resolution.layer_keys(recipes.recipe_path(str(outside)), [])
  assert str(e.value) == (
    f"{outside} is layered on another copy of configs/ ({copy}); this maxtext-moe reads {CONFIGS}: set "
    "MAXTEXT_MOE_CONFIGS to that copy to use it, or base the file on ${moe_configs:recipes/HW/MODEL.yml}"
  )
  monkeypatch.setenv("MAXTEXT_MOE_CONFIGS", str(copy))
  assert recipes.recipe_path(str(mine)) == mine
  assert resolution.layer_keys(mine, []).plugin.recipe_hardware == "cpu"
