"""Fails when a MaxText symbol that maxtext_adapter calls or patches moves or changes its parameters."""

import importlib

import pytest

from maxtext_moe import maxtext_adapter


@pytest.mark.parametrize(("module", "attr", "params"), maxtext_adapter.UPSTREAM_SYMBOLS)
def test_upstream_symbol_exists_with_parameters(module, attr, params):
  sig = maxtext_adapter.upstream_signature(module, attr)
  if params:
    assert sig is not None, f"{module}.{attr} is no longer callable"
    missing = [p for p in params if p not in sig.parameters]
    assert not missing, f"{module}.{attr} lost parameters {missing}; it now takes {list(sig.parameters)}"


def test_maxtext_is_the_pinned_version():
  from importlib.metadata import version

  assert version("maxtext") == "0.2.5", "maxtext_adapter was written against maxtext 0.2.5; re-check UPSTREAM_SYMBOLS"


def test_only_the_adapter_imports_maxtext():
  """All MaxText internals are touched from one module (STYLE.md)."""
  import pathlib
  import re

  pkg = pathlib.Path(importlib.import_module("maxtext_moe").__file__).parent
  offenders = [
    str(p.relative_to(pkg))
    for p in pkg.rglob("*.py")
    if p.name != "maxtext_adapter.py" and re.search(r"^\s*(from|import) maxtext(\.| )", p.read_text(), re.M)
  ]
  assert offenders == []


def test_moe_math_imports_and_runs_without_maxtext():
  """maxtext_moe.moe must work on a bare JAX install (e.g. the GPU bench machine)."""
  import subprocess
  import sys

  code = (
    "import sys; sys.modules['maxtext'] = None\n"  # any `import maxtext...` now fails
    "import jax.numpy as jnp\n"
    "from maxtext_moe.moe.block import MoESettings, routed_experts\n"
    "from maxtext_moe.moe.dispatch import LocalDispatcher\n"
    "import maxtext_moe.bench.moe, maxtext_moe.bench.gpu_gemm\n"
    "x = jnp.ones((4, 8)); w = jnp.ones((2, 8, 8)) / 8\n"
    "y, _ = routed_experts(x, jnp.array([[0], [1], [1], [0]]), jnp.ones((4, 1)), w, w, w,\n"
    "                      dispatcher=LocalDispatcher(2), settings=MoESettings())\n"
    "assert y.shape == (4, 8)\n"
  )
  r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
  assert r.returncode == 0, r.stderr[-2000:]
