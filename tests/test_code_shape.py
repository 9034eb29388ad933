"""How the package reads: small modules and functions, imports that only run downward and never in a circle,
a short README, and nothing that points outside the repository."""

import ast
import re
import statistics
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "maxtext_moe"
README_MAX_LINES = 150
# Lowest first. A module may import its own package and any lower one, never a higher one or a sibling of
# the same rank; `moe` and `config` therefore import nothing of ours above them. `errors` is below every
# other module: the leaf utilities (locks, integrity, ...) raise its UserError.
LAYERS = {
  "errors": 0,
  "glibc": 1,
  "stderr": 1,
  "signals": 1,
  "locks": 1,
  "integrity": 1,
  "moe": 2,
  "data": 2,
  "config": 3,
  "upstream": 4,
  "checkpoint": 5,
  "planner": 5,
  "steptime": 6,
  "sft": 5,
  "pretrain": 5,
  "runlog": 5,
  "cluster": 6,
  "launch": 7,
  "tools": 8,
  "gpu_compile": 8,
  "bench": 9,
  "cli": 10,
  "__main__": 11,
  # The Transformer Engine seam imports nothing of ours (tests/test_te_contract.py), so the MoE math may
  # call it: a leaf, not the rest of `upstream`.
  "upstream.te": 0,
}
TE_SEAM = "maxtext_moe.upstream.te.calls"
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
      expand = node.module in ("maxtext_moe", "maxtext_moe.upstream", "maxtext_moe.upstream.te")
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


def _module_name(path: Path) -> str:
  rel = path.relative_to(PACKAGE.parent).with_suffix("")
  return ".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)


def _module_imports(path: Path, known: set[str]) -> set[str]:
  """The modules of ours that `path` imports (`from a.b import c` counts a.b.c where c is a module)."""
  found = set()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Import):
      found |= {a.name for a in node.names if a.name in known}
    elif isinstance(node, ast.ImportFrom) and node.module and not node.level and node.module.startswith("maxtext_moe"):
      subs = {f"{node.module}.{a.name}" for a in node.names} & known
      found |= subs or ({node.module} & known)
  return found


def _cycle(graph: dict[str, set[str]]) -> list[str]:
  """One import circle of `graph` (module -> modules it imports), or []."""
  state: dict[str, int] = {}
  stack: list[str] = []

  def visit(node: str) -> list[str]:
    state[node] = 1
    stack.append(node)
    for nxt in sorted(graph[node]):
      if state.get(nxt) == 1:
        return [*stack[stack.index(nxt) :], nxt]
      if nxt not in state and (found := visit(nxt)):
        return found
    stack.pop()
    state[node] = 2
    return []

  for node in sorted(graph):
    if node not in state and (found := visit(node)):
      return found
  return []


def test_no_import_circles():
  """Between our modules, at any depth (a module-level or a function-level import alike)."""
  paths = {_module_name(p): p for p in _modules()}
  graph = {name: _module_imports(path, set(paths)) - {name} for name, path in paths.items()}
  assert _cycle(graph) == []
  assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"], "the check must find a circle"


_OUTSIDE = re.compile("|".join([re.escape("../" + "shared"), re.escape("DESIGN" + ".md"), re.escape("/wo" + "rk/")]))


def test_no_file_refers_to_anything_outside_the_repository():
  """Docs, code, configs and scripts name only what a clone has (and public URLs): no notes kept beside
  the repository, no paths of the machine it was written on."""
  tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
  binary = (".parquet", ".safetensors", ".png", ".npz", ".model")
  hits = []
  for name in (f for f in tracked if not f.endswith(binary)):
    try:
      text = (REPO / name).read_text(encoding="utf-8")
    except (UnicodeDecodeError, IsADirectoryError, FileNotFoundError):
      continue
    hits += [f"{name}:{i + 1}" for i, line in enumerate(text.splitlines()) if _OUTSIDE.search(line)]
  assert hits == []


def test_readme_is_short_and_points_into_docs():
  lines = (REPO / "README.md").read_text().splitlines()
  assert len(lines) <= README_MAX_LINES
  linked = set(re.findall(r"\(docs/([\w-]+\.md)\)", "\n".join(lines)))
  assert linked == {p.name for p in (REPO / "docs").glob("*.md")}, "README's map of docs/ names every page"


def test_upstream_reaches_our_config_only_through_the_resolution_pipeline():
  """A recipe resolves in one direction (upstream/resolution.py, steps 1-7, config/ and MaxText's pieces as
  leaves): no other module under upstream/ imports config/, and upstream/ keeps its concerns in
  subpackages, ten modules at most at its top."""
  upstream = PACKAGE / "upstream"
  importers = sorted(str(p.relative_to(upstream)) for p in upstream.rglob("*.py") if "config" in _our_imports(p))
  assert importers == ["resolution.py"]
  top = sorted(p.name for p in upstream.glob("*.py"))
  assert len(top) <= 10, top
