"""The TE manifest: every Transformer Engine function, class and attribute the TE seam uses (`upstream/te/calls.py`
and `upstream/te/compile_target.py`, `SEAMS`), with its
parameters as TE 2.20.2's own Python sources declare them.

TE cannot be imported without CUDA (`import transformer_engine` raises RuntimeError), so neither the
upstream manifest's `inspect.signature` nor an import check can guard this seam on CPU. Both sides are
read as syntax trees instead (hand-written for that reason; `ast` is the standard library's):
- `uses(source)`: every TE reference in calls.py: the module aliases its `from transformer_engine... import`
  lines bind, each call through them (positional count, keyword names) and each attribute read;
- `te_sources.pin(read_source, targets)`: each target's parameters, read from the distribution's sources
  (scripts/pin_te.py runs it on the downloaded wheel; `transformer_engine-2.20.2-py3-none-any.whl` holds
  transformer_engine/jax/*.py, the `transformer_engine_jax` sdist only the C++ extension);
- `violations(uses, manifest)`: calls TE would reject: a keyword it does not take, too many positional
  arguments, a required parameter left out, or a symbol it lacks.
tests/test_te_contract.py runs the last one on calls.py against manifest.json.
"""

import ast
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from maxtext_moe.upstream.te.sources import (
  KEYWORD_ONLY,
  POSITIONAL,
  POSITIONAL_ONLY,
  VAR_KEYWORD,
  VAR_POSITIONAL,
  name_chain,
)

ROOT = "transformer_engine"
MANIFEST = Path(__file__).with_name("manifest.json")
SEAM = Path(__file__).with_name("calls.py")
# The seam's files: calls.py, and compile_target.py (TE answered for a GPU that is not there, for compiles only).
SEAMS = (SEAM, Path(__file__).with_name("compile_target.py"))


@dataclass(frozen=True)
class Use:
  """One TE reference in our source: "module:Qual.name", and for a call what it passes."""

  target: str
  line: int
  call: bool
  positional: int = 0
  keywords: tuple[str, ...] = ()
  unpacked: bool = False  # *args or **kwargs at the call: not checkable


def seam_uses() -> list[Use]:
  """Every TE reference in the seam's files."""
  return [u for path in SEAMS for u in uses(path.read_text())]


def load() -> dict[str, Any]:
  return json.loads(MANIFEST.read_text())


# ---- our side: the uses in calls.py ----


def _aliases(tree: ast.AST) -> dict[str, str]:
  """Local name -> TE module, from every `from transformer_engine.x import y` (y a module or a name)."""
  out = {}
  for node in ast.walk(tree):
    if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == ROOT:
      for alias in node.names:
        out[alias.asname or alias.name] = f"{node.module}.{alias.name}"
  return out


def uses(source: str) -> list[Use]:
  """Every TE call and attribute read in `source`, resolved through its TE import aliases.

  An alias bound to a module (`from transformer_engine.jax import dense`) gives "transformer_engine.jax.dense:
  grouped_dense" for `dense.grouped_dense`; `pin` decides later whether a path names a module or a symbol.
  """
  tree = ast.parse(source)
  aliases = _aliases(tree)
  found: list[Use] = []
  inner: set[int] = set()  # attribute nodes that are part of a longer chain or a call's function
  for node in ast.walk(tree):
    if isinstance(node, ast.Call):
      inner.add(id(node.func))
    if isinstance(node, ast.Attribute):
      inner.add(id(node.value))
  for node in ast.walk(tree):
    if isinstance(node, ast.Call):
      chain = name_chain(node.func)
      if chain and chain[0] in aliases and len(chain) > 1:
        found.append(
          Use(
            _target(aliases[chain[0]], chain[1:]),
            node.lineno,
            True,
            positional=sum(not isinstance(a, ast.Starred) for a in node.args),
            keywords=tuple(k.arg for k in node.keywords if k.arg is not None),
            unpacked=any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords),
          )
        )
    elif isinstance(node, ast.Attribute) and id(node) not in inner:
      chain = name_chain(node)
      if chain and chain[0] in aliases:
        found.append(Use(_target(aliases[chain[0]], chain[1:]), node.lineno, False))
  return sorted(found, key=lambda u: (u.line, u.target))


def _target(module: str, attrs: list[str]) -> str:
  return f"{module}:{'.'.join(attrs)}"


# ---- the check ----


def violations(found: list[Use], symbols: dict[str, Any], *, version: str) -> list[str]:
  """One line per use TE would reject (or that the manifest cannot vouch for)."""
  problems = []
  for use in found:
    entry = symbols.get(use.target)
    where = f"calls.py:{use.line}"
    if entry is None:
      problems.append(f"{where}: {use.target} is not in TE {version} (renamed or removed?)")
      continue
    if not use.call:
      continue
    if use.unpacked:
      problems.append(f"{where}: {use.target} is called with *args/**kwargs, which this check cannot verify")
      continue
    if entry["kind"] == "attribute":
      continue
    params = entry["params"]
    kinds = {kind for _, kind, _ in params}
    positional = [p for p in params if p[1] in (POSITIONAL_ONLY, POSITIONAL)]
    by_keyword = {name for name, kind, _ in params if kind in (POSITIONAL, KEYWORD_ONLY)}
    if use.positional > len(positional) and VAR_POSITIONAL not in kinds:
      problems.append(f"{where}: {use.target} takes {len(positional)} positional arguments, given {use.positional}")
    for keyword in use.keywords:
      if keyword not in by_keyword and VAR_KEYWORD not in kinds:
        problems.append(f"{where}: {use.target} has no parameter '{keyword}'")
    given = {p[0] for p in positional[: use.positional]} | (set(use.keywords) & by_keyword)
    for name, kind, has_default in params:
      if not has_default and kind in (POSITIONAL_ONLY, POSITIONAL, KEYWORD_ONLY) and name not in given:
        problems.append(f"{where}: {use.target} needs '{name}', which is not passed")
  return problems
