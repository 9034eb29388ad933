"""Keeps the NGC image's own JAX, jaxlib, CUDA plugins, Transformer Engine and NCCL while pip installs
maxtext and the plugin on top (the image's builds match its CUDA, cuDNN and driver stack; ours would not).

  python3 docker/pins.py freeze /tmp/base.txt   # name==version of every guarded distribution in the image
  pip install -c /tmp/base.txt ...              # pip must keep them: a requirement that needs another
                                                # version fails the build with pip's resolution error
  python3 docker/pins.py check /tmp/base.txt    # and nothing changed, was removed, or is too old

Standard library only: it runs before anything of ours is installed. Exit 1 with one line per problem.
"""

import re
import sys
from importlib import metadata

GUARDED = re.compile(r"^(jax|jaxlib|jax-cuda\d+-(plugin|pjrt)|transformer-engine.*|nvidia-nccl-cu\d+)$")
MIN_VERSIONS = {"transformer-engine": (2, 20)}  # TE EP and the API upstream/te.py calls (te_manifest.json)
MIN_PYTHON = (3, 12)  # maxtext 0.2.5


def _norm(name: str) -> str:
  return re.sub(r"[-_.]+", "-", name).lower()


def installed() -> dict[str, str]:
  """{normalized name: version} of the guarded distributions present."""
  found = {}
  for dist in metadata.distributions():
    name = _norm(dist.metadata["Name"] or "")
    if GUARDED.match(name):
      found[name] = dist.version
  return found


def _release(version: str) -> tuple[int, ...]:
  return tuple(int(p) for p in re.findall(r"\d+", version)[:2])


def problems(base: dict[str, str], now: dict[str, str]) -> list[str]:
  out = [f"pip changed {n} {v} -> {now[n]}" for n, v in sorted(base.items()) if n in now and now[n] != v]
  out += [f"pip removed {n} {v}" for n, v in sorted(base.items()) if n not in now]
  for name, least in MIN_VERSIONS.items():
    if name in now and _release(now[name]) < least:
      out.append(f"{name} {now[name]} is older than {'.'.join(map(str, least))}: use a newer base image")
  if not any(n.startswith("transformer-engine") for n in now):
    out.append("the base image has no Transformer Engine: use an NGC JAX image (nvcr.io/nvidia/jax:YY.MM-py3)")
  if sys.version_info[:2] < MIN_PYTHON:
    out.append(f"Python {sys.version.split()[0]} is older than 3.12, which maxtext needs: use a newer base image")
  return out


def main(argv: list[str]) -> int:
  if len(argv) != 2 or argv[0] not in ("freeze", "check"):
    print("usage: pins.py freeze|check FILE", file=sys.stderr)
    return 2
  command, path = argv
  if command == "freeze":
    with open(path, "w", encoding="utf-8") as f:
      f.writelines(f"{n}=={v}\n" for n, v in sorted(installed().items()))
    return 0
  with open(path, encoding="utf-8") as f:
    base = dict(line.strip().split("==", 1) for line in f if "==" in line)
  found = problems(base, installed())
  for line in found:
    print(f"pins.py: {line}", file=sys.stderr)
  return 1 if found else 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
