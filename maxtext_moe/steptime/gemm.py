"""GEMM efficiency by shape (M, N, K) and number format, from XLA:GPU's own measured matmul table.

XLA:GPU's cost model carries measured throughput of cuBLAS matmuls on B200 (sm_100) and H100 (sm_90) for
M, N, K in 256..4,096 (powers of two), bf16 and e4m3 FP8 (`xla_matmul.json`, extracted from the pinned
jax-cuda12-plugin by scripts/xla_matmul_table.py). A shape's efficiency is the table's throughput there
(trilinear in log2 M, N, K) over the table GPU's dense peak, applied to the recipe GPU's own peak (B300,
GB200 and GB300 at B200's efficiencies).

Beyond the table's 4,096: a GEMM is tiles of its M x N output spread over the SMs, and the table is
symmetric in M and N (B200 FP8 at K 2,048: 980 TFLOP/s at M 4,096 x N 512, 972 at 512 x 4,096; H100 bf16:
531 and 530), so rows beyond 4,096 fill the GPU as the same output with a wider N would: M is folded into
N (M x N kept) up to 4,096 x 4,096, and the same for N into M; only then is a side clamped (the 4,096
figure, a slight under-estimate for K above it and for outputs above 4,096 x 4,096). Until December 2026
M was clamped alone, which priced a grouped GEMM of 131,072 rows and 768 columns (Qwen3-30B-A3B's experts
at micro-batch 4) at the throughput of a 4,096 x 768 GEMM, a third of the GPU's SMs busy: 26% of the
MXFP8 peak on Blackwell where the folded shape gives 41%.

Where the table cannot serve:
- MXFP8 (block-scaled; the table's FP8 is per-tensor): Megatron-Core's measured MXFP8 grouped GEMM
  (`gemm_mxfp8_blackwell`) at its shape, carried to other shapes by the FP8 rows' shape dependence.
- FP8 on Hopper: XLA's sm_90 FP8 rows exceed H100's dense FP8 peak (2,424 TFLOP/s of 1,979 at 4,096^3), so
  they are not taken as measurements; the bf16 rows carry DeepGEMM's FP8 figure (`gemm_fp8_hopper`) to
  other shapes, read at half the K: a GEMM's time is its K loop at the tensor cores' rate plus a cost per
  output tile that does not depend on the format (the pipeline's fill, the epilogue's writes), and FP8's
  K loop runs at twice bf16's rate, so an FP8 GEMM amortises that cost as a bf16 one of half the K does.
  DeepGEMM's own rows at M 4,096 (H800) check it: at K 512 and 1,536, 0.510 and 0.797 of its best shape,
  0.511 and 0.807 read so (0.707 and 0.916 at the same K); at K 2,048 0.768, 0.878 (0.943); at K 7,168
  with N 4,096 and 2,112 0.928 and 0.741, 0.989 and 0.967 (the table's log-spaced N cannot see N 2,112's
  ragged last tile column). Until December 2026 the bf16 rows were read at the same K.
A grouped GEMM is one kernel over all its groups' tiles, so it is looked up at its total rows (the rows of
every local expert), which fill the GPU as one GEMM of that M would; what small groups cost beyond that
(DeepGEMM's masked layout: 4 groups of 256 rows at 76% of one group of 1,024) is not modelled. A class's
efficiency is the FLOP-weighted harmonic mean of its GEMMs'.
"""

import functools
import json
import math
from pathlib import Path
from typing import Any

from maxtext_moe.steptime.constants import constant

TABLE_PATH = Path(__file__).with_name("xla_matmul.json")
# The table GPUs' dense peaks, TFLOP/s (data sheets): B200 and H100 SXM.
TABLE_PEAK = {"blackwell": {"bf16": 2250.0, "fp8": 4500.0}, "hopper": {"bf16": 989.0, "fp8": 1979.0}}
_LARGE = (4096, 4096, 4096)
# Megatron-Core's MXFP8 grouped GEMM, K 7,168 and N 2,048, at its run's rows per GPU: 8 local experts (EP 32)
# x 4,096 rows each (4,096 tokens x top-8 / 256 experts x 32 ranks), one kernel's worth of tiles as the
# grouped GEMMs here are looked up (its multi-stream cuBLAS runs the 8 at once).
_MX_ANCHOR = (32768, 2048, 7168)
_HOPPER_FP8_ANCHOR = (4096, 7168, 16384)  # DeepGEMM's best dense FP8 shape


def arch(gpu: Any) -> str:
  return "blackwell" if gpu.compute_capability[0] >= 10 else "hopper"


@functools.cache
def _grid(arch_name: str, fmt: str) -> tuple[tuple[int, ...], dict[tuple[int, int, int], float]]:
  rows = json.loads(TABLE_PATH.read_text(encoding="utf-8"))["tflops"][arch_name][fmt]
  table = {(m, n, k): v for m, n, k, v in rows}
  return tuple(sorted({m for m, _, _ in table})), table


def fold(m: float, n: float, top: float) -> tuple[float, float]:
  """(m, n) with a side beyond `top` folded into the other, m x n kept, up to `top` x `top` (the module
  docstring)."""
  if m > top and n < top:
    return top, min(top, n * m / top)
  if n > top and m < top:
    return min(top, m * n / top), top
  return m, n


def table_tflops(arch_name: str, fmt: str, m: float, n: float, k: float) -> float:
  """The table's TFLOP/s at (m, n, k): M and N folded (`fold`), then trilinear in log2 of each side,
  clamped to the grid."""
  sides, table = _grid(arch_name, fmt)
  m, n = fold(m, n, sides[-1])
  lo, hi = math.log2(sides[0]), math.log2(sides[-1])
  corners = []
  for x in (m, n, k):
    t = min(max(math.log2(max(x, 1)), lo), hi)
    i = min(int(t - lo), len(sides) - 2)
    corners.append((sides[i], sides[i + 1], t - lo - i))
  total = 0.0
  for bits in range(8):
    weight, key = 1.0, []
    for axis, (a, b, f) in enumerate(corners):
      upper = bits >> axis & 1
      weight *= f if upper else 1 - f
      key.append(b if upper else a)
    total += weight * table[tuple(key)] if weight else 0.0
  return total


def efficiency(gpu: Any, fmt: str, m: float, n: float, k: float) -> float:
  """A GEMM's fraction of `gpu`'s dense peak for `fmt` at shape (m, n, k) (the module docstring)."""
  a = arch(gpu)
  if fmt == "bf16" or fmt not in ("fp8", "mxfp8"):
    return table_tflops(a, "bf16", m, n, k) / TABLE_PEAK[a]["bf16"]
  if a == "hopper":  # bf16's rows at half the K (the module docstring)
    m0, n0, k0 = _HOPPER_FP8_ANCHOR
    shape = table_tflops(a, "bf16", m, n, k / 2) / table_tflops(a, "bf16", m0, n0, k0 / 2)
    return constant("gemm_fp8_hopper") * shape
  fp8 = table_tflops(a, "fp8", m, n, k) / TABLE_PEAK[a]["fp8"]
  if fmt == "mxfp8":
    return constant("gemm_mxfp8_blackwell") * table_tflops(a, "fp8", m, n, k) / table_tflops(a, "fp8", *_MX_ANCHOR)
  return fp8


def class_efficiency(gpu: Any, fmt: str, shapes: list[tuple[int, int, int, float]] | None) -> float:
  """The FLOP-weighted harmonic mean of `shapes`' efficiencies ((m, n, k, share of the class's FLOPs)); a
  large GEMM's without shapes."""
  if not shapes:
    return efficiency(gpu, fmt, *_LARGE)
  total = sum(s for *_, s in shapes)
  return total / sum(s / efficiency(gpu, fmt, m, n, k) for m, n, k, s in shapes)
