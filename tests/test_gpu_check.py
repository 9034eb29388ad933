"""scripts/gpu_check.sh on the CPU path (--cpu-smoke), so the prepared GPU check cannot rot: every part
runs, the JSON and the table agree, and the GEMM part needs nothing but JAX."""

import json
import os
import subprocess
import sys

import pytest

from conftest import REPO

BACKENDS = {"tiled", "ragged_dot", "tokamax"}


def _env():
  return dict(os.environ, XLA_FLAGS="", JAX_PLATFORMS="cpu", PYTHON=sys.executable)


@pytest.mark.extended
def test_cpu_smoke_runs_every_part(tmp_path):
  r = subprocess.run(
    ["bash", str(REPO / "scripts" / "gpu_check.sh"), "--cpu-smoke", "--out", str(tmp_path)],
    capture_output=True,
    text=True,
    env=_env(),
    timeout=300,
  )
  assert r.returncode == 0, r.stderr[-3000:]
  result = json.loads((tmp_path / "gpu_check.json").read_text())
  assert (tmp_path / "gpu_check.txt").read_text() == r.stdout
  assert result["mode"] == "cpu-smoke" and result["environment"]["platform"] == "cpu"
  rows = {(g["backend"], g["local_experts"]): g for g in result["gemm"]}
  assert set(rows) == {(b, e) for b in BACKENDS for e in (8, 4)}
  for g in rows.values():
    assert g["fwd"] > 0 and g["fwd_bwd"] > 0 and g["rows"] == 64 * 8 and g["load_max_over_mean"] >= 1
  assert any(n.startswith("te: not measured (") for n in result["notes"])
  assert result["best_gemm_fwd_bwd"] == max(result["gemm"], key=lambda g: g["fwd_bwd"])
  layer = result["layer"]
  assert set(layer["seconds"]) == {"maxtext_sparse", "maxtext_dense", "ours"}
  assert max(layer["max_abs_diff_vs_dense"].values()) < 1e-5, "the three layers must compute the same thing"
  assert f"speedup vs sparse_matmul {layer['speedup_vs_sparse']:.1f}x" in r.stdout
  for backend in BACKENDS:
    assert f"  {backend:<12}       8" in r.stdout


@pytest.mark.extended
def test_the_gemm_part_needs_only_jax(tmp_path):
  """The bare CUDA JAX machine has neither maxtext nor its dependencies: the check still runs and says
  why the layer part is missing."""
  blocked = ("maxtext", "flax", "pydantic", "omegaconf", "rich", "orbax", "transformer_engine")
  code = (
    "import sys\n"
    f"for m in {blocked!r}: sys.modules[m] = None\n"
    "from maxtext_moe.bench.gpu_check import main\n"
    f"sys.exit(main(['--cpu-smoke', '--out', {str(tmp_path)!r}]))\n"
  )
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), cwd=REPO, timeout=300)
  assert r.returncode == 0, r.stderr[-3000:]
  result = json.loads((tmp_path / "gpu_check.json").read_text())
  assert result["layer"]["skipped"].startswith("maxtext does not import here (ModuleNotFoundError")
  assert {g["backend"] for g in result["gemm"]} >= {"tiled", "ragged_dot"}
  assert "MoE layer vs MaxText: skipped: maxtext does not import here" in r.stdout


def test_without_a_gpu_the_full_check_refuses_in_one_line(tmp_path):
  r = subprocess.run(
    [sys.executable, "-m", "maxtext_moe.bench.gpu_check", "--out", str(tmp_path)],
    capture_output=True,
    text=True,
    env=_env(),
    cwd=REPO,
  )
  assert r.returncode == 2 and r.stderr.strip() == "gpu_check: no GPU here (JAX backend cpu); use --cpu-smoke"
  r = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh"), "--bogus"], capture_output=True, text=True)
  assert r.returncode == 2 and "unknown argument '--bogus'" in r.stderr
