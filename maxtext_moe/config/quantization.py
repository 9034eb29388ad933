"""MaxText's `quantization` with our block: which values the dense GEMMs may take, and why the rest cannot.

MaxText 0.2.5 builds one `quant` object from `quantization` (`layers/quantizations.py`,
`configure_quantization`) and hands it to every dense projection: attention's (MLA's low-rank ones
included), the dense layers' MLP and the shared experts. Under `moe_impl=dropless` the routed block is
built without it (`upstream.maxtext.moe_layer.routed_moe_init`): the router stays in the model's dtype, as
DeepSeek-V3 and NVIDIA's published run keep it, and the routed experts follow `moe_gemm_quantization` in
our grouped GEMM. The unembedding never quantizes in MaxText. So with our block `quantization` means the
dense GEMMs only, and these are the values that can mean that on a GPU.
"""

from typing import Any

# value -> the implementation: the ones our block takes (their number format: `number_format`).
DENSE_QUANTIZATIONS: dict[str, str] = {
  "": "none",
  "fp8": "Flax's FP8 dot (delayed scaling, amax history of 1,024); XLA:GPU's own FP8 GEMM",
  "te_fp8_currentscaling": "Transformer Engine's dense, FP8 with per-tensor scales of this step",
  "te_fp8_delayedscaling": "Transformer Engine's dense, FP8 with scales from an amax history",
  "te_mxfp8": "Transformer Engine's dense, MXFP8 (32-element blocks; Blackwell)",
  "te_no_quant": "Transformer Engine's dense in bf16",
}

# value -> why our block refuses it, and what to use instead.
_QWIX = "is a qwix value (use_qwix_quantization=true): qwix rewrites every GEMM of the layers, our block's included"
REFUSED: dict[str, str] = {
  "nanoo_fp8": "is AMD's FP8 (the fnuz formats of MI300); on NVIDIA GPUs use fp8 or te_fp8_currentscaling",
  "te_nvfp4": "(NVFP4 dense GEMMs) is not modelled by the planner yet; use te_mxfp8 on Blackwell",
  "te_nvfp4_no_rht": "(NVFP4 dense GEMMs) is not modelled by the planner yet; use te_mxfp8 on Blackwell",
  "int8": "is AQT's integer path (TPU-oriented); on GPUs use fp8 or te_fp8_currentscaling",
  "intmp": "is AQT's mixed-precision integer path (TPU-oriented); on GPUs use fp8 or te_fp8_currentscaling",
  "serve_fp8_weight": "is for serving (FP8 weights at inference), not training",
  **{q: _QWIX for q in ("fp4", "int4", "fp8_e5m2", "fp8_e4m3", "fp8_nanoo", "fp8_gpu", "fp8_full")},
}


def quantization_name(cfg: Any) -> str:
  value = getattr(cfg, "quantization", "") or ""
  return str(getattr(value, "value", value))


def number_format(value: Any) -> str:
  """A quantization key's number format, 'bf16', 'fp8' or 'mxfp8' (MaxText's `quantization`, its
  `te_gmm_quantization`, our `moe_gemm_quantization`; an enum or its string)."""
  name = str(getattr(value, "value", value) or "").lower()
  if "mxfp8" in name:
    return "mxfp8"
  if "fp8" in name:
    return "fp8"
  return "bf16"


def check_dense_quantization(cfg: Any) -> None:
  """One line for a `quantization` our block cannot pair with (called for dropless configs only)."""
  name = quantization_name(cfg)
  if getattr(cfg, "use_qwix_quantization", False) and name:
    raise ValueError(
      "moe_impl=dropless does not take use_qwix_quantization=true: qwix rewrites every GEMM under the "
      "decoder's layers by module path, our block's included; set use_qwix_quantization=false "
      f"(quantization={name} then quantizes the dense GEMMs only), or set moe_impl=maxtext"
    )
  if name in DENSE_QUANTIZATIONS:
    return
  why = REFUSED.get(name, "is not one of MaxText's quantization values")
  takes = ", ".join(k for k in DENSE_QUANTIZATIONS if k)
  raise ValueError(f"moe_impl=dropless: quantization={name} {why} (our block takes {takes})")
