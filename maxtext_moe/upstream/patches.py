"""Replacing upstream attributes, and putting them back: the only place that writes to MaxText's objects.

A `Patch` names an attribute of an upstream module or class and what replaces it. `install` swaps them in
and keeps each original here (never on the patched object), `uninstall` restores them all, and
`original(owner, name)` gives a replacement the function it replaced (e.g. to fall through to it).
Installing twice replaces the replacement; the kept original stays the upstream one.
"""

import contextlib
import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Patch:
  owner: Any  # a module or class
  name: str
  replacement: Any


_ORIGINALS: dict[tuple[int, str], tuple[Any, Any]] = {}  # (id(owner), name) -> (owner, original)


class Method:
  """A bound method of ours as a method of an upstream class: `Patch(Cls, "name", Method(hooks.name))`
  calls `hooks.name(instance, *args)` when upstream calls `instance.name(*args)`. (A bound method set on a
  class would not receive the instance.)"""

  def __init__(self, bound: Any):
    self.bound = bound
    self.__doc__ = getattr(bound, "__doc__", None)

  def __get__(self, instance: Any, owner: type | None = None) -> Any:
    return self if instance is None else functools.partial(self.bound, instance)


def original(owner: Any, name: str) -> Any:
  """The upstream attribute, whether or not it is patched now."""
  kept = _ORIGINALS.get((id(owner), name))
  return kept[1] if kept else getattr(owner, name)


def install(patches: Sequence[Patch]) -> None:
  for p in patches:
    _ORIGINALS.setdefault((id(p.owner), p.name), (p.owner, getattr(p.owner, p.name)))
    setattr(p.owner, p.name, p.replacement)


def uninstall(patches: Sequence[Patch] | None = None) -> None:
  """Restores the attributes `patches` name (default: every patched attribute)."""
  keys = list(_ORIGINALS) if patches is None else [(id(p.owner), p.name) for p in patches]
  for key in keys:
    if key in _ORIGINALS:
      owner, value = _ORIGINALS.pop(key)
      setattr(owner, key[1], value)


def installed_names() -> list[str]:
  """'owner.name' of each attribute patched now."""
  return sorted(f"{getattr(owner, '__name__', owner)}.{name}" for (_, name), (owner, _) in _ORIGINALS.items())


@contextlib.contextmanager
def installed(patches: Sequence[Patch]) -> Iterator[None]:
  """`patches` for the duration of a block (a run or a test), then the upstream attributes back; what
  was already patched before the block stays patched as it was."""
  before = {(id(p.owner), p.name): getattr(p.owner, p.name) for p in patches if (id(p.owner), p.name) in _ORIGINALS}
  install(patches)
  try:
    yield
  finally:
    uninstall([p for p in patches if (id(p.owner), p.name) not in before])
    for p in patches:
      if (id(p.owner), p.name) in before:
        setattr(p.owner, p.name, before[(id(p.owner), p.name)])
