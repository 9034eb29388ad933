"""Bad input gets one line that says what is wrong and how to fix it."""

from types import SimpleNamespace

import pytest

from conftest import REPO, run_cli
from maxtext_moe.config import checks, recipes
from maxtext_moe.errors import UserError
from maxtext_moe.launch.preflight import check_platform, check_visible_devices
from maxtext_moe.moe import layout

TINY = recipes.recipe_path("cpu/deepseek3-tiny")


@pytest.mark.parametrize(
  ("overrides", "expected"),
  [
    (["learning_rat=1"], "unknown config key 'learning_rat'; did you mean 'learning_rate'?"),
    (["progress=fancy"], "bad value for 'progress'"),
    (["steps=many"], "bad value for 'steps'"),
    (["ici_expert_parallelism=3"], "num_experts=16 is not divisible by expert parallelism 3"),
    (["ici_expert_parallelism=-1"], "at most one ici_*_parallelism may be -1"),
    (["num_experts_per_tok=9", "override_model_config=true"], "group-limited routing keeps 2 groups of 4"),
    (["sparse_matmul=false"], "moe_impl=dropless replaces MaxText's sparse_matmul path: set sparse_matmul=true"),
    (["moe_dispatch=local", "ici_expert_parallelism=8"], "moe_dispatch=local cannot serve expert parallelism 8"),
    (
      ["moe_dispatch=ragged_all_to_all", "moe_capacity_factor=1.25"],
      "moe_dispatch=ragged_all_to_all is always dropless: set moe_capacity_factor=0",
    ),
    (["quantization=int8"], "moe_impl=dropless: quantization=int8 is AQT's integer path"),
    (["moe_gemm_backend=cublas"], "bad value for 'moe_gemm_backend'"),
    (["emb_dim=96"], "emb_dim is derived by MaxText from other keys and would be ignored; set base_emb_dim instead"),
    (["checkpoint_dir=/x"], "checkpoint_dir is derived by MaxText from other keys and would be ignored; it cannot"),
    (["eval_data_columns={a: 1}"], "eval_data_columns takes a list, as eval_data_columns=[a,b] (got {'a': 1})"),
  ],
)
def test_bad_overrides_raise_one_line(overrides, expected, resolution):
  with pytest.raises(UserError) as e:
    resolution.resolve(TINY, overrides)
  assert expected in str(e.value)
  assert "\n" not in str(e.value)


def test_misspelled_recipe_suggests_the_closest():
  with pytest.raises(UserError, match="did you mean 'cpu/deepseek3-tiny'"):
    recipes.recipe_path("cpu/deepseek3-tini")


def test_device_count_must_match_the_recipe(resolution):
  cfg = resolution.resolve(recipes.recipe_path("h200x8/deepseek3-proxy-16b"), [])
  with pytest.raises(UserError, match="recipe lays out 1 node\\(s\\), 8 devices but 1 are visible"):
    check_visible_devices(cfg, visible=1)
  check_visible_devices(cfg, visible=8)
  with pytest.raises(
    UserError, match="lays out 1 node\\(s\\), 8 devices but 4 are visible to 4 processes; start one process per GPU"
  ):
    check_visible_devices(cfg, visible=4, processes=4)
  with pytest.raises(
    UserError, match="16 are visible to 16 processes; the job has 2 node\\(s\\) of 8 GPUs: pass --nodes 2"
  ):
    check_visible_devices(cfg, visible=16, processes=16)
  two = resolution.resolve(recipes.recipe_path("h200x8/deepseek3-proxy-16b"), ["nodes=2"])
  assert (two.recipe_num_devices, two.num_slices, two.dcn_data_parallelism) == (16, 2, -1)
  check_visible_devices(two, visible=16, processes=16)


def test_ragged_dispatch_is_refused_on_cpu(resolution):
  cfg = resolution.resolve(TINY, ["moe_dispatch=ragged_all_to_all"])
  with pytest.raises(
    UserError, match="needs a GPU or TPU .XLA:CPU has no ragged-all-to-all.; use moe_dispatch=all_to_all"
  ):
    check_platform(cfg, platform="cpu")
  check_platform(cfg, platform="gpu")


def test_fixed_layout_must_equal_the_device_count(resolution):
  cfg = resolution.resolve(TINY, ["ici_fsdp_parallelism=4"])
  with pytest.raises(UserError, match="ici_\\*_parallelism product is 4 but must equal the 8 devices per slice"):
    check_visible_devices(cfg, visible=8)
  check_visible_devices(cfg, visible=4)


def _layout(num_slices=1, **degrees):
  base = {f"ici_{a}_parallelism": 1 for a in ("data", "fsdp", "expert", "tensor")}
  base |= {f"dcn_{a}_parallelism": 1 for a in ("data", "fsdp", "expert")}
  base |= degrees
  return SimpleNamespace(recipe_num_devices=-1, num_slices=num_slices, **base)


def test_layout_product_counts_ici_and_dcn():
  cfg = _layout(num_slices=2, ici_expert_parallelism=8, ici_fsdp_parallelism=9, dcn_fsdp_parallelism=2)
  assert layout.fixed_layout_size(cfg) == (144, False)
  checks.check_layout_fits_devices(cfg, num_devices=144)
  with pytest.raises(ValueError, match="ici_\\*_parallelism product is 72 but must equal the 36 devices per slice"):
    checks.check_layout_fits_devices(cfg, num_devices=72)
  with pytest.raises(ValueError, match="dcn_\\*_parallelism product is 2 but must equal the 1 slices"):
    checks.check_layout_fits_devices(_layout(dcn_fsdp_parallelism=2), num_devices=144)


def test_auto_axis_must_divide():
  cfg = _layout(ici_expert_parallelism=8, ici_fsdp_parallelism=-1)
  checks.check_layout_fits_devices(cfg, num_devices=64)
  with pytest.raises(ValueError, match="must divide the 12 devices per slice"):
    checks.check_layout_fits_devices(cfg, num_devices=12)


def test_cli_prints_one_line_and_exits_2(tmp_path):
  """Our line alone: MaxText's 'WARNING:maxtext.configs.pyconfig:Ignoring invalid/unsupported field' came first."""
  r = run_cli(["train", "cpu/deepseek3-tiny", "learning_rat=1"], cwd=tmp_path)
  assert r.returncode == 2
  assert r.stderr == "maxtext-moe: error: unknown config key 'learning_rat'; did you mean 'learning_rate'?\n"
  assert not (tmp_path / "runs").exists(), "nothing is written for a rejected config"


def test_cli_bad_recipe_exits_2(tmp_path):
  r = run_cli(["config", "h100x8/deepseek3-proxy"], cwd=REPO)
  assert r.returncode == 2 and "unknown recipe 'h100x8/deepseek3-proxy'" in r.stderr


def test_compile_without_xla_gpus_compiler_is_one_line_naming_the_setup(tmp_path):
  """A machine set up without --gpu-compile (the jax-cuda12 plugin absent: here a regular `jax_plugins`
  package first on the path hides the installed namespace portion)."""
  import os
  import subprocess
  import sys

  shadow = tmp_path / "shadow" / "jax_plugins"
  shadow.mkdir(parents=True)
  (shadow / "__init__.py").write_text("")
  env = dict(os.environ, PYTHONPATH=str(shadow.parent))
  proc = subprocess.run(
    [sys.executable, "-m", "maxtext_moe", "compile", "h100x8/deepseek3-proxy-16b"],
    cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
  )  # fmt: skip
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert proc.stderr.strip().splitlines() == [
    "maxtext-moe: error: compile needs XLA:GPU's compiler (the jax-cuda12 plugin): run ./setup.sh --gpu-compile"
  ]


def test_report_of_a_foreign_directory_says_it_once(tmp_path):
  from maxtext_moe.runlog.report import report

  with pytest.raises(UserError) as e:
    report(tmp_path)
  assert (
    str(e.value) == f"{tmp_path} is not a maxtext-moe run directory: it has no readable metrics.jsonl with step rows"
  )
