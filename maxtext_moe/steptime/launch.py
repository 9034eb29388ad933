"""Launch overhead: the gap the GPU spends between kernels, larger for kernels the host launches one by one
than for kernels replayed from a command buffer (XLA) or a CUDA graph (PyTorch).

Kernels per layer are counted from the workload's ops (`kernels_per_layer`): one per GEMM (the router's
included), one quantization kernel per FP8/MXFP8 GEMM input, one attention kernel, and the memory-bound ops
a compiler leaves as kernels of their own: 2 norms, 2 residual adds, RoPE on q and k, the router's
softmax/top-k and bias, the permutation and its inverse, the gated activation; the exchange's dispatch and
combine. The backward launches twice the forward's kernels; a recomputed forward once more.

Which of them leave a command buffer: XLA:GPU captures the command types `--xla_gpu_enable_command_buffer`
lists (our flag profiles: none on Hopper, FUSION and CUSTOM_CALL on Blackwell, which hold the memory-bound
fusions and TE's GEMMs, attention and quantization; XLA's own GEMMs are cuBLAS calls, outside unless CUBLAS
or CUBLASLT is listed); collectives always run outside. A PyTorch run launches every kernel from the host
unless it captures the whole iteration in a CUDA graph. Each kernel costs `kernel_gap_stream_s` outside and
`kernel_gap_graph_s` inside (`constants.py`). What this leaves out: a host slower than the GPU (Python's
per-op overhead on small kernels, a device-to-host sync per MoE layer); the host syncs are their own line.
"""

from typing import Any

from maxtext_moe.config.flags import flag_value
from maxtext_moe.steptime.constants import constant
from maxtext_moe.steptime.counts import _per_token_forward_flops

# The memory-bound kernels of one layer's forward left as kernels (see the module docstring).
_ELEMENTWISE_DENSE = 2 + 2 + 2  # norms, residual adds, RoPE on q and k
_ELEMENTWISE_MOE = 2 + 2 + 1  # router softmax/top-k and bias, permute and unpermute, gated activation
# XLA:GPU's default command types when the flag is not set (JAX 0.12's XLA).
XLA_DEFAULT_COMMAND_TYPES = ("FUSION", "CUBLAS", "CUBLASLT", "CUSTOM_CALL", "CUDNN")


def kernels_per_layer(cfg: Any, formats: dict[str, str], *, moe: bool) -> dict[str, float]:
  """{'gemm', 'quantize', 'attention', 'elementwise', 'collective'} kernels of one layer's forward."""
  per_token = _per_token_forward_flops(cfg)
  dense_names = [n for n, f in per_token.items() if f and not n.startswith("moe_") and n != "context"]
  if not moe:  # a dense layer: the attention projections and a gated MLP
    dense_names = [n for n in dense_names if not n.startswith("mlp")] + ["mlpwi_0", "mlpwi_1", "mlpwo"]
  gemms = len(dense_names) + (3 + 1 if moe else 0)  # + the grouped wi_0, wi_1, wo and the router
  quantize = len(dense_names) * (formats.get("dense", "bf16") != "bf16")
  quantize += 3 * (formats.get("grouped", "bf16") != "bf16") if moe else 0
  elementwise = _ELEMENTWISE_DENSE + (_ELEMENTWISE_MOE if moe else 1)
  return {"gemm": gemms, "quantize": quantize, "attention": 1, "elementwise": elementwise, "collective": 2 * moe}


def xla_command_types(xla_flags: list[str]) -> tuple[str, ...]:
  """The command types XLA:GPU captures in command buffers under `xla_flags` (the last setting wins)."""
  found = flag_value(xla_flags, "--xla_gpu_enable_command_buffer")
  if found is None:
    return XLA_DEFAULT_COMMAND_TYPES
  return tuple(t for t in found.split(",") if t)


def xla_split(kernels: dict[str, float], command_types: tuple[str, ...], te_gemms: bool) -> tuple[float, float]:
  """(outside, inside) command buffers of one layer's `kernels` under XLA:GPU's `command_types`."""
  fusion, custom = "FUSION" in command_types, "CUSTOM_CALL" in command_types
  cublas = bool({"CUBLAS", "CUBLASLT"} & set(command_types))
  inside = kernels["elementwise"] * fusion + kernels["quantize"] * (custom if te_gemms else fusion)
  inside += kernels["gemm"] * (custom if te_gemms else cublas) + kernels["attention"] * custom
  return sum(kernels.values()) - inside, inside


def seconds(outside: float, inside: float) -> float:
  """The launch gaps of `outside` kernels launched one by one and `inside` replayed ones."""
  return outside * constant("kernel_gap_stream_s") + inside * constant("kernel_gap_graph_s")
