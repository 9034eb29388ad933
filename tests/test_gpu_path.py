"""The GPU fast path: what `auto` picks for each platform's capabilities, the rules of te / te_ep, what
`doctor` and the launcher say on this (CPU) machine, and, on a GPU with Transformer Engine, TE against
our portable paths (marked `gpu`, skipped elsewhere)."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import REPO, run_cli
from maxtext_moe.config import recipes
from maxtext_moe.errors import UserError
from maxtext_moe.launch.preflight import check_moe_path
from maxtext_moe.moe.mesh_axes import check_te_ep_layout
from maxtext_moe.moe.settings import (
  DispatchKind,
  GemmBackend,
  Platform,
  check_dispatch,
  check_quantization,
  detect_platform,
  resolve_backend,
  resolve_dispatch,
)
from maxtext_moe.upstream.te import calls as te

TINY = recipes.recipe_path("cpu/deepseek3-tiny")

GPU_BARE = Platform("gpu")  # CUDA JAX, no TE (the device image)
GPU_TE_SINGLE_PROCESS = Platform("gpu", te_gemm=True)  # TE imports; 8 GPUs in one process: no TE EP
GPU_TE = Platform("gpu", te_gemm=True, te_ep=True)  # the container, one process per GPU


@pytest.mark.parametrize(
  ("platform", "ep", "capacity_factor", "dispatch", "gemm"),
  [
    (Platform("cpu"), 1, 0.0, DispatchKind.LOCAL, GemmBackend.TILED),
    (Platform("cpu"), 8, 0.0, DispatchKind.ALL_TO_ALL, GemmBackend.TILED),
    (GPU_BARE, 1, 0.0, DispatchKind.LOCAL, GemmBackend.TOKAMAX),
    (GPU_BARE, 8, 0.0, DispatchKind.ALL_TO_ALL, GemmBackend.TOKAMAX),
    (GPU_TE_SINGLE_PROCESS, 8, 0.0, DispatchKind.ALL_TO_ALL, GemmBackend.TE),
    (GPU_TE, 8, 0.0, DispatchKind.TE_EP, GemmBackend.TE),
    (GPU_TE, 8, 1.5, DispatchKind.TE_EP, GemmBackend.TE),
    (GPU_TE, 1, 0.0, DispatchKind.LOCAL, GemmBackend.TE),
    (Platform("tpu"), 8, 0.0, DispatchKind.RAGGED_ALL_TO_ALL, GemmBackend.RAGGED_DOT),
    (Platform("tpu"), 8, 1.5, DispatchKind.ALL_TO_ALL, GemmBackend.RAGGED_DOT),
  ],
)
def test_auto_policy(platform, ep, capacity_factor, dispatch, gemm):
  assert resolve_dispatch("auto", ep=ep, platform=platform, capacity_factor=capacity_factor) == dispatch
  assert resolve_backend("auto", platform=platform) == gemm
  if platform.name == "gpu":  # the two slow XLA:GPU paths are never chosen for the user
    assert dispatch != DispatchKind.RAGGED_ALL_TO_ALL and gemm != GemmBackend.RAGGED_DOT


def test_explicit_choices_are_kept_on_gpu():
  assert resolve_dispatch("ragged_all_to_all", ep=8, platform=GPU_TE) == DispatchKind.RAGGED_ALL_TO_ALL
  assert resolve_backend("ragged_dot", platform=GPU_TE) == GemmBackend.RAGGED_DOT
  assert resolve_backend("tiled", platform=GPU_TE) == GemmBackend.TILED


def test_this_machine_is_a_cpu_without_te():
  assert detect_platform() == Platform("cpu")
  status = te.status()
  assert not status.available and status.reason.split(":")[0] in ("ModuleNotFoundError", "RuntimeError", "ImportError")
  reasons = te.ep_unready_reasons()
  assert reasons[0] == f"Transformer Engine does not import ({status.reason})"
  assert any("compute capability 9.0+" in r for r in reasons)


def test_te_ep_rules():
  with pytest.raises(ValueError, match="te_ep needs expert parallelism of at least 2, got 1"):
    check_dispatch("te_ep", ep=1, capacity_factor=0)
  with pytest.raises(ValueError, match="te_ep takes moe_capacity_factor 0 .dropless. or >= 1, got 0.5"):
    check_dispatch("te_ep", ep=8, capacity_factor=0.5)
  check_dispatch("te_ep", ep=8, capacity_factor=1.25)
  check_te_ep_layout({"data": 1, "fsdp": 4, "expert": 8}, num_experts=256)
  check_te_ep_layout({"data": 2, "expert": 4}, num_experts=64)
  with pytest.raises(ValueError, match="at most one of data or fsdp, not data=2, fsdp=2"):
    check_te_ep_layout({"data": 2, "fsdp": 2, "expert": 2}, num_experts=64)
  with pytest.raises(ValueError, match="not tensor=2; fold the rest into fsdp"):
    check_te_ep_layout({"tensor": 2, "expert": 4}, num_experts=64)
  with pytest.raises(ValueError, match="the 12 experts to divide evenly over EP=8"):
    check_te_ep_layout({"expert": 8}, num_experts=12)


def test_quantization_needs_te():
  check_quantization("none", "tiled")
  check_quantization("mxfp8", "te")
  with pytest.raises(ValueError, match="moe_gemm_quantization=fp8 needs moe_gemm_backend=te .* not tiled"):
    check_quantization("fp8", "tiled")
  check_quantization("mxfp8", "te", "te_ep")
  check_quantization("fp8", "te", "all_to_all")
  with pytest.raises(ValueError, match="mxfp8 needs 128-row aligned expert groups, .* .this run uses all_to_all."):
    check_quantization("mxfp8", "te", "all_to_all")


@pytest.mark.parametrize(
  ("overrides", "expected"),
  [
    (
      ["moe_dispatch=te_ep", "ici_expert_parallelism=2"],
      f"moe_dispatch=te_ep cannot run here: Transformer Engine does not import ({te.status().reason})",
    ),
    (["moe_gemm_backend=te"], f"moe_gemm_backend=te needs Transformer Engine on a GPU ({te.status().reason})"),
    (["moe_gemm_quantization=fp8"], "moe_gemm_quantization=fp8 needs moe_gemm_backend=te"),
  ],
)
def test_launch_refuses_the_te_path_here_in_one_line(overrides, expected, resolution):
  cfg = resolution.resolve(TINY, overrides)
  with pytest.raises(UserError) as e:
    check_moe_path(cfg)
  assert str(e.value).startswith(expected) and "\n" not in str(e.value)


def test_te_moe_block_cannot_update_the_routing_bias(resolution):
  """Delegating to MaxText's own TE block: MaxText 0.2.5 refuses DeepSeek-V3's bias update there itself."""
  with pytest.raises(UserError, match="te_moe_block=True does not currently support routed_bias_update_rate > 0"):
    # the tiny model updates its routing bias (routed_bias_update_rate > 0), as DeepSeek-V3 does
    resolution.resolve(
      TINY, ["moe_impl=maxtext", "te_moe_block=true", "te_gmm_quantization=te_no_quant", "prefuse_moe_weights=true"]
    )


def test_doctor_reports_te_unavailable_with_the_real_reason(tmp_path):
  r = run_cli(["doctor", "--json"], cwd=tmp_path)
  assert r.returncode == 0, r.stderr
  report = json.loads(r.stdout)  # stdout holds the JSON object alone
  assert report["platform"] == "cpu" and report["local_devices"] == 1
  assert report["transformer_engine"] == {
    "available": False,
    "version": None,
    "reason": te.status().reason,
    "pinned": te.PINNED,
  }
  assert report["te_ep"]["available"] is False and report["te_ep"]["reasons"][0].startswith("Transformer Engine")
  assert report["ragged_all_to_all"] is False
  assert report["auto"]["gemm"] == "tiled" and report["auto"]["dispatch_with_ep"] == "all_to_all"
  table = run_cli(["doctor"], cwd=tmp_path).stdout
  assert "Transformer Engine   no" in table and te.status().reason in table
  assert "auto dispatch, EP>1  all_to_all" in table


def test_te_ep_through_the_cli_is_one_line_and_writes_nothing(tmp_path):
  r = run_cli(["train", "moe_dispatch=te_ep", "ici_expert_parallelism=2"], cwd=tmp_path, devices=2)
  assert r.returncode == 2, r.stderr
  errors = [line for line in r.stderr.splitlines() if line.startswith("maxtext-moe: error:")]
  assert len(errors) == 1 and "moe_dispatch=te_ep cannot run here" in errors[0], r.stderr
  assert "Traceback" not in r.stderr and not (tmp_path / "runs").exists()


# ---- on a GPU with Transformer Engine ----

needs_te = pytest.mark.skipif(
  jax.default_backend() != "gpu" or not te.status().available, reason="needs a GPU with Transformer Engine"
)


@pytest.mark.gpu
@needs_te
def test_te_grouped_gemm_matches_tiled_outputs_and_gradients():
  from maxtext_moe.moe.gemm import grouped_matmul

  k = jax.random.split(jax.random.PRNGKey(0), 3)
  e, d, f, rows = 8, 256, 512, 2048
  sizes = jnp.bincount(jax.random.randint(k[0], (rows - 100,), 0, e), length=e).astype(jnp.int32)  # 100 tail rows
  x = jax.random.normal(k[1], (rows, d), jnp.bfloat16)
  w = (jax.random.normal(k[2], (e, d, f)) / 16).astype(jnp.bfloat16)

  def loss(backend):
    return jax.jit(
      jax.value_and_grad(
        lambda x, w: jnp.sum(grouped_matmul(x, w, sizes, backend=backend).astype(jnp.float32) ** 2), (0, 1)
      )
    )

  (v_te, g_te), (v_ref, g_ref) = loss("te")(x, w), loss("tiled")(x, w)
  np.testing.assert_allclose(v_te, v_ref, rtol=2e-2)
  for a, b in zip(g_te, g_ref, strict=True):  # bf16 products: compare at bf16's resolution
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32), rtol=5e-2, atol=5e-2)
  assert not np.any(np.asarray(g_te[0][rows - 100 :], np.float32)), "tail rows take no gradient"


@pytest.mark.gpu
@pytest.mark.skipif(
  jax.default_backend() != "gpu" or not te.status().available or len(jax.devices()) < 2,
  reason="needs 2+ GPUs with Transformer Engine",
)
def test_te_ep_matches_all_to_all_across_processes(tmp_path):
  """One process per GPU (TE EP's requirement): each runs the block with te_ep and with all_to_all on the
  same tokens and compares outputs, gradients, token conservation and the bias update's load."""
  n = len(jax.devices())
  procs = [
    subprocess.Popen(
      [sys.executable, str(REPO / "tests" / "gpu_ep_worker.py"), str(i), str(n), str(tmp_path / f"{i}.json")],
      env=dict(os.environ, CUDA_VISIBLE_DEVICES=str(i), XLA_FLAGS=""),
    )
    for i in range(n)
  ]
  assert all(p.wait(timeout=600) == 0 for p in procs)
  for i in range(n):
    result = json.loads((tmp_path / f"{i}.json").read_text())
    assert result["max_abs_diff_out"] < 5e-2 and result["max_abs_diff_grad"] < 5e-2, result
    assert result["dropped"] == 0 and result["load_equal"], result


def test_under_pipeline_stages_auto_is_never_tes_grouped_gemm(monkeypatch):
  """TE 2.20's grouped GEMM cannot be vmapped over MaxText's pipeline stages (its primitives' batching
  rules fail at trace time): where TE imports, `auto` picks it without stages and tokamax with them."""
  import types  # pylint: disable=import-outside-toplevel

  from maxtext_moe.upstream.maxtext import moe_layer  # pylint: disable=import-outside-toplevel

  monkeypatch.setattr(moe_layer, "detect_platform", lambda: GPU_TE)
  monkeypatch.setattr(moe_layer, "dispatch_for", lambda cfg, **_: DispatchKind.ALL_TO_ALL)
  cfg = types.SimpleNamespace(moe_gemm_backend="auto", recipe_num_devices=16, using_pipeline_parallelism=False)
  assert moe_layer.resolved_kinds(cfg) == (DispatchKind.ALL_TO_ALL, GemmBackend.TE)
  cfg.using_pipeline_parallelism = True
  assert moe_layer.resolved_kinds(cfg) == (DispatchKind.ALL_TO_ALL, GemmBackend.TOKAMAX)
