#!/usr/bin/env python3
"""Write maxtext_moe/steptime/xla_matmul.json: XLA:GPU's own measured matmul throughput table (its cost
model's `kDefaultMatmulPTable`, text proto, embedded in the jax-cuda12-plugin binary) for the GPUs the
step-time model knows, at batch 1, bf16 x bf16 and e4m3 x e4m3 -> bf16. Run it with the pinned plugin
installed (./setup.sh --dev) after changing the pin; tests/test_step_time_costs.py checks the shipped file
against the installed plugin."""

import json
import mmap
import re
import sys
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT = REPO / "maxtext_moe" / "steptime" / "xla_matmul.json"
GPUS = {"sm_90": "hopper", "sm_100_B200": "blackwell"}
KINDS = {"bf16xbf16->bf16": "bf16", "f8e4m3fnxf8e4m3fn->bf16": "fp8"}


def plugin_binary() -> Path:
  import jax_plugins.xla_cuda12 as plugin  # pylint: disable=import-outside-toplevel

  return Path(plugin.__file__).parent / "xla_cuda_plugin.so"


def table_text(path: Path) -> str:
  """The text proto embedded in the binary (from its first GPU key to the string's NUL)."""
  with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
    key = m.find(b'key: "sm_')
    if key < 0:
      raise SystemExit(f"{path}: no matmul table found")
    return m[m.rfind(b"entries {", 0, key) : m.find(b"\x00", key)].decode()


def parse(text: str) -> dict:
  """{arch: {format: [[m, n, k, tflops], ...]}} of the batch-1 entries."""
  out: dict = {}
  for block in re.split(r'\n  key: "', text)[1:]:
    name = block.split('"', 1)[0]
    if name not in GPUS:
      continue
    table = out.setdefault(GPUS[name], {k: [] for k in KINDS.values()})
    for entry in re.findall(r"entries \{\s*b: (\d+)\s*m: (\d+)\s*n: (\d+)\s*k: (\d+)((?:\s*flops \{[^}]*\})+)", block):
      b, m, n, k, flops = entry
      if int(b) != 1:
        continue
      for kind, value in re.findall(r'key: "([^"]+)" value: (\d+)', flops):
        if kind in KINDS:
          table[KINDS[kind]].append([int(m), int(n), int(k), round(int(value) / 1e12, 1)])
  return out


def current() -> dict:
  version = metadata.version("jax-cuda12-plugin")
  return {
    "source": f"XLA:GPU's measured matmul table (cost model, kDefaultMatmulPTable) in jax-cuda12-plugin {version}",
    "keys": GPUS,
    "tflops": parse(table_text(plugin_binary())),
  }


def dumps(table: dict) -> str:
  """JSON with one [m, n, k, TFLOP/s] row per line (reviewable diffs)."""
  lines = ["{", f' "source": {json.dumps(table["source"])},', f' "keys": {json.dumps(table["keys"])},', ' "tflops": {']
  archs = list(table["tflops"].items())
  for i, (arch, formats) in enumerate(archs):
    lines.append(f"  {json.dumps(arch)}: {{")
    for j, (fmt, rows) in enumerate(formats.items()):
      body = ",\n".join(f"    {json.dumps(r)}" for r in rows)
      lines.append(f"   {json.dumps(fmt)}: [\n{body}\n   ]" + ("," if j < len(formats) - 1 else ""))
    lines.append("  }" + ("," if i < len(archs) - 1 else ""))
  return "\n".join([*lines, " }", "}"]) + "\n"


if __name__ == "__main__":
  OUT.write_text(dumps(current()))
  print(f"wrote {OUT}", file=sys.stderr)
