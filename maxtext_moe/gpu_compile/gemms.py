"""GEMMs in optimized HLO: which kernel runs each (kind) and in which number format (from its operands).

Split from `gpu_compile.hlo` (which counts them per step; `ins` is its `Instr`: opcode, name, operands and
attributes as text); hand-written for the reason given there.
"""

import re
from typing import Any

_TARGET = re.compile(r'custom_call_target="([^"]+)"')


def gemm_kind(ins: Any) -> str | None:
  if ins.opcode == "custom-call":
    target = (_TARGET.search(ins.rest) or [None, ""])[1]
    if "cublas" in target:
      return "cublas"
    if "te_grouped_gemm" in target or "grouped_gemm" in target:
      return "te_grouped_gemm"
    if "te_gemm" in target:
      return "te_gemm"  # Transformer Engine's dense GEMM (MaxText's te_* quantization)
    if "mosaic" in target:
      return "mosaic_gpu"
    if "triton" in target:
      return "pallas_triton"
    if "cudnn$fmha" in target:
      return "cudnn_attention"  # cuDNN's fused (flash) attention, forward or backward
    if "cudnn" in target:
      return "cudnn"
    return None
  if ins.opcode == "fusion" and "__triton" in ins.rest and ("gemm" in ins.rest or "dot" in ins.name):
    return "triton_gemm"
  if ins.opcode in ("dot", "convolution"):
    return "dot"
  return None


_TYPES = re.compile(r"\b(f8e[0-9a-z]+|bf16|f16|f32|f64|s8)\[")
_OPERAND = re.compile(r"%([\w.\-]+)")


def gemm_format(ins: Any, shapes: dict[str, str] | None = None) -> str:
  """A GEMM's number format from its operands' types (written inline, or the shapes of the instructions it
  names, as optimized HLO prints them): 'mxfp8' (FP8 with E8M0 block scales), 'fp8', else the narrowest
  float among them ('bf16', 'f16', 'f32') or 's8'."""
  operands = ins.rest.split("),")[0]
  text = operands + " " + " ".join((shapes or {}).get(name, "") for name in _OPERAND.findall(operands))
  types = set(_TYPES.findall(text))
  if any(t.startswith("f8e8m0") for t in types):
    return "mxfp8"
  if any(t.startswith("f8") for t in types):
    return "fp8"
  return next((t for t in ("s8", "bf16", "f16", "f32", "f64") if t in types), "other")
