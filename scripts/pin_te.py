"""Rewrites maxtext_moe/upstream/te/manifest.json from a Transformer Engine distribution: the parameters of
every TE function, class and attribute the TE seam (upstream/te/calls.py, compile_target.py) uses, read
from TE's own Python sources (it cannot be imported without CUDA, so they are read as syntax trees).

The distribution that holds transformer_engine/jax/*.py is the pure-Python wheel
`transformer_engine-<version>-py3-none-any.whl` (PyPI project `transformer-engine`); the
`transformer_engine_jax-<version>.tar.gz` sdist holds only the C++ extension. Download the pinned one and
pass it (a directory of unpacked sources works too):

  pip download --no-deps transformer-engine==2.20.2 -d /tmp/te
  .venv/bin/python scripts/pin_te.py /tmp/te/transformer_engine-2.20.2-py3-none-any.whl

Then read the diff: every changed line is a TE change calls.py must be checked against.
"""

import argparse
import hashlib
import json
import re
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

from maxtext_moe.upstream.te import manifest as te_manifest
from maxtext_moe.upstream.te import sources as te_sources


def _reader(path: Path) -> Callable[[str], str | None]:
  if path.is_dir():
    return lambda rel: (path / rel).read_text() if (path / rel).is_file() else None
  archive = zipfile.ZipFile(path)  # pylint: disable=consider-using-with  # read until the script exits
  names = set(archive.namelist())
  return lambda rel: archive.read(rel).decode() if rel in names else None


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("distribution", type=Path, help="the transformer_engine py3-none-any wheel, or its unpacked tree")
  ns = parser.parse_args(argv)
  if not ns.distribution.exists():
    print(f"pin_te: {ns.distribution} does not exist", file=sys.stderr)
    return 2
  read = _reader(ns.distribution)
  version_file = read("transformer_engine/VERSION.txt") or read("transformer_engine/jax/VERSION.txt")
  match = re.search(r"-(\d+\.\d+\.\d+[^-]*)-py3", ns.distribution.name)
  version = (version_file or "").strip() or (match.group(1) if match else "unknown")
  uses = te_manifest.seam_uses()
  targets = sorted({u.target for u in uses})
  symbols = te_sources.pin(read, targets)
  missing = [t for t in targets if t not in symbols]
  data = {
    "distribution": ns.distribution.name,
    "sha256": hashlib.sha256(ns.distribution.read_bytes()).hexdigest() if ns.distribution.is_file() else None,
    "version": version,
    "symbols": symbols,
  }
  te_manifest.MANIFEST.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
  print(f"pinned {len(symbols)} TE symbols from {ns.distribution.name} ({version})", file=sys.stderr)
  for target in missing:
    print(f"pin_te: {target} is not in this distribution", file=sys.stderr)
  return 1 if missing else 0


if __name__ == "__main__":
  sys.exit(main())
