"""Host-offload presets: they set MaxText's keys, and the named tensors really are placed in host memory.

What is offloaded is read from the train step's lowered module: jit arguments in `pinned_host` memory for
the optimizer/parameter presets, and `annotate_device_placement` calls with `pinned_host` for each
activation the remat policy offloads. JAX lowers the latter only for GPU and TPU (jax 0.12.0.1,
jax/_src/dispatch.py registers `_tpu_gpu_device_put_lowering` for those platforms; CPU's lowering returns
its input), so the activation checks lower the step for CUDA, which jax.export does on a CPU machine.
"""

import collections
import json
import re
from types import SimpleNamespace

import pytest

from conftest import run_cli
from maxtext_moe.config import recipes
from maxtext_moe.config.offload import OFFLOADED_ACTIVATIONS, preset_overrides
from maxtext_moe.errors import UserError

TINY = recipes.recipe_path("cpu/deepseek3-tiny")
SMALL = ["per_device_batch_size=1", "max_target_length=32", "dataset_type=synthetic"]
# The tiny model's shapes at SMALL on conftest's 8 devices: [B, S, D] activations (global), and the MoE
# block's rows per device, R = 1 * S * top-k = 128.
BSD, RF, RD = "8x32x64xf32", "128x32xf32", "128x64xf32"


def test_presets_set_maxtexts_keys_and_user_overrides_win(upstream_config):
  cfg = upstream_config.resolve(TINY, ["offload=all"])
  assert cfg.optimizer_memory_host_offload and cfg.parameter_memory_host_offload and cfg.param_scan_axis == 0
  assert str(cfg.remat_policy) == "custom"
  assert all(getattr(cfg, name) == "offload" for name in OFFLOADED_ACTIVATIONS)
  assert preset_overrides(None) == preset_overrides("none") == []
  cfg = upstream_config.resolve(TINY, ["offload=optimizer", "optimizer_memory_host_offload=false"])
  assert not cfg.optimizer_memory_host_offload
  with pytest.raises(UserError, match="bad value for 'offload'"):
    upstream_config.resolve(TINY, ["offload=everything"])


def test_preset_without_pinned_host_memory_is_refused(monkeypatch):
  import jax

  from maxtext_moe.launch.preflight import check_platform

  class NoHost:
    def memory(self, kind):
      raise ValueError(f"no memory kind {kind}")

  monkeypatch.setattr(jax, "devices", lambda *a: [NoHost()])
  with pytest.raises(UserError, match="offload=optimizer needs pinned host memory, which gpu devices here lack"):
    check_platform(SimpleNamespace(offload="optimizer", moe_dispatch="auto"), platform="gpu")


def lowered_with(upstream_config, offload: str, platform: str, extra: list[str]) -> str:
  from maxtext_moe.upstream.compile import lowered_train_step

  cfg = upstream_config.resolved(TINY, [*SMALL, f"offload={offload}", *extra])
  return lowered_train_step(cfg, platform=platform)


def _lowered(upstream_config, offload: str, platform: str) -> str:
  return lowered_with(upstream_config, offload, platform, [])


def _host_placements(text: str) -> collections.Counter:
  """Tensor types of the values the module moves to pinned host memory inside the step."""
  lines = [ln for ln in text.splitlines() if '_xla_buffer_placement = "pinned_host"' in ln]
  return collections.Counter(re.search(r"\(tensor<([^>]*)>\)", ln).group(1) for ln in lines)


def _host_arguments(text: str) -> int:
  main = next(ln for ln in text.splitlines() if "func.func public @main" in ln)
  return main.count('mhlo.memory_kind = "pinned_host"')


@pytest.mark.ci
def test_activation_preset_offloads_each_named_tensor_on_gpu(upstream_config):
  """Lowered for CUDA: each scanned group (the dense layer, the MoE layers) sends its layer input and
  attention output to the host, and the MoE group its three grouped-GEMM outputs (wi_0, wi_1: R x F; wo:
  R x D). The dense MLP's `mlpwo` is in the preset but DeepSeek's layers tag no tensor with that name."""
  assert _host_placements(_lowered(upstream_config, "activations", "cuda")) == {BSD: 4, RF: 2, RD: 1}
  assert _host_placements(_lowered(upstream_config, "none", "cuda")) == {}


@pytest.mark.ci
def test_under_the_bounded_rounds_the_experts_outputs_are_recomputed_not_offloaded(upstream_config):
  """With expert parallelism the bounded rounds run the grouped GEMMs inside a conditional, where an
  offloaded residual made XLA:GPU's layout assignment fail (host memory from one branch, a device buffer
  from the other): there the block does not name them, so the policy recomputes them and only the layer
  inputs and attention outputs go to the host; the planner counts the same."""
  from maxtext_moe.planner.estimate import experts_recomputed
  from maxtext_moe.planner.saved_activations import per_layer

  ep = ["ici_expert_parallelism=4", "ici_fsdp_parallelism=2", "moe_dispatch=all_to_all"]
  text = lowered_with(upstream_config, "activations", "cuda", ep)
  assert _host_placements(text) == {BSD: 4}
  cfg = upstream_config.resolved(TINY, [*SMALL, "offload=activations", *ep])
  named = upstream_config.resolved(TINY, [*SMALL, "offload=activations"])
  rows, d_b = 128, 4
  # The layer input and out_proj; `mlpwo` (named by the preset) only joins the residual stream: no backward keeps it.
  assert experts_recomputed(cfg, "all_to_all") and not experts_recomputed(named, "local")
  assert per_layer(cfg, 32, d_b, rows, recomputed=True)[1] == 2 * 32 * 64 * d_b
  assert per_layer(named, 32, d_b, rows, recomputed=False)[1] == (2 * 32 * 64 + rows * (2 * 32 + 64)) * d_b


def test_cpu_lowering_drops_activation_offload(upstream_config):
  """Why offload=activations shows no host transfer in a CPU step: JAX's CPU lowering drops them (the
  launcher says so). If this starts failing, JAX lowers them on CPU now: update check_platform's note."""
  assert _host_placements(_lowered(upstream_config, "activations", "cpu")) == {}


@pytest.mark.ci
def test_optimizer_and_parameter_presets_put_state_in_host_memory(upstream_config):
  none, optimizer, params = (_host_arguments(_lowered(upstream_config, o, "cpu")) for o in ("none", "optimizer", "all"))
  assert none == 0 < optimizer < params


@pytest.mark.slow
@pytest.mark.extended
def test_all_presets_at_once_train_to_the_same_losses(tmp_path):
  """The host placements run, not only lower: offload=all trains as offload=none does (CPU)."""
  losses = {}
  for preset in ("none", "all"):
    args = ["train", *SMALL, "steps=2", "progress=silent", f"run_name=offload-{preset}", f"offload={preset}"]
    r = run_cli(args, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = (tmp_path / "runs" / f"offload-{preset}" / "metrics.jsonl").read_text().splitlines()
    losses[preset] = [json.loads(line)["loss"] for line in rows]
  assert losses["all"] == pytest.approx(losses["none"], rel=1e-5, abs=1e-6)
