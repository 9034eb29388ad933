"""Keeps the NGC image's own JAX, jaxlib, CUDA plugins, Transformer Engine and NCCL while pip installs
maxtext and the plugin on top (the image's builds match its CUDA, cuDNN and driver stack; ours would not).

  python3 docker/pins.py freeze /tmp/base.txt   # name==version of every guarded distribution in the image
  pip install -c /tmp/base.txt ...              # pip must keep them: a requirement that needs another
                                                # version fails the build with pip's resolution error
  python3 docker/pins.py check /tmp/base.txt    # and nothing changed, was removed, or is too old
  python3 docker/pins.py base                   # first of all: what the base lacks for our GPU path

`check` also asks what our GPU path needs of the base: Transformer Engine >= 2.20 with its NCCL EP
(`transformer_engine/jax/ep.py` among the distribution's files: TE cannot be imported without a GPU
driver, so its files are read, not imported) and NCCL >= 2.30.4 (NGC installs it as a system package, not
the `nvidia-nccl-cu*` wheel: the `libnccl.so.2` the loader finds is asked for its version, which needs no
GPU). Standard library only: it runs before anything of ours is installed. Exit 1 with one line per problem.
"""

import ctypes
import re
import sys
from importlib import metadata

GUARDED = re.compile(r"^(jax|jaxlib|jax-cuda\d+-(plugin|pjrt)|transformer-engine.*|nvidia-nccl-cu\d+)$")
MIN_VERSIONS = {"transformer-engine": (2, 20)}  # TE EP and the API upstream/te/calls.py calls (upstream/te/manifest.json)
MIN_PYTHON = (3, 12)  # maxtext 0.2.5
MIN_NCCL = (2, 30, 4)  # TE's NCCL EP
TE_EP_FILE = "transformer_engine/jax/ep.py"


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


def nccl_version(library: str = "libnccl.so.2") -> tuple[int, int, int] | None:
  """The NCCL the loader finds, None where there is none (ncclGetVersion needs no GPU)."""
  try:
    lib = ctypes.CDLL(library)
  except OSError:
    return None
  code = ctypes.c_int()
  if lib.ncclGetVersion(ctypes.byref(code)) != 0:
    return None
  v = code.value  # major * 10000 + minor * 100 + patch since NCCL 2.9
  return v // 10000, (v // 100) % 100, v % 100


def te_files() -> set[str]:
  """Files the installed Transformer Engine distributions record (RECORD's first column; read as text:
  `Distribution.files` leaves out what is not on disk, and a record is what is asked here)."""
  out = set()
  for dist in metadata.distributions():
    if _norm(dist.metadata["Name"] or "").startswith("transformer-engine"):
      out |= {line.split(",")[0] for line in (dist.read_text("RECORD") or "").splitlines() if line}
  return out


def gpu_path_problems(now: dict[str, str], files: set[str], nccl: tuple[int, int, int] | None) -> list[str]:
  """What the base lacks for our GPU path: TE's NCCL EP and a new enough NCCL."""
  out = []
  if any(n.startswith("transformer-engine") for n in now) and TE_EP_FILE not in files:
    out.append(f"the base image's Transformer Engine has no NCCL EP ({TE_EP_FILE}): use an image with TE >= 2.20")
  least = ".".join(map(str, MIN_NCCL))
  if nccl is None:
    out.append(f"the base image has no NCCL (libnccl.so.2): use an NGC JAX image, which has NCCL >= {least}")
  elif nccl < MIN_NCCL:
    found = ".".join(map(str, nccl))
    out.append(f"the base image's NCCL {found} is older than {least}, which TE's NCCL EP needs: use a newer base")
  return out


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


def _report(found: list[str]) -> int:
  for line in found:
    print(f"pins.py: {line}", file=sys.stderr)
  return 1 if found else 0


def main(argv: list[str]) -> int:
  if argv == ["base"]:  # before anything is installed: fails the build in seconds, not after pip's minutes
    now = installed()
    return _report(problems({}, now) + gpu_path_problems(now, te_files(), nccl_version()))
  if len(argv) != 2 or argv[0] not in ("freeze", "check"):
    print("usage: pins.py base | freeze FILE | check FILE", file=sys.stderr)
    return 2
  command, path = argv
  if command == "freeze":
    with open(path, "w", encoding="utf-8") as f:
      f.writelines(f"{n}=={v}\n" for n, v in sorted(installed().items()))
    return 0
  with open(path, encoding="utf-8") as f:
    base = dict(line.strip().split("==", 1) for line in f if "==" in line)
  now = installed()
  return _report(problems(base, now) + gpu_path_problems(now, te_files(), nccl_version()))


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
