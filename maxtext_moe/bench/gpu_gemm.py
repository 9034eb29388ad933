"""The GPU check of the grouped GEMM (issue: dropless MoE block): efficiency of each backend against a
dense bf16 matmul of equal FLOPs, at a DeepSeek-V3 expert shape on one GPU.

  D=7168, F=2048, 32 local experts (256 experts / EP=8), 16,384 routed rows (2,048 tokens x top-8), bf16.

Pure JAX (no maxtext import), so it runs on a bare JAX+CUDA image:
  python -m maxtext_moe.bench.gpu_gemm --out $OUT/gemm.json
Prints a table and writes the same numbers as JSON. tokamax is measured only where it imports.
"""

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

from maxtext_moe.bench.moe_speed import gemm_efficiency
from maxtext_moe.moe.settings import GemmBackend

SHAPE = {"rows": 16384, "dim": 7168, "hidden": 2048, "experts": 32}


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--out", help="write the results here as JSON")
  parser.add_argument("--rounds", type=int, default=5)
  ns = parser.parse_args(argv)
  backends = [GemmBackend.RAGGED_DOT, GemmBackend.TILED]
  try:
    import tokamax  # noqa: F401  # pylint: disable=import-outside-toplevel,unused-import

    backends.append(GemmBackend.TOKAMAX)
  except ImportError:
    print("tokamax not installed: skipped", file=sys.stderr)
  eff = gemm_efficiency(backends, rounds=ns.rounds, shape=SHAPE, dtype=jnp.bfloat16)
  result = {"device": str(jax.devices()[0].device_kind), "shape": SHAPE, "dtype": "bfloat16", "gemm_efficiency": eff}
  for backend, v in eff.items():
    print(f"{backend:>12}  fwd {v['fwd']:.3f}  fwd+bwd {v['fwd_bwd']:.3f}  (dense bf16 matmul of equal FLOPs = 1)")
  if ns.out:
    Path(ns.out).write_text(json.dumps(result, indent=2) + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
