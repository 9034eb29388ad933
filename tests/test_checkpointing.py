"""How often a run saves and what a failure can cost: the period rule, every GPU recipe's period (none keeps
MaxText's 10,000), the line a run prints at start, and `train --check` of a GPU recipe off its GPUs."""

import types
from pathlib import Path

import pytest
import yaml

from conftest import run_cli
from maxtext_moe.config import checkpointing
from maxtext_moe.config.recipes import configs_dir, list_recipes, recipe_path


@pytest.mark.parametrize(
  ("step_s", "period"), [(6.27, 280), (9.94, 180), (0.33, 5400), (1.0, 1800), (200.0, 9), (4000.0, 1)]
)
def test_a_period_is_about_thirty_minutes_of_steps_rounded_down(step_s, period):
  assert checkpointing.period_for(step_s) == period
  assert period * step_s <= checkpointing.MINUTES * 60 or period == 1


def _period(name: str) -> int | None:
  """A recipe's checkpoint_period through its base_config chain (None: MaxText's default)."""
  path = configs_dir() / "recipes" / f"{name}.yml"
  while True:
    data = yaml.safe_load(path.read_text())
    if "checkpoint_period" in data:
      return int(data["checkpoint_period"])
    if "base_config" not in data:
      return None
    path = (path.parent / data["base_config"]).resolve()


def test_every_gpu_recipe_saves_by_time_not_maxtexts_ten_thousand_steps():
  gpu = [n for n in list_recipes() if not n.startswith("cpu/")]
  assert len(gpu) >= 20
  periods = {n: _period(n) for n in gpu}
  assert all(p is not None and p < checkpointing.MAXTEXT_DEFAULT for p in periods.values()), periods


@pytest.mark.ci
def test_every_gpu_recipes_period_is_at_most_thirty_minutes_by_the_step_time_model():
  """About a minute: each recipe timed by the step-time model on its own GPUs."""
  from maxtext_moe.planner.planning import resolved
  from maxtext_moe.steptime.recipe import for_recipe

  for name in (n for n in list_recipes() if not n.startswith("cpu/")):
    step_s = for_recipe(name, ["finetune=false"]).step_s
    period = int(resolved(configs_dir() / "recipes" / f"{name}.yml", ["finetune=false"]).checkpoint_period)
    assert period * step_s <= checkpointing.MINUTES * 60, (name, period, step_s)
    assert period * step_s >= 60, (name, period, step_s)  # not so often that saving dominates


def _cfg(period: int, steps: int, enabled: bool = True) -> types.SimpleNamespace:
  return types.SimpleNamespace(checkpoint_period=period, steps=steps, enable_checkpointing=enabled)


def test_the_line_says_what_a_failure_costs():
  assert checkpointing.at_risk(_cfg(280, 1000), 6.0) == (
    "checkpoints every 280 steps of 1000: a failure costs at most 280 steps, about 28 minutes by the step-time model"
  )
  assert checkpointing.at_risk(_cfg(50, 100)) == "checkpoints every 50 steps of 100: a failure costs at most 50 steps"
  default = checkpointing.at_risk(_cfg(10_000, 5000))
  assert default.startswith("checkpoint_period=10000 (MaxText's default) >= steps=5000: no checkpoint before the last")
  assert "set checkpoint_period" in default
  assert checkpointing.at_risk(_cfg(280, 50), 6.0) == (
    "checkpoint_period=280 >= steps=50: the run saves at its last step only; a failure loses it all, about 5 "
    "minutes by the step-time model"
  )
  assert checkpointing.at_risk(_cfg(1600, 50), 0.93).endswith(
    "a failure loses it all, about 1 minute by the step-time model"
  )
  assert checkpointing.at_risk(_cfg(1600, 20), 0.93).endswith(
    "a failure loses it all, under a minute by the step-time model"
  )
  assert checkpointing.at_risk(_cfg(50, 100, enabled=False)).startswith("checkpointing is off")


def _gigabytes(n: int) -> str:
  return f"{n / 1e9:g} GB"


def test_what_the_kept_checkpoints_take_on_disk():
  """A run saves at 0, every period and at its last step; max_num_checkpoints_to_keep keeps the newest N."""
  assert [checkpointing.saves(steps, 5) for steps in (1, 5, 6, 10, 11, 25, 26)] == [1, 2, 2, 3, 3, 6, 6]
  assert (checkpointing.saves(-1, 5), checkpointing.saves(100, 10_000)) == (0, 2)  # 0 and the last, 99
  gb = _gigabytes
  every = checkpointing.Retention(steps=25, period=5, keep=None)
  assert (every.kept(10**9), every.on_disk(10**9, gb)) == (
    (6, 6 * 10**9),
    "all 6 checkpoints of its 25 steps stay, 6 GB on disk (max_num_checkpoints_to_keep=N keeps the newest N)",
  )
  two = checkpointing.Retention.of({"steps": 25, "checkpoint_period": 5, "max_num_checkpoints_to_keep": 2})
  assert (two.kept(10**9), two.on_disk(10**9, gb)) == (
    (2, 2 * 10**9),
    "the newest 2 checkpoint(s) stay (max_num_checkpoints_to_keep=2), 2 GB on disk, 3 GB while a save completes",
  )
  assert checkpointing.Retention(steps=3, period=5, keep=2).kept(10**9) == (2, 2 * 10**9)  # 0 and 2
  assert checkpointing.Retention(25, 5, 2, enabled=False).on_disk(10**9, gb) == "checkpointing is off"


def test_train_check_of_a_staged_recipe_off_its_gpus_counts_the_jobs_devices(tmp_path: Path):
  """A pipeline's microbatches must divide the batch MaxText counts: on a login node (1 CPU device here) the
  job's 8 GH200s x 4 sequences, not this machine's 4 (MaxText asserted 'must be divisible by the number of
  microbatches (8)' before `train --check` named the job's devices)."""
  proc = run_cli(["train", "gh200x4/qwen3-30b-a3b", "--check", f"base_output_directory={tmp_path}/runs"], cwd=tmp_path)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert proc.stdout.startswith("train qwen3-30b-a3b: checked off its GPUs: the config, the layout on 8 GPUs")
  assert list(tmp_path.iterdir()) == []


@pytest.mark.ci  # kept out of the README suite's 10 minutes; CI runs the ci tier
def test_train_check_of_a_gpu_recipe_off_its_gpus_checks_the_rest_and_names_what_it_skipped(tmp_path: Path):
  proc = run_cli(["train", "h100x8/deepseek3-671b", "--check", f"base_output_directory={tmp_path}/runs"], cwd=tmp_path)
  assert proc.returncode == 0, proc.stderr[-2000:]
  lines = proc.stdout.strip().splitlines()
  assert lines[0].startswith("train deepseek3-671b: checked off its GPUs: the config, the layout on 256 GPUs")
  assert "it fits (55.2 GiB per GPU of 72.8 by the planner); nothing was written" in lines[0]
  assert lines[1] == (
    "  checkpoint_period=265 >= steps=50: the run saves at its last step only; a failure loses it all, about 5 "
    "minutes by the step-time model"
  )
  assert lines[2].startswith("  skipped (checked when the job starts): the devices each process sees")
  assert list(tmp_path.iterdir()) == []  # nothing written
  big = run_cli(["train", "h100x8/deepseek3-671b", "--check", "per_device_batch_size=8"], cwd=tmp_path)
  assert big.returncode == 2
  last = big.stderr.strip().splitlines()[-1]
  assert last == (
    "maxtext-moe: error: h100x8/deepseek3-671b on 32 node(s) does not fit: 110.7 GiB per GPU at the peak, 72.8 "
    "usable (maxtext-moe plan h100x8/deepseek3-671b per_device_batch_size=8 --nodes 32 shows the estimate); "
    "cheapest fix (smaller micro-batch): per_device_batch_size=2 (55.2 GiB per GPU)"
  )


@pytest.mark.ci  # kept out of the README suite's 10 minutes; CI runs the ci tier
def test_a_checkpoint_read_at_the_other_scan_axis_is_one_line_before_anything_is_written(tmp_path: Path):
  """offload=optimizer_params sets param_scan_axis=0; the converter writes the layer axis at 1: MaxText's load
  would fail with a traceback listing every tensor, after the run directory was made."""
  from conftest import REPO

  ck = tmp_path / "ck"
  hf = REPO / "tests" / "fixtures" / "hf_deepseek3_tiny" / "bf16"
  proc = run_cli(["convert", "hf-to-maxtext", "--hf", str(hf), "--out", str(ck)], cwd=tmp_path)
  assert proc.returncode == 0, proc.stderr[-2000:]
  args = ["train", "cpu/deepseek3-tiny-finetune", f"model_file={ck}/model.yml", f"load_parameters_path={ck}/items"]
  args += [f"base_output_directory={tmp_path}/runs", "dataset_type=synthetic", "steps=1"]
  bad = run_cli([*args, "param_scan_axis=0"], cwd=tmp_path)
  assert bad.returncode == 2, bad.stderr[-2000:]
  assert bad.stderr.strip().splitlines() == [
    f"maxtext-moe: error: {ck}/items stores its stacked layer weights with the layer axis at 1 (a converted "
    "checkpoint, or a run at MaxText's default, has 1), and this config reads them at param_scan_axis=0 "
    "(offload=optimizer_params sets it: MaxText offloads parameters only so): use offload=optimizer"
  ]
  assert not (tmp_path / "runs").exists()
  good = run_cli([*args, "--check"], cwd=tmp_path)
  assert good.returncode == 0, good.stderr[-2000:]


def test_the_step_time_a_recipe_records_is_read_where_the_step_time_model_is_not(tmp_path):
  """`k8s` says minutes from the step time a checkpoint_period line notes: a shipped recipe's, through its
  base_config chain, and a `plan --search --write` file's header; a fine-tune's own period without a note
  (its layout may differ from the base's) gives none."""
  from maxtext_moe.config.recipes import recorded_step_s

  written = tmp_path / "mine.yml"
  written.write_text(
    "# checkpoint_period: about 30 minutes of steps at the model's 4.35 s a step (a failure costs at most that).\n"
    "base_config: ${moe_configs:recipes/h100x8/deepseek3-671b.yml}\ncheckpoint_period: 410\n"
  )
  names = ["h100x8/deepseek3-671b", "h100x8/deepseek3-671b-finetune", "h200x8/deepseek3-671b-sft", "cpu/deepseek3-tiny"]
  found = {n: recorded_step_s(recipe_path(n)) for n in names} | {"written": recorded_step_s(written)}
  assert found == {
    "h100x8/deepseek3-671b": 5.68,
    "h100x8/deepseek3-671b-finetune": None,
    "h200x8/deepseek3-671b-sft": 10.05,
    "cpu/deepseek3-tiny": None,
    "written": 4.35,
  }
