"""Rewrites maxtext_moe/upstream/manifest.json from the installed MaxText and Orbax: every upstream symbol
our package names (read from its source) plus the manifest's hand-listed ones (methods reached through
instances), each with its fingerprint. Run it after changing a pin, then read the diff: every changed line
is an upstream change our code must be checked against.

  .venv/bin/python scripts/pin_upstream.py
"""

import json
import sys
from importlib.metadata import version

from maxtext_moe.upstream import manifest


def main() -> int:
  data = json.loads(manifest.MANIFEST.read_text())
  keys = sorted(manifest.all_references())
  data["versions"] = {name: version(name) for name in ("maxtext", "orbax-checkpoint")}
  data["symbols"] = {key: manifest.fingerprint(manifest.resolve(key)) for key in keys}
  manifest.MANIFEST.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
  print(f"pinned {len(keys)} symbols", file=sys.stderr)
  return 0


if __name__ == "__main__":
  sys.exit(main())
