"""What XLA:GPU's scheduler is told a grouped GEMM costs.

XLA:GPU's latency-hiding scheduler places each async collective's start and done by what it estimates the
instructions between them cost. On Hopper and Blackwell its estimator is the speed-of-light one
(`SolLatencyEstimator`, on by default where the module's collectives are ones it models): it times dots,
cuBLAS and Triton GEMMs from its matmul table, but prices any other custom call at 10 us, the grouped
GEMM's included (tokamax's Mosaic GPU kernel, Transformer Engine's grouped GEMM). A grouped GEMM of 2 ms
priced at 10 us gives the scheduler no reason to run the expert exchange beside it. Both of XLA:GPU's
estimators first read an instruction's frontend attribute `latency_metadata` (its time in nanoseconds):
the block sets it on each grouped GEMM (forward and backward: JAX attaches the metadata to every op traced
under it) to the step-time model's time for that shape on the recipe's GPU (`steptime.gemm`: XLA's own
measured matmul table, Hopper's FP8 from DeepGEMM). docs/moe-block.md ("The exchange beside the GEMMs").

Shape legend: M rows, K in dim, N out dim.
"""

import contextlib

from jax.experimental.xla_metadata import set_xla_metadata

from maxtext_moe.config import hardware
from maxtext_moe.steptime import gemm


def latency_ns(gpu_name: str, quantization: str, m: int, k: int, n: int) -> int:
  """Nanoseconds of one [M, K] x [K, N] GEMM on `gpu_name` (the hardware table's key) in `quantization`
  ('none': the activations' bf16; 'fp8', 'mxfp8'), by the step-time model's efficiency at that shape.

  Example: latency_ns("h100", "none", 49280, 7168, 2048) -> about 1.9 ms (1,897,000).
  """
  gpu = hardware.gpu(gpu_name)
  if gpu is None:
    raise ValueError(f"no GPU {gpu_name!r} in the hardware table")
  fmt = "bf16" if quantization in ("", "none") else quantization
  rate = gpu.peak_tflops.get(fmt, gpu.peak_tflops["bf16"]) * 1e12 * gemm.efficiency(gpu, fmt, m, n, k)
  return max(1, round(2.0 * m * n * k / rate * 1e9))


def priced(gpu_name: str, quantization: str, m: int, k: int, n: int):
  """A context in which the ops traced carry `latency_metadata` for this GEMM; none without a GPU name (a
  CPU recipe: XLA:CPU has no such scheduler)."""
  if not gpu_name:
    return contextlib.nullcontext()
  return set_xla_metadata(latency_metadata=str(latency_ns(gpu_name, quantization, m, k, n)))
