"""The manifest: every upstream (MaxText, Orbax, jax's private modules) symbol we use, pinned to its exact signature.

`manifest.json` maps "module:attribute.path" to a fingerprint: the symbol's `inspect.signature` as text
for functions and methods, of `__init__` for classes; for pydantic models (MaxText's config class) a digest of their
fields; for other values their type (and a digest of their repr when it names no path). Two checks use it
(tests/test_upstream_contract.py):
- `drift()`: symbols whose fingerprint changed or that no longer exist;
- `unlisted()`: upstream references in our source (found by reading its syntax tree) that the manifest
  lacks, and upstream imports outside `maxtext_moe/upstream/`.
Methods reached through instances (`layer.get_topk`) cannot be found by reading the source, so the
manifest lists them by hand. `python scripts/pin_upstream.py` rewrites the file for a new pin.
"""

import ast
import hashlib
import importlib
import importlib.util
import inspect
import json
import re
import typing
from pathlib import Path
from typing import Any

UPSTREAM_ROOTS = ("maxtext", "orbax", "jax._src")  # jax's public API is not a seam; its private modules are


def _is_upstream(name: str) -> bool:
  return any(name == root or name.startswith(f"{root}.") for root in UPSTREAM_ROOTS)


PACKAGE_DIR = Path(__file__).resolve().parents[1]
MANIFEST = Path(__file__).with_name("manifest.json")


def load() -> dict[str, str]:
  """{"module:attr.path": fingerprint} as pinned."""
  return json.loads(MANIFEST.read_text())["symbols"]


def resolve(key: str) -> Any:
  """The object a "module:attr.path" key names."""
  module, _, attrs = key.partition(":")
  obj: Any = importlib.import_module(module)
  for part in attrs.split(".") if attrs else ():
    obj = getattr(obj, part)
  return obj


def _digest(text: str) -> str:
  return hashlib.sha256(text.encode()).hexdigest()[:16]


def _signature(fn: Any) -> str:
  try:
    return re.sub(r"0x[0-9a-f]+", "0x?", str(inspect.signature(fn)))
  except (TypeError, ValueError):
    return f"callable {type(fn).__name__}"


def fingerprint(obj: Any) -> str:
  """What must not change about `obj` for our use of it to stay right (see the module docstring)."""
  if typing.get_origin(obj) is not None:  # a type alias such as MaxText's closed Literal of model names
    return f"type alias {_digest(repr(obj))}"
  if inspect.isclass(obj) and hasattr(obj, "model_fields"):
    fields = sorted((name, str(f.annotation)) for name, f in obj.model_fields.items())
    return f"pydantic model {_digest(repr(fields))}"
  if inspect.isclass(obj):  # its constructor (a metaclass, as NNX's, would hide it from signature(cls))
    return f"class {_signature(obj.__init__)}"
  if callable(obj):
    return _signature(obj)
  if isinstance(obj, str | Path):
    return type(obj).__name__  # a path depends on where the package is installed
  return f"{type(obj).__name__} {_digest(repr(obj))}"


def drift(symbols: dict[str, str] | None = None) -> list[str]:
  """One line per manifest symbol that is gone or whose fingerprint changed."""
  problems = []
  for key, pinned in (load() if symbols is None else symbols).items():
    try:
      now = fingerprint(resolve(key))
    except (ImportError, AttributeError) as e:
      problems.append(f"{key}: gone ({e})")
      continue
    if now != pinned:
      problems.append(f"{key}: pinned {pinned}, installed {now}")
  return problems


def _is_module(name: str) -> bool:
  try:
    return importlib.util.find_spec(name) is not None
  except (ImportError, ValueError):
    return False


def _aliases(tree: ast.Module) -> dict[str, str]:
  """{local name: upstream module or "module:attr"} for the file's upstream imports."""
  out = {}
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      for a in node.names:
        if _is_upstream(a.name):
          out[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
    elif isinstance(node, ast.ImportFrom) and node.module and _is_upstream(node.module):
      for a in node.names:
        full = f"{node.module}.{a.name}"
        out[a.asname or a.name] = full if _is_module(full) else f"{node.module}:{a.name}"
  return out


def _chain(node: ast.AST) -> list[str] | None:
  """["a", "b", "c"] for the expression a.b.c, None for anything else."""
  parts = []
  while isinstance(node, ast.Attribute):
    parts.append(node.attr)
    node = node.value
  return [node.id, *reversed(parts)] if isinstance(node, ast.Name) else None


def _reference(target: str, attrs: list[str]) -> str:
  """The manifest key of `target` (module or "module:attr") followed by `attrs`."""
  if ":" in target:
    return ".".join([target, *attrs])
  module = target
  while attrs and _is_module(f"{module}.{attrs[0]}"):
    module = f"{module}.{attrs.pop(0)}"
  return f"{module}:{'.'.join(attrs)}" if attrs else module


def references(path: Path) -> set[str]:
  """Every upstream symbol `path` names: imported names and the attribute chains used on them."""
  tree = ast.parse(path.read_text())
  aliases = _aliases(tree)
  refs = {t for t in aliases.values() if ":" in t}
  for node in ast.walk(tree):  # a.b.c records a.b too: the manifest lists every prefix that is a symbol
    if isinstance(node, ast.Attribute) and (chain := _chain(node)) and chain[0] in aliases:
      refs.add(_reference(aliases[chain[0]], chain[1:]))
    if (named := _patched(node)) and (chain := _chain(named[0])) and chain[0] in aliases:
      refs.add(_reference(aliases[chain[0]], [*chain[1:], named[1]]))
  return {r for r in refs if ":" in r}


def _patched(node: ast.AST) -> tuple[ast.AST, str] | None:
  """(owner, name) of `Patch(owner, "name", ...)` and `original(owner, "name")`: what we replace or call."""
  if not isinstance(node, ast.Call) or len(node.args) < 2 or not isinstance(node.func, ast.Name | ast.Attribute):
    return None
  func = node.func.id if isinstance(node.func, ast.Name) else node.func.attr
  name = node.args[1]
  if func in ("Patch", "original") and isinstance(name, ast.Constant) and isinstance(name.value, str):
    return node.args[0], name.value
  return None


def all_references() -> set[str]:
  """Every upstream symbol our package names, plus those the manifest lists by hand."""
  found = set().union(*(references(p) for p in PACKAGE_DIR.rglob("*.py")))
  return found | set(json.loads(MANIFEST.read_text())["by_hand"])


def _imports_upstream(path: Path) -> bool:
  for node in ast.walk(ast.parse(path.read_text())):
    names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
    names += [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
    if any(_is_upstream(n) for n in names):
      return True
  return False


def unlisted(symbols: dict[str, str] | None = None, *, package_dir: Path = PACKAGE_DIR) -> list[str]:
  """One line per upstream reference missing from the manifest, and per upstream import outside upstream/."""
  listed = set(load() if symbols is None else symbols)
  problems = []
  for path in sorted(package_dir.rglob("*.py")):
    rel = path.relative_to(package_dir)
    refs = references(path)
    if _imports_upstream(path) and rel.parts[0] != "upstream":
      problems.append(f"{rel}: imports upstream code outside maxtext_moe/upstream/")
    problems += [f"{rel}: uses {r}, which the manifest does not list" for r in sorted(refs) if r not in listed]
  return problems
