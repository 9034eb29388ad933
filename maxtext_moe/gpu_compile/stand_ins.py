"""What `maxtext-moe compile` cannot build on this machine as the recipe's container runs it, replaced and
said: every stand-in of the deviceless compile, each with its reason (docs/gpu-path.md). Where Transformer
Engine imports (`.venv-te`) its grouped GEMM, dense FP8 GEMMs and NCCL EP are compiled as themselves (TE
answered for the target by `upstream.te_target`); elsewhere tokamax, MaxText's fp8 and all_to_all stand in.
TE's cuDNN attention never compiles here (it builds cuDNN graphs on a device while tracing): JAX's cuDNN
attention stands in (under pipeline stages with MLA's value head padded, `upstream.maxtext.attention_stand_in`).
"""

from typing import Any

from maxtext_moe.moe.layout import dispatch_for
from maxtext_moe.moe.settings import DispatchKind, Platform


def substitutions(recipe: Any, *, te_available: bool) -> tuple[list[str], list[str]]:
  """(overrides, plain words) for what this machine cannot compile as the recipe's container would run it.
  With TE (`./setup.sh --gpu-compile-te`) its grouped GEMM and NCCL EP are compiled as themselves, and
  `auto` is written out as the `te` the container picks (the compiling process's own platform is the CPU;
  `te_ep_written_out` does the same for the dispatch, which needs the resolved mesh)."""
  extra, said = [], []
  keys = recipe.keys
  gemm, dispatch = str(keys.plugin.moe_gemm_backend), str(keys.plugin.moe_dispatch)
  quantized = str(keys.plugin.moe_gemm_quantization)
  if keys.maxtext["te_moe_block"]:  # MaxText's TE block, not ours (substituted below)
    gemm = dispatch = "maxtext"
  stages = int(keys.maxtext["ici_pipeline_parallelism"]) * int(keys.maxtext["dcn_pipeline_parallelism"])
  if te_available and gemm == "auto":  # under stages the container's auto is tokamax (TE's is not vmapped)
    extra.append("moe_gemm_backend=te" if stages <= 1 else "moe_gemm_backend=tokamax")
  if not te_available and gemm in ("auto", "te"):
    extra.append("moe_gemm_backend=tokamax")
    said.append(
      f"moe_gemm_backend={gemm}: the container runs Transformer Engine's grouped GEMM (te), which does not import "
      "here; compiled with tokamax (Mosaic GPU), what auto picks on a GPU without TE (./setup.sh --gpu-compile-te "
      "compiles TE's own)"
    )
    if quantized != "none":
      extra.append("moe_gemm_quantization=none")
      said.append(f"moe_gemm_quantization={quantized} is TE's grouped GEMM: tokamax's is compiled in bf16")
  # Under pipeline stages the container's `auto` is all_to_all too (TE's NCCL EP is not vmapped over them),
  # and so is a dropless te_ep across nodes (`moe.settings.resolve_dispatch`: the two-level rounds)
  across = int(keys.maxtext["dcn_expert_parallelism"]) > 1 and float(keys.plugin.moe_capacity_factor) <= 0
  if not te_available and dispatch in ("auto", "te_ep") and keys.expert_parallelism > 1 and stages == 1 and not across:
    ep_extra, ep_said = _te_ep_substitution(recipe, dispatch)
    extra, said = extra + ep_extra, said + ep_said
  extra_te, said_te = _te_substitutions(keys.maxtext, te_available=te_available)
  extra, said = extra + extra_te, said + said_te
  if str(keys.maxtext["attention"]) == "cudnn_flash_te":  # with stages, `staged_attention` decides on MLA
    extra.append(STAGED_MLA[0] if stages > 1 else CUDNN_JAX[0])
    said.append(STAGED_MLA[1] if stages > 1 else CUDNN_JAX[1])
  return extra, said


CUDNN_JAX = (
  "attention=cudnn_flash_jax",
  "attention=cudnn_flash_te is TE's cuDNN flash attention, which asks the driver for its backend and builds "
  "cuDNN graphs while the step is traced: compiled with cudnn_flash_jax, the same cuDNN fused attention "
  "through XLA's own custom call (its workspace, which cuDNN sizes on a device, is not counted)",
)
STAGED_MLA = (
  "attention=cudnn_flash_jax",
  "attention=cudnn_flash_te under pipeline stages with MLA: JAX's cuDNN attention (the stand-in without TE) "
  "cannot be vmapped over the stages when the value head differs from the query's (its batching rule "
  "reshapes the value by the key's shape); compiled with cudnn_flash_jax with the value head padded with zeros "
  "to the query's and the output sliced back (the same result; 1.5x the value's and output's bytes inside "
  "the call)",
)


def pads_value(said: list[str]) -> bool:
  """Whether the compile stands in `STAGED_MLA` (`upstream.maxtext.attention_stand_in` then pads the value)."""
  return STAGED_MLA[1] in said


def staged_attention(cfg: Any, said: list[str]) -> list[str]:
  """What is said of TE's attention under stages once the model is known: the value padded only where MLA's
  value head differs from the query's (DeepSeek); Qwen3-MoE's and Mixtral's equal heads vmap in JAX's cuDNN
  attention as they are, as without stages."""
  if str(cfg.attention_type) == "mla":
    return said
  return [CUDNN_JAX[1] if s == STAGED_MLA[1] else s for s in said]


def _te_ep_substitution(recipe: Any, dispatch: str) -> tuple[list[str], list[str]]:
  """TE's NCCL EP where TE does not import, as all_to_all: at its worst-case buffers, as te_ep's dropless
  receive buffer is, so the experts' outputs a remat policy saves are in the program (the bounded rounds
  recompute them whatever it says); a moe_buffers the user names is kept."""
  extra, said = ["moe_dispatch=all_to_all"], []
  named = any(o.startswith("moe_buffers=") for o in getattr(recipe, "user_overrides", ()))
  if not named:
    extra.append("moe_buffers=worst_case")
  said.append(
    f"moe_dispatch={dispatch}: the container runs TE's NCCL EP (te_ep), which needs TE (./setup.sh "
    "--gpu-compile-te compiles it); compiled with all_to_all "
    + ("(its buffers as moe_buffers says)" if named else "at its worst-case buffers, as te_ep's receive buffer is")
  )
  return extra, said


def _te_substitutions(maxtext: dict[str, Any], *, te_available: bool) -> tuple[list[str], list[str]]:
  """MaxText's own TE paths (its TE MoE block, TE's FP8 dense GEMMs): they need TE to trace, and its block's
  expert parallelism TE's NCCL EP, which never compiles here."""
  extra, said = [], []
  quantization = str(maxtext["quantization"] or "")
  if maxtext["te_moe_block"]:
    # Not MaxText's own sparse_matmul: at DeepSeek-V3's batch 6 x 4,096 its ragged all-to-all path needed
    # 1,049 GiB of temporaries per GB300, nothing like TE's fused block; ours is the portable dropless one.
    gemm = "te" if te_available else "tokamax"
    extra += ["te_moe_block=false", "prefuse_moe_weights=false", "moe_impl=dropless"]
    extra += [f"moe_gemm_backend={gemm}", f"moe_dispatch={'auto' if te_available else 'all_to_all'}"]
    # TE's moe() keeps residuals of its own, which the remat policy recomputes (the planner's model of it):
    # our block's expert outputs are recomputed to match (under the bounded rounds they always are).
    extra += ["moe_mlpwi_0=remat", "moe_mlpwi_1=remat", "moe_mlpwo=remat"]
    why, moved = (
      ("which MaxText bootstraps itself (not answered here)", "TE's NCCL EP")
      if te_available
      else ("which does not import here", "all_to_all")
    )
    said.append(
      f"te_moe_block=true runs Transformer Engine's fused moe(), {why}: compiled with our dropless block "
      f"instead ({gemm} grouped GEMM, {moved} dispatch, unfused weights, its expert outputs recomputed as "
      "TE's residuals are)"
    )
  if quantization.startswith("te_") and quantization != "te_no_quant" and not te_available:
    # Flax's FP8 dot (MaxText's `fp8`): XLA:GPU's own FP8 GEMMs (cuBLASLt), the same operands in FP8.
    extra.append("quantization=fp8")
    said.append(
      f"quantization={quantization} is Transformer Engine's dense GEMM, which does not import here: compiled "
      "with MaxText's fp8 (Flax's FP8 dot, cuBLASLt's FP8 GEMMs in XLA:GPU)"
      + (", per-tensor scales for MXFP8's blocks" if quantization == "te_mxfp8" else "")
    )
  elif quantization.startswith("te_") and not te_available:
    extra.append("quantization=")
    said.append(f"quantization={quantization} is Transformer Engine's bf16 dense: compiled with MaxText's own")
  return extra, said


def te_ep_written_out(cfg: Any, devices: int) -> list[str]:
  """`moe_dispatch=te_ep` where `auto` resolves to it in the container (one GPU per process, TE imports) for
  this resolved config's mesh; [] otherwise (a layout TE's EP cannot split stays all_to_all, as there)."""
  if str(cfg.moe_dispatch) != "auto":
    return []
  kind = dispatch_for(cfg, num_devices=devices, platform=Platform("gpu", te_gemm=True, te_ep=True), kind="auto")
  return ["moe_dispatch=te_ep"] if kind == DispatchKind.TE_EP else []
