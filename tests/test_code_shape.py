"""How the package reads (STYLE.md): small modules and functions, and imports that only run downward."""

import ast
import statistics
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "maxtext_moe"
# Lowest first. A module may import its own package and any lower one, never a higher one or a sibling of
# the same rank; `moe` and `config` therefore import nothing of ours above them.
LAYERS = {
  "errors": 0,
  "glibc": 0,
  "stderr": 0,
  "moe": 1,
  "data": 1,
  "config": 2,
  "upstream": 3,
  "checkpoint": 4,
  "planner": 4,
  "launch": 5,
  "bench": 6,
  "cli": 7,
  "__main__": 8,
  # The Transformer Engine seam imports nothing of ours (tests/test_te_contract.py), so the MoE math may
  # call it: a leaf, not the rest of `upstream`.
  "upstream.te": 0,
}
TE_SEAM = "maxtext_moe.upstream.te"
MAX_MODULE_LINES = 300
MAX_FUNCTION_LINES = 60


def _modules() -> list[Path]:
  return sorted(p for p in PACKAGE.rglob("*.py"))


def _part(path: Path) -> str:
  rel = path.relative_to(PACKAGE)
  return rel.parts[0].removesuffix(".py") if len(rel.parts) > 1 or rel.stem != "__init__" else "__init__"


def _our_imports(path: Path) -> set[str]:
  """The top-level parts of maxtext_moe this module imports (`moe`, `config`, ...)."""
  parts = set()
  for node in ast.walk(ast.parse(path.read_text())):
    names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
    if isinstance(node, ast.ImportFrom) and node.module and not node.level:
      expand = node.module in ("maxtext_moe", "maxtext_moe.upstream")
      names = [f"{node.module}.{a.name}" for a in node.names] if expand else [node.module]
      names = names if node.module != "maxtext_moe" else [node.module, *names]
    for name in names:
      if name == TE_SEAM:
        parts.add("upstream.te")
      elif name.startswith("maxtext_moe.") and name.count(".") >= 1:
        parts.add(name.split(".")[1])
  return parts


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_only_run_downward(path):
  part = _part(path)
  if part == "__init__":
    return
  rank = LAYERS[part]
  upward = sorted(p for p in _our_imports(path) if p != part and LAYERS[p] >= rank)
  assert upward == [], f"{part} (layer {rank}) imports {upward}"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_module_is_small(path):
  assert len(path.read_text().splitlines()) <= MAX_MODULE_LINES


def _functions() -> list[tuple[str, int]]:
  out = []
  for path in _modules():
    for node in ast.walk(ast.parse(path.read_text())):
      if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        out.append((f"{path.relative_to(PACKAGE)}:{node.name}", node.end_lineno - node.lineno + 1))
  return out


def test_functions_are_short():
  lengths = [n for _, n in _functions()]
  long = [(name, n) for name, n in _functions() if n > MAX_FUNCTION_LINES]
  assert long == []
  assert statistics.median(lengths) <= 10


def test_every_part_has_a_layer():
  parts = {_part(p) for p in _modules()} - {"__init__"}
  assert parts <= set(LAYERS), parts - set(LAYERS)
