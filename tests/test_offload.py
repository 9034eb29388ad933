"""Host-offload presets: they set MaxText's keys, train on CPU (pinned_host exists there) and give the
same losses as no offload."""

import json
from types import SimpleNamespace

import pytest

from conftest import run_cli
from maxtext_moe.config import recipes
from maxtext_moe.config.offload import OFFLOADED_ACTIVATIONS, preset_overrides
from maxtext_moe.errors import UserError

TINY = recipes.recipe_path("cpu/deepseek3-tiny")
RUN = ["dataset_type=synthetic", "steps=2", "per_device_batch_size=2", "max_target_length=64", "progress=silent"]


def test_presets_set_maxtexts_keys_and_user_overrides_win(adapter):
  cfg = adapter.resolve(TINY, ["offload=all"])
  assert cfg.optimizer_memory_host_offload and cfg.parameter_memory_host_offload and cfg.param_scan_axis == 0
  assert str(cfg.remat_policy) == "custom"
  assert all(getattr(cfg, name) == "offload" for name in OFFLOADED_ACTIVATIONS)
  assert preset_overrides(None) == preset_overrides("none") == []
  cfg = adapter.resolve(TINY, ["offload=optimizer", "optimizer_memory_host_offload=false"])
  assert not cfg.optimizer_memory_host_offload
  with pytest.raises(UserError, match="bad value for 'offload'"):
    adapter.resolve(TINY, ["offload=everything"])


def test_preset_without_pinned_host_memory_is_refused(monkeypatch):
  import jax

  from maxtext_moe.launch.train import check_platform

  class NoHost:
    def memory(self, kind):
      raise ValueError(f"no memory kind {kind}")

  monkeypatch.setattr(jax, "devices", lambda *a: [NoHost()])
  with pytest.raises(UserError, match="offload=optimizer needs pinned host memory, which gpu devices here lack"):
    check_platform(SimpleNamespace(offload="optimizer", moe_dispatch="auto"), platform="gpu")


def _losses(tmp_path, name, extra):
  r = run_cli(["train", *RUN, f"run_name={name}", f"base_output_directory={tmp_path}", *extra], cwd=tmp_path)
  assert r.returncode == 0, r.stderr[-3000:]
  return [json.loads(line)["loss"] for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_every_preset_trains_to_the_same_losses(tmp_path):
  reference = _losses(tmp_path, "plain", [])
  for preset in ("optimizer", "optimizer_params", "activations", "all"):
    got = _losses(tmp_path, preset, [f"offload={preset}"])
    assert got == pytest.approx(reference, rel=1e-5, abs=1e-6), preset
