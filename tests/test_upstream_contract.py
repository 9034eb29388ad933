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
