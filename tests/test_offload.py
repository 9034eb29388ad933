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

from conftest import compile_report, run_cli
from maxtext_moe.config import recipes
from maxtext_moe.config.offload import OFFLOADED_ACTIVATIONS, preset_overrides
from maxtext_moe.errors import UserError
from maxtext_moe.gpu_compile.command import plugin_installed

TINY = recipes.recipe_path("cpu/deepseek3-tiny")
SMALL = ["per_device_batch_size=1", "max_target_length=32", "dataset_type=synthetic"]
# The tiny model's shapes at SMALL on conftest's 8 devices: [B, S, D] activations (global), and the MoE
# block's rows per device, R = 1 * S * top-k = 128.
BSD, RF, RD = "8x32x64xf32", "128x32xf32", "128x64xf32"


def test_presets_set_maxtexts_keys_and_user_overrides_win(resolution):
  cfg = resolution.resolve(TINY, ["offload=all"])
  assert cfg.optimizer_memory_host_offload and cfg.parameter_memory_host_offload and cfg.param_scan_axis == 0
  assert str(cfg.remat_policy) == "custom"
  assert all(getattr(cfg, name) == "offload" for name in OFFLOADED_ACTIVATIONS)
  assert preset_overrides(None) == preset_overrides("none") == []
  cfg = resolution.resolve(TINY, ["offload=optimizer", "optimizer_memory_host_offload=false"])
  assert not cfg.optimizer_memory_host_offload
  with pytest.raises(UserError, match="bad value for 'offload'"):
    resolution.resolve(TINY, ["offload=everything"])


def test_preset_without_pinned_host_memory_is_refused(monkeypatch):
  import jax

  from maxtext_moe.launch.preflight import check_platform

  class NoHost:
    def memory(self, kind):
      raise ValueError(f"no memory kind {kind}")

  monkeypatch.setattr(jax, "devices", lambda *a: [NoHost()])
  with pytest.raises(UserError, match="offload=optimizer needs pinned host memory, which gpu devices here lack"):
    check_platform(SimpleNamespace(offload="optimizer", moe_dispatch="auto"), platform="gpu")


def lowered_with(resolution, offload: str, platform: str, extra: list[str]) -> str:
  from maxtext_moe.upstream.maxtext.compile import lowered_train_step

  cfg = resolution.resolved(TINY, [*SMALL, f"offload={offload}", *extra])
  return lowered_train_step(cfg, platform=platform)


def _lowered(resolution, offload: str, platform: str) -> str:
  return lowered_with(resolution, offload, platform, [])


def _host_placements(text: str) -> collections.Counter:
  """Tensor types of the values the module moves to pinned host memory inside the step."""
  lines = [ln for ln in text.splitlines() if '_xla_buffer_placement = "pinned_host"' in ln]
  return collections.Counter(re.search(r"\(tensor<([^>]*)>\)", ln).group(1) for ln in lines)


def _host_arguments(text: str) -> int:
  main = next(ln for ln in text.splitlines() if "func.func public @main" in ln)
  return main.count('mhlo.memory_kind = "pinned_host"')


@pytest.mark.ci
def test_activation_preset_offloads_each_named_tensor_on_gpu(resolution):
  """Lowered for CUDA: each scanned group (the dense layer, the MoE layers) sends its layer input and
  attention output to the host, and the MoE group its three grouped-GEMM outputs (wi_0, wi_1: R x F; wo:
  R x D). The dense MLP's `mlpwo` is in the preset but DeepSeek's layers tag no tensor with that name."""
  assert _host_placements(_lowered(resolution, "activations", "cuda")) == {BSD: 4, RF: 2, RD: 1}
  assert _host_placements(_lowered(resolution, "none", "cuda")) == {}


@pytest.mark.ci
def test_under_the_bounded_rounds_the_experts_outputs_are_recomputed_not_offloaded(resolution):
  """With expert parallelism the bounded rounds run the grouped GEMMs inside a conditional, where an
  offloaded residual made XLA:GPU's layout assignment fail (host memory from one branch, a device buffer
  from the other): there the block does not name them, so the policy recomputes them and only the layer
  inputs and attention outputs go to the host; the planner counts the same."""
  from maxtext_moe.planner.estimate import experts_recomputed
  from maxtext_moe.planner.saved_activations import per_layer

  ep = ["ici_expert_parallelism=4", "ici_fsdp_parallelism=2", "moe_dispatch=all_to_all"]
  text = lowered_with(resolution, "activations", "cuda", ep)
  assert _host_placements(text) == {BSD: 4}
  cfg = resolution.resolved(TINY, [*SMALL, "offload=activations", *ep])
  named = resolution.resolved(TINY, [*SMALL, "offload=activations"])
  rows, d_b = 128, 4
  # The layer input and out_proj; `mlpwo` (named by the preset) only joins the residual stream: no backward keeps it.
  assert experts_recomputed(cfg, "all_to_all") and not experts_recomputed(named, "local")
  assert per_layer(cfg, 32, d_b, rows, recomputed=True)[1] == 2 * 32 * 64 * d_b
  assert per_layer(named, 32, d_b, rows, recomputed=False)[1] == (2 * 32 * 64 + rows * (2 * 32 + 64)) * d_b


def test_cpu_lowering_drops_activation_offload(resolution):
  """Why offload=activations shows no host transfer in a CPU step: JAX's CPU lowering drops them (the
  launcher says so). If this starts failing, JAX lowers them on CPU now: update check_platform's note."""
  assert _host_placements(_lowered(resolution, "activations", "cpu")) == {}


@pytest.mark.ci
def test_optimizer_and_parameter_presets_put_state_in_host_memory(resolution):
  none, optimizer, params = (_host_arguments(_lowered(resolution, o, "cpu")) for o in ("none", "optimizer", "all"))
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


@pytest.mark.ci  # an XLA:GPU compile of about a minute: the suite keeps one (tests/test_gpu_compile.py)
@pytest.mark.skipif(not plugin_installed(), reason="needs jax-cuda12-plugin (./setup.sh --gpu-compile)")
def test_state_on_the_host_stays_there_in_the_compiled_gpu_program(tmp_path):
  """`compile` with the optimizer and parameters offloaded (a 4-layer proxy on 2 H100 nodes, FSDP across
  them), as a user runs it. The compile-only GPU devices have no host memory: before, JAX dropped the
  state's `pinned_host` and the program held it on the device (gb200-nvl72/deepseek3-671b: 254.9 GiB, of
  which the planner called 119.3 host). Now the step is lowered over CPU devices for CUDA and compiled for
  the GPUs: its arguments are in host memory, exactly the planner's offloaded state, and every byte of it
  comes to the device and goes back once a step, as MaxText's train step moves it. The experts' FSDP
  gathers move bf16: MaxText moves the float32 parameters onto the device inside the step, and XLA then
  gathered the float32 kernels and cast after (this program: f32[32,2048,1408] gathers, 6.22 GiB instead of
  5.57), until our block cast them where they are stored. Given the memory the planner says the step needs,
  XLA:GPU compiles it within 10% of that: its scheduler fills what it is given (slop x (memory - arguments)),
  and this 4-layer step given an H100's 72.8 GiB holds the next layers' gathered experts and the offloaded
  state's host copies early (4.95 GiB, where the planner says 3.50)."""
  args = ["compile", "h100x8/deepseek3-proxy-16b", "--nodes", "2", "override_model_config=true"]
  args += ["base_num_decoder_layers=4", "first_num_dense_layers=1", "mtp_num_layers=0", "per_device_batch_size=1"]
  args += ["max_target_length=1024", "dcn_fsdp_parallelism=-1", "dcn_data_parallelism=1", "remat_policy=full"]
  args += ["offload=optimizer_params", "--memory", "planned", "--json", "--hlo", str(tmp_path)]
  report = compile_report(args, cwd=tmp_path)
  assert report["scheduled_for_bytes"] == report["planner_device_bytes"]
  assert report["devices"] == 16 and report["layout"] == {"fsdp": 8, "expert": 2}, report["layout"]
  state, mem = report["planner"]["host_state_bytes"], report["memory"]
  # The host arguments are the planner's state but Adam's step counters (a few int32 scalars).
  assert 0 <= mem["host_argument_bytes"] - state < 64 and mem["host_alias_bytes"] == mem["host_argument_bytes"]
  assert mem["argument_bytes"] < 2**20  # on the device: the batch and the RNG key
  moved = {way: row["bytes"] for way, row in report["host_transfers"].items()}
  assert moved == {"from_host": mem["host_argument_bytes"], "to_host": mem["host_argument_bytes"]}, moved
  program = (tmp_path / "train_step.after_optimizations.txt").read_text()
  gathers = [line for line in program.splitlines() if " all-gather" in line and "= " in line]
  assert gathers and not [g for g in gathers if re.search(r"= \(?\(?f32\[", g)], [
    g[:160] for g in gathers if "f32[" in g
  ]
  assert report["fits"] and abs(report["rel_error"]) <= 0.10, report["rel_error"]
