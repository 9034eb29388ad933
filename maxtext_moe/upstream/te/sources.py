"""Signatures read from a Transformer Engine distribution's Python sources, without importing it (TE
raises RuntimeError on import without CUDA): `pin(read, targets)` finds each "module:Qual.name" target by
following definitions, `from X import name`, `from X import *` and `name = module.Name` re-exports, and
records its parameters as inspect would name them. Hand-written on the standard library's `ast` for that
reason. scripts/pin_te.py writes manifest.json with it; manifest.py checks our calls against that.
"""

import ast
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# Parameter kinds, as inspect names them.
POSITIONAL_ONLY, POSITIONAL, VAR_POSITIONAL, KEYWORD_ONLY, VAR_KEYWORD = (
  "positional_only",
  "positional_or_keyword",
  "var_positional",
  "keyword_only",
  "var_keyword",
)


def name_chain(node: ast.AST) -> list[str] | None:
  """`a.b.c` -> ["a", "b", "c"]; None for anything that is not a plain name chain."""
  parts = []
  while isinstance(node, ast.Attribute):
    parts.append(node.attr)
    node = node.value
  if not isinstance(node, ast.Name):
    return None
  return [node.id, *reversed(parts)]


def _params(fn: ast.FunctionDef, *, drop_first: bool) -> list[list[Any]]:
  a = fn.args
  positional = [*a.posonlyargs, *a.args]
  n_defaults = len(a.defaults)
  out = []
  for i, arg in enumerate(positional):
    kind = POSITIONAL_ONLY if i < len(a.posonlyargs) else POSITIONAL
    out.append([arg.arg, kind, i >= len(positional) - n_defaults])
  if a.vararg:
    out.append([a.vararg.arg, VAR_POSITIONAL, True])
  for arg, default in zip(a.kwonlyargs, a.kw_defaults, strict=True):
    out.append([arg.arg, KEYWORD_ONLY, default is not None])
  if a.kwarg:
    out.append([a.kwarg.arg, VAR_KEYWORD, True])
  return out[1:] if drop_first and out else out


def _decorators(node: ast.AST) -> set[str]:
  names = set()
  for d in getattr(node, "decorator_list", []):
    d = d.func if isinstance(d, ast.Call) else d
    chain = name_chain(d)
    if chain:
      names.add(chain[-1])
  return names


def _class_params(cls: ast.ClassDef) -> list[list[Any]]:
  """A class's constructor: its __init__, else its dataclass fields in order."""
  for node in cls.body:
    if isinstance(node, ast.FunctionDef) and node.name == "__init__":
      return _params(node, drop_first=True)
  if "dataclass" not in _decorators(cls):
    return []
  return [
    [node.target.id, POSITIONAL, node.value is not None]
    for node in cls.body
    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
  ]


@dataclass(frozen=True)
class _Hit:
  """Where a name is defined: a submodule, a def/class node, or a plain value (node None)."""

  module: str
  node: ast.AST | None = None
  is_module: bool = False


class _Sources:
  """TE's modules by dotted name, parsed on demand from `read(relative_path) -> text | None`."""

  def __init__(self, read: Callable[[str], str | None]):
    self._read, self._trees = read, {}

  def tree(self, module: str) -> tuple[ast.Module, bool] | None:
    """(syntax tree, is_package) of a module, None where the distribution has no such module."""
    if module not in self._trees:
      base = module.replace(".", "/")
      self._trees[module] = None
      for path, package in ((f"{base}.py", False), (f"{base}/__init__.py", True)):
        text = self._read(path)
        if text is not None:
          self._trees[module] = (ast.parse(text), package)
          break
    return self._trees[module]

  def absolute(self, module: str, node: ast.ImportFrom) -> str:
    """The module an ImportFrom in `module` names, relative levels resolved."""
    if not node.level:
      return node.module or ""
    parts = module.split(".")
    base = parts if self.tree(module)[1] else parts[:-1]
    base = base[: len(base) - node.level + 1]
    return ".".join([*base, *([node.module] if node.module else [])])

  def find(self, module: str, name: str, seen: frozenset = frozenset()) -> _Hit | None:
    """Where `name`, read in `module`, is defined, following re-exports."""
    if (module, name) in seen or self.tree(module) is None:
      return None
    seen = seen | {(module, name)}
    if self.tree(f"{module}.{name}") is not None:
      return _Hit(f"{module}.{name}", is_module=True)
    tree, _ = self.tree(module)
    stars = []
    for node in tree.body:
      if isinstance(node, ast.FunctionDef | ast.ClassDef) and node.name == name:
        return _Hit(module, node)
      if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
        chain = name_chain(node.value)
        return (self._through_alias(module, tree, chain) if chain and len(chain) == 2 else None) or _Hit(module)
      if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
        return _Hit(module)
      if isinstance(node, ast.ImportFrom):
        source = self.absolute(module, node)
        for alias in node.names:
          if alias.name == "*":
            stars.append(source)
          elif (alias.asname or alias.name) == name:
            return self.find(source, alias.name, seen)
    return next((hit for source in stars if (hit := self.find(source, name, seen))), None)

  def _through_alias(self, module: str, tree: ast.Module, chain: list[str]) -> _Hit | None:
    """`name = tex.Name`: follow `tex` (`import a.b as tex` or `from a import b`) to where Name lives."""
    head, attr = chain
    for node in tree.body:
      if isinstance(node, ast.Import | ast.ImportFrom):
        for alias in node.names:
          if (alias.asname or alias.name) == head:
            source = alias.name if isinstance(node, ast.Import) else f"{self.absolute(module, node)}.{alias.name}"
            return self.find(source, attr)
    return None


def _member(node: ast.AST | None, name: str) -> ast.AST | None | bool:
  """A class's member `name`: its def/class node, None for a plain assignment, False where it has none."""
  for child in getattr(node, "body", []) if isinstance(node, ast.ClassDef) else []:
    if isinstance(child, ast.FunctionDef | ast.ClassDef) and child.name == name:
      return child
    if isinstance(child, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in child.targets):
      return None
    if isinstance(child, ast.AnnAssign) and isinstance(child.target, ast.Name) and child.target.id == name:
      return None
  return False


def _locate(sources: _Sources, target: str) -> ast.AST | None | bool:
  """The def/class node a "module:Qual.name" target names, None for a plain value, False where TE lacks it.
  The module part may itself end in a symbol (`from transformer_engine.jax.sharding import MeshResource`)."""
  module, _, qual = target.partition(":")
  names = qual.split(".")
  if sources.tree(module) is None:
    module, _, first = module.rpartition(".")
    names = [first, *names]
  hit = sources.find(module, names[0])
  node: ast.AST | None | bool = False if hit is None else hit.node
  for name in names[1:]:
    if hit is not None and hit.is_module:
      hit = sources.find(hit.module, name)
      node = False if hit is None else hit.node
    else:
      hit = None
      node = _member(node, name) if node is not False else False
    if node is False:
      return False
  return node


def pin(read: Callable[[str], str | None], targets: list[str]) -> dict[str, Any]:
  """{target: {"kind": function | class | attribute, "params": [[name, kind, has_default], ...]}} read from
  a distribution's sources; a target it lacks is left out (the contract test then reports it)."""
  sources = _Sources(read)
  out = {}
  for target in targets:
    node = _locate(sources, target)
    if node is not False:
      out[target] = _describe(node)
  return out


def _describe(node: ast.AST | None) -> dict[str, Any]:
  if isinstance(node, ast.ClassDef):
    return {"kind": "class", "params": _class_params(node)}
  if isinstance(node, ast.FunctionDef):
    decorators = _decorators(node)
    method_of_instance = node.args.args and node.args.args[0].arg in ("self", "cls")
    drop = bool(method_of_instance) and "staticmethod" not in decorators
    return {"kind": "function", "params": _params(node, drop_first=drop)}
  return {"kind": "attribute", "params": []}
