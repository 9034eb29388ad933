"""The upstream seam's contract: every MaxText and Orbax symbol we use is in the manifest with its exact
signature, nothing upstream is imported outside maxtext_moe/upstream/, and the MoE math needs no MaxText."""

import os
import subprocess
import sys
import textwrap
from importlib.metadata import version

import pytest

from maxtext_moe.upstream import manifest, patches


def test_pinned_versions_are_installed():
  pinned = manifest.json.loads(manifest.MANIFEST.read_text())["versions"]
  assert {name: version(name) for name in pinned} == pinned, "re-pin: scripts/pin_upstream.py, then read the diff"


def test_no_upstream_symbol_drifted():
  assert manifest.drift() == []


def test_every_upstream_reference_is_in_the_manifest():
  assert manifest.unlisted() == []


def test_a_changed_signature_is_caught(monkeypatch):
  """The check fails once against a deliberately changed signature: a new required parameter on a
  function we call, and a method we patch renamed away."""
  from maxtext.layers import moe as mt_moe

  def changed(top_k_indices, num_experts, rate, axis_names=None, *, new_required):
    raise AssertionError("never called")

  monkeypatch.setattr(mt_moe, "calculate_load_balance_updates", changed)
  monkeypatch.delattr(mt_moe.RoutedMoE, "get_topk")
  problems = manifest.drift()
  assert any(p.startswith("maxtext.layers.moe:calculate_load_balance_updates: pinned (top_k_indices") for p in problems)
  assert any(p.startswith("maxtext.layers.moe:RoutedMoE.get_topk: gone") for p in problems)
  assert len(problems) == 2, problems


def test_unlisted_and_misplaced_upstream_uses_are_caught(tmp_path):
  """A bare `import maxtext` outside upstream/, and an upstream function the manifest lacks."""
  (tmp_path / "upstream").mkdir()
  (tmp_path / "launch.py").write_text("import maxtext\n")
  (tmp_path / "upstream" / "seam.py").write_text(
    textwrap.dedent("""
      from maxtext.layers import moe as mt_moe
      from maxtext.utils.maxtext_utils import get_abstract_param
      mt_moe.calculate_expert_counts(None, 1)
      mt_moe.RoutedMoE.get_topk
    """)
  )
  problems = manifest.unlisted({}, package_dir=tmp_path)
  assert problems == [
    "launch.py: imports upstream code outside maxtext_moe/upstream/",
    "upstream/seam.py: uses maxtext.layers.moe:RoutedMoE, which the manifest does not list",
    "upstream/seam.py: uses maxtext.layers.moe:RoutedMoE.get_topk, which the manifest does not list",
    "upstream/seam.py: uses maxtext.layers.moe:calculate_expert_counts, which the manifest does not list",
    "upstream/seam.py: uses maxtext.utils.maxtext_utils:get_abstract_param, which the manifest does not list",
  ]
  listed = {"maxtext.layers.moe:RoutedMoE": "", "maxtext.layers.moe:RoutedMoE.get_topk": ""}
  listed |= {"maxtext.layers.moe:calculate_expert_counts": "", "maxtext.utils.maxtext_utils:get_abstract_param": ""}
  assert manifest.unlisted(listed, package_dir=tmp_path) == [problems[0]]


def test_patches_keep_originals_here_and_restore_them():
  from maxtext.layers import moe as mt_moe

  from maxtext_moe.upstream.maxtext import moe_layer

  upstream = mt_moe.RoutedMoE.sparse_matmul
  with patches.installed(moe_layer.patches()):
    assert mt_moe.RoutedMoE.sparse_matmul is moe_layer.dropless_sparse_matmul
    assert patches.original(mt_moe.RoutedMoE, "sparse_matmul") is upstream
    assert patches.installed_names() == ["RoutedMoE.__init__", "RoutedMoE.sparse_matmul"]
    assert not any(name.startswith("_moe") for name in vars(mt_moe.RoutedMoE)), "nothing stored on MaxText's class"
  assert mt_moe.RoutedMoE.sparse_matmul is upstream and patches.installed_names() == []


def test_importing_the_package_changes_nothing():
  """No environment writes, resolver registrations or patches at import (STYLE.md)."""
  code = textwrap.dedent("""
    import os, pkgutil, importlib, omegaconf
    # Third-party imports set variables of their own (jax's MOSAIC_GPU_CUDA_ROOT, MaxText's TPU_SKIP_MDS_QUERY,
    # ...): take them first, so that what is compared is what our modules do.
    import jax, maxtext.trainers.pre_train.train, maxtext.layers.moe, orbax.checkpoint, tensorstore
    before = dict(os.environ)
    import maxtext_moe
    for m in pkgutil.walk_packages(maxtext_moe.__path__, "maxtext_moe."):
      if m.name != "maxtext_moe.__main__":
        importlib.import_module(m.name)
    from maxtext_moe.upstream import patches
    assert dict(os.environ) == before, set(os.environ.items()) ^ set(before.items())
    assert not omegaconf.OmegaConf.has_resolver("moe_corpus")
    assert patches.installed_names() == []
  """)
  env = {k: v for k, v in os.environ.items() if k != "DECOUPLE_GCLOUD"}
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False)
  assert r.returncode == 0, r.stderr[-3000:]


def test_moe_math_imports_and_runs_without_maxtext():
  """maxtext_moe.moe must work on a bare JAX install (e.g. the GPU bench machine)."""
  code = (
    "import sys; sys.modules['maxtext'] = None\n"  # any `import maxtext...` now fails
    "import jax.numpy as jnp\n"
    "from maxtext_moe.moe.block import routed_experts\n"
    "from maxtext_moe.moe.settings import MoESettings\n"
    "from maxtext_moe.moe.dispatch import LocalDispatcher\n"
    "import maxtext_moe.bench.moe_speed, maxtext_moe.bench.gpu_check, maxtext_moe.tools.doctor\n"
    "x = jnp.ones((4, 8)); w = jnp.ones((2, 8, 8)) / 8\n"
    "y, _ = routed_experts(x, jnp.array([[0], [1], [1], [0]]), jnp.ones((4, 1)), w, w, w,\n"
    "                      dispatcher=LocalDispatcher(2), settings=MoESettings())\n"
    "assert y.shape == (4, 8)\n"
  )
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
  assert r.returncode == 0, r.stderr[-2000:]


_COUNT = """
import sys
from maxtext.configs import pyconfig
calls = []
real = pyconfig._initialize_pydantic
def counted(*a, **k):
  calls.append(1)
  return real(*a, **k)
pyconfig._initialize_pydantic = counted
from maxtext_moe.cli import main
rc = main(sys.argv[1:])
print(f"resolutions={len(calls)}", file=sys.stderr)
sys.exit(rc)
"""


@pytest.mark.slow
@pytest.mark.ci
def test_a_default_train_resolves_its_config_once(tmp_path):
  """One MaxText resolution for a whole `train` (MaxText's trainer is handed the object), and no re-exec."""
  args = ["train", "steps=1", "per_device_batch_size=1", "max_target_length=32", "run_name=once", "progress=silent"]
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1")
  r = subprocess.run(
    [sys.executable, "-c", _COUNT, *args], cwd=tmp_path, env=env, capture_output=True, text=True, check=False
  )
  assert r.returncode == 0, r.stderr[-3000:]
  assert "resolutions=1" in r.stderr.splitlines()[-1]
