"""The Transformer Engine seam against TE's real API (upstream/te/manifest.json, read from TE 2.20.2's sources by
scripts/pin_te.py): every TE call in upstream/te/calls.py passes only parameters TE takes, with the right
positional arity and every required one; the check fails when TE renames or drops something."""

import ast
import copy
from pathlib import Path

import pytest

from maxtext_moe.upstream.te import calls as te
from maxtext_moe.upstream.te import manifest as te_manifest
from maxtext_moe.upstream.te import sources as te_sources

PACKAGE = Path(te_manifest.__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pinned():
  return te_manifest.load()


def _check(source: str, pinned: dict) -> list[str]:
  return te_manifest.violations(te_manifest.uses(source), pinned["symbols"], version=pinned["version"])


def test_every_te_call_matches_the_pinned_api(pinned):
  uses = te_manifest.seam_uses()
  assert len({u.target for u in uses}) >= 22, "the seam's TE uses were not found"
  for path in te_manifest.SEAMS:
    assert _check(path.read_text(), pinned) == [], path
  # The manifest holds exactly what the seam uses: nothing stale, nothing unlisted.
  assert sorted(pinned["symbols"]) == sorted({u.target for u in uses})
  assert pinned["version"] == te.PINNED
  assert pinned["distribution"] == f"transformer_engine-{te.PINNED}-py3-none-any.whl"


def test_the_check_fails_on_a_wrong_name(pinned):
  """What a TE rename looks like from our side: a keyword, a function, an attribute it does not have."""
  source = te_manifest.SEAM.read_text()
  cases = [  # (what calls.py says, what it would say after a rename, the name the check must report)
    ("max_tokens_per_rank=tokens_per_rank", "max_tokens_per_rank_typo=tokens_per_rank", "max_tokens_per_rank_typo"),
    ("= ep.ep_dispatch(", "= ep.ep_dispatch_v2(", "ep_dispatch_v2"),
    ("ScalingMode.MXFP8_1D_SCALING\n", "ScalingMode.MXFP8_SCALING\n", "MXFP8_SCALING"),
  ]
  for old, new, name in cases:
    assert old in source, old
    problems = _check(source.replace(old, new, 1), pinned)
    assert problems and name in problems[0], (new, problems)
  # Dropping a required argument and passing one positional too many are caught too.
  problems = _check(source.replace("      hidden_dim=hidden_dim,\n", ""), pinned)
  assert any("needs 'hidden_dim'" in p for p in problems), problems
  problems = _check(source.replace("weights_TK.astype(jnp.float32), capacity\n", "weights_TK, capacity, 0\n"), pinned)
  assert any("takes 5 positional arguments, given 6" in p for p in problems), problems


def test_the_check_fails_when_te_changes_a_signature(pinned):
  """The other direction: a new TE that renamed ep_bootstrap's parameter and made a new one required."""
  changed = copy.deepcopy(pinned)
  params = changed["symbols"]["transformer_engine.jax.ep:ep_bootstrap"]["params"]
  for p in params:
    if p[0] == "max_tokens_per_rank":
      p[0] = "max_send_tokens_per_rank"
  params.append(["ep_group", "keyword_only", False])
  problems = _check(te_manifest.SEAM.read_text(), changed)
  assert any("no parameter 'max_tokens_per_rank'" in p for p in problems), problems
  assert any("needs 'max_send_tokens_per_rank'" in p for p in problems), problems
  assert any("needs 'ep_group'" in p for p in problems), problems


def test_te_is_imported_only_in_the_seam_and_the_seam_imports_nothing_of_ours():
  for path in PACKAGE.rglob("*.py"):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
      names = (
        [a.name for a in node.names]
        if isinstance(node, ast.Import)
        else [node.module or ""]
        if isinstance(node, ast.ImportFrom)
        else []
      )
      if any(n.split(".")[0] == "transformer_engine" for n in names):
        assert path in te_manifest.SEAMS, (
          f"{path} imports Transformer Engine outside upstream/te/calls.py, compile_target.py"
        )
      if path == te_manifest.SEAM:
        assert not any(n.startswith("maxtext_moe") for n in names), "upstream/te/calls.py must import nothing of ours"


# A miniature distribution with each way TE 2.20.2 defines or re-exports what we call.
_FAKE = {
  "transformer_engine/__init__.py": "",
  "transformer_engine/jax/__init__.py": "",
  "transformer_engine/jax/cpp_extensions/__init__.py": "from .ep import *\n",
  "transformer_engine/jax/cpp_extensions/ep.py": (
    "from dataclasses import dataclass\n@dataclass\nclass EpLayerConfig:\n  top_k: int\n  alignment: int = 0\n"
  ),
  "transformer_engine/jax/ep.py": (
    "import transformer_engine.jax.cpp_extensions as tex\n"
    "from functools import partial\n"
    "EpLayerConfig = tex.EpLayerConfig\n"
    "@partial(jax.custom_vjp, nondiff_argnums=(0,))\n"
    "def ep_dispatch(cfg, idx, tokens, /, weights, *, capacity=0, **extra):\n  pass\n"
  ),
  "transformer_engine/jax/quantize/__init__.py": "from .quantizer import *\n",
  "transformer_engine/jax/quantize/quantizer.py": (
    "class QuantizerFactory:\n"
    "  @staticmethod\n  def create_set(n=1, *, scaling_mode=None):\n    pass\n"
    "  def method(self, a):\n    pass\n"
    "noop_quantizer_set = object()\n"
  ),
  "transformer_engine/jax/dense.py": "from .quantize import noop_quantizer_set\n",
}


def test_pin_follows_every_kind_of_definition():
  symbols = te_sources.pin(
    _FAKE.get,
    [
      "transformer_engine.jax.ep:EpLayerConfig",
      "transformer_engine.jax.ep:ep_dispatch",
      "transformer_engine.jax.quantize.quantizer:QuantizerFactory.create_set",
      "transformer_engine.jax.quantize.quantizer:QuantizerFactory.method",
      "transformer_engine.jax.dense:noop_quantizer_set",
      "transformer_engine.jax.quantize:QuantizerFactory",
      "transformer_engine.jax.ep:ep_combine",  # absent: left out
    ],
  )
  assert symbols == {
    "transformer_engine.jax.ep:EpLayerConfig": {
      "kind": "class",
      "params": [["top_k", "positional_or_keyword", False], ["alignment", "positional_or_keyword", True]],
    },
    "transformer_engine.jax.ep:ep_dispatch": {
      "kind": "function",
      "params": [
        ["cfg", "positional_only", False],
        ["idx", "positional_only", False],
        ["tokens", "positional_only", False],
        ["weights", "positional_or_keyword", False],
        ["capacity", "keyword_only", True],
        ["extra", "var_keyword", True],
      ],
    },
    "transformer_engine.jax.quantize.quantizer:QuantizerFactory.create_set": {
      "kind": "function",
      "params": [["n", "positional_or_keyword", True], ["scaling_mode", "keyword_only", True]],
    },
    "transformer_engine.jax.quantize.quantizer:QuantizerFactory.method": {
      "kind": "function",
      "params": [["a", "positional_or_keyword", False]],
    },
    "transformer_engine.jax.dense:noop_quantizer_set": {"kind": "attribute", "params": []},
    "transformer_engine.jax.quantize:QuantizerFactory": {"kind": "class", "params": []},
  }
  # Positional-only parameters cannot be passed by keyword; **extra takes any other keyword.
  src = (
    "from transformer_engine.jax import ep\n"
    "ep.ep_dispatch(1, 2, tokens=3, weights=4, anything=5)\n"
    "ep.ep_dispatch(*args)\n"
  )
  problems = te_manifest.violations(te_manifest.uses(src), symbols, version="fake")
  assert problems == [
    "calls.py:2: transformer_engine.jax.ep:ep_dispatch needs 'tokens', which is not passed",
    "calls.py:3: transformer_engine.jax.ep:ep_dispatch is called with *args/**kwargs, which this check cannot verify",
  ]
