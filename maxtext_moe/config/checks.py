"""Cross-field checks on a resolved config, one concern each.

Each check takes the resolved config (any object with MaxText's attribute names) and raises
`ValueError` with a one-line message that says what is wrong and how to fix it. They run inside
the plugin's pydantic config class (see `upstream.resolution`), after MaxText's own validation.
"""

from typing import Any

from maxtext_moe.config import checkpointing
from maxtext_moe.config.chunk_checks import check_exchange_chunks
from maxtext_moe.config.quantization import check_dense_quantization
from maxtext_moe.config.stage_checks import (
  check_microbatch_splits,
  check_pipeline_for_moe,
  check_pipeline_quantization,
)
from maxtext_moe.moe.layout import (
  DCN,
  ICI,
  SUFFIX,
  check_tensor_parallelism,
  expert_nodes,
  expert_parallelism,
  fixed_layout_size,
  parallelism_axes,
)
from maxtext_moe.moe.settings import check_buffers, check_dispatch, check_quantization


def check_one_auto_axis(cfg: Any) -> None:
  """At most one ICI and one DCN axis may be -1 (filled with the remaining devices)."""
  for prefix in (ICI, DCN):
    auto = [a for a, d in parallelism_axes(cfg, prefix=prefix).items() if d == -1]
    if len(auto) > 1:
      names = ", ".join(f"{prefix}{a}{SUFFIX}" for a in auto)
      raise ValueError(f"impossible layout: {names} are all -1; at most one {prefix}*{SUFFIX} may be -1 (auto)")
    bad = [a for a, d in parallelism_axes(cfg, prefix=prefix).items() if d == 0 or d < -1]
    if bad:
      raise ValueError(f"impossible layout: {prefix}{bad[0]}{SUFFIX} must be >= 1 or -1 (auto)")


def _fits(cfg: Any, *, prefix: str, n: int, where: str) -> None:
  size, has_auto = fixed_layout_size(cfg, prefix=prefix)
  if (has_auto and n % size == 0) or (not has_auto and n == size):
    return
  rel = "divide" if has_auto else "equal"
  raise ValueError(
    f"impossible layout: the {prefix}*{SUFFIX} product is {size} but must {rel} the {n} {where}; "
    f"change the parallelism degrees (or set one {prefix}*{SUFFIX} to -1)"
  )


def check_layout_fits_devices(cfg: Any, *, num_devices: int | None = None) -> None:
  """ICI degrees must fill the devices of one slice and DCN degrees the slices (MaxText's mesh rule).

  `num_devices` defaults to `cfg.recipe_num_devices`; nothing is checked when that is -1.
  """
  n = cfg.recipe_num_devices if num_devices is None else num_devices
  if n is None or n <= 0:
    return
  slices = max(int(getattr(cfg, "num_slices", 1)), 1)
  if n % slices:
    raise ValueError(f"impossible layout: {n} devices cannot be split into num_slices={slices} equal slices")
  _fits(cfg, prefix=DCN, n=slices, where="slices (num_slices)")
  _fits(cfg, prefix=ICI, n=n // slices, where="devices per slice")


def check_experts_divisible_by_ep(cfg: Any) -> None:
  """Experts are split evenly over the expert-parallel ranks."""
  ep = expert_parallelism(cfg)
  if cfg.num_experts > 1 and cfg.num_experts % ep:
    raise ValueError(
      f"impossible layout: num_experts={cfg.num_experts} is not divisible by expert parallelism {ep} "
      f"(ici_expert_parallelism x dcn_expert_parallelism); pick an EP degree that divides {cfg.num_experts}"
    )


def check_topk_routing(cfg: Any) -> None:
  """top-k and group-limited routing must be satisfiable."""
  if cfg.num_experts > 1 and cfg.num_experts_per_tok > cfg.num_experts:
    raise ValueError(f"num_experts_per_tok={cfg.num_experts_per_tok} exceeds num_experts={cfg.num_experts}")
  groups, topk_groups = cfg.n_routing_groups, cfg.topk_routing_group
  if groups > 0:
    if cfg.num_experts % groups:
      raise ValueError(f"n_routing_groups={groups} must divide num_experts={cfg.num_experts}")
    if not 0 < topk_groups <= groups:
      raise ValueError(f"topk_routing_group={topk_groups} must be in 1..n_routing_groups={groups}")
    if topk_groups * (cfg.num_experts // groups) < cfg.num_experts_per_tok:
      raise ValueError(
        f"group-limited routing keeps {topk_groups} groups of {cfg.num_experts // groups} experts, "
        f"fewer than num_experts_per_tok={cfg.num_experts_per_tok}"
      )


def _dropless(cfg: Any) -> bool:
  """Whether our block computes this config's routed experts."""
  return str(cfg.moe_impl) == "dropless" and cfg.num_experts > 1


_FIX = "or set moe_impl=maxtext"


def check_sparse_matmul(cfg: Any) -> None:
  """Our block sits at MaxText's sparse_matmul seam: that path must be on."""
  if _dropless(cfg) and not cfg.sparse_matmul:
    raise ValueError(f"moe_impl=dropless replaces MaxText's sparse_matmul path: set sparse_matmul=true, {_FIX}")


def check_one_expert_computation(cfg: Any) -> None:
  """MaxText's TE block and ours both replace the expert computation."""
  if _dropless(cfg) and getattr(cfg, "te_moe_block", False):
    raise ValueError(f"moe_impl=dropless and te_moe_block=true both replace the expert computation; {_FIX}")


def check_dispatch_serves_layout(cfg: Any) -> None:
  """The named dispatch can serve this expert-parallel degree, the nodes it spans and the capacity (auto
  is checked at launch)."""
  if _dropless(cfg):
    check_dispatch(
      cfg.moe_dispatch, ep=expert_parallelism(cfg), capacity_factor=cfg.moe_capacity_factor, nodes=expert_nodes(cfg)
    )


def check_buffers_and_capacity(cfg: Any) -> None:
  """Bounded buffers (dropless) and a capacity (drops) exclude each other; so do expert parallelism across
  nodes (all_to_all's dropless rounds) and a capacity (auto is checked at launch)."""
  if _dropless(cfg) and str(cfg.moe_dispatch) != "auto":
    dispatch = "all_to_all" if str(cfg.moe_dispatch) == "te_ep" and cfg.moe_capacity_factor <= 0 else cfg.moe_dispatch
    check_buffers(dispatch, cfg.moe_buffers, capacity_factor=cfg.moe_capacity_factor, nodes=expert_nodes(cfg))


def check_routing_groups_on_nodes(cfg: Any) -> None:
  """With expert parallelism across nodes, group-limited routing's groups lie on whole nodes (or a group on
  whole nodes), so that a token crosses the network to at most topk_routing_group nodes (x the nodes a
  group spans, `moe.levels`): the groups a multiple of the nodes, or the nodes of the groups."""
  nodes, groups = expert_nodes(cfg), int(cfg.n_routing_groups)
  if not _dropless(cfg) or nodes <= 1 or groups <= 0 or groups % nodes == 0 or nodes % groups == 0:
    return
  fits = ", ".join(str(n) for n in range(1, 4 * groups + 1) if groups % n == 0 or n % groups == 0)
  raise ValueError(
    f"n_routing_groups={groups} do not split evenly over the {nodes} nodes expert parallelism spans "
    f"(dcn_expert_parallelism): each node must hold whole groups, or each group whole nodes, for a token to "
    f"cross to at most topk_routing_group={cfg.topk_routing_group} groups' nodes; span a number of nodes that "
    f"divides {groups} or that it divides ({fits})"
  )


def check_gemm_quantization(cfg: Any) -> None:
  """A quantized grouped GEMM needs TE's backend (and MXFP8 te_ep's aligned groups); auto is checked at launch."""
  if _dropless(cfg) and str(cfg.moe_gemm_backend) != "auto":
    dispatch = None if str(cfg.moe_dispatch) == "auto" else cfg.moe_dispatch
    check_quantization(cfg.moe_gemm_quantization, cfg.moe_gemm_backend, dispatch)


def check_block_supports_model(cfg: Any) -> None:
  """What our block does not compute: MLP biases, clamped or non-gated activations, Llama 4's and GPT-OSS's
  MoE; and the `quantization` values that cannot mean its dense GEMMs (config.quantization)."""
  if not _dropless(cfg):
    return
  check_dense_quantization(cfg)
  unsupported = {
    "mlp_bias": bool(cfg.mlp_bias),
    "mlp_activations_limit": getattr(cfg, "mlp_activations_limit", 0.0) > 0,
    f"decoder_block={cfg.decoder_block}": str(getattr(cfg.decoder_block, "value", cfg.decoder_block))
    in ("llama4", "gpt_oss"),
    f"mlp_activations={list(cfg.mlp_activations)}": len(cfg.mlp_activations) != 2
    or cfg.mlp_activations[1] != "linear"
    or cfg.mlp_activations[0] not in ("silu", "gelu", "relu"),
  }
  bad = [k for k, v in unsupported.items() if v]
  if bad:
    raise ValueError(f"moe_impl=dropless does not support {bad[0]} yet; {_FIX}")


# Overrides, placed last, for a command that reads a recipe's model, layout or flags but never its weights
# (`convert`, `flags`): a *-finetune recipe then resolves without load_parameters_path, and a path given is
# not checked (check_finetune_has_weights would ask `convert` for the checkpoint it is about to write).
WITHOUT_WEIGHTS = ("finetune=false", "load_parameters_path=''", "load_full_state_path=''")


def check_finetune_has_weights(cfg: Any) -> None:
  """A fine-tuning recipe must load weights; a local checkpoint must exist and look like Orbax's."""
  path = cfg.load_parameters_path or cfg.load_full_state_path
  if getattr(cfg, "finetune", False) and not path:
    raise ValueError(
      "finetune=true needs weights to start from: set load_parameters_path=OUT/items "
      "(OUT of 'maxtext-moe convert hf-to-maxtext')"
    )
  if path and "://" not in str(path):
    from pathlib import Path  # pylint: disable=import-outside-toplevel

    p = Path(path)
    if not p.exists():
      raise ValueError(f"checkpoint {path} does not exist (load_parameters_path/load_full_state_path)")
    if not (p / "_METADATA").is_file() and not (p / "items" / "_METADATA").is_file():
      raise ValueError(f"{path} is not an Orbax checkpoint (no _METADATA): pass OUT/items of the converter")


def check_run_name(cfg: Any) -> None:
  """A run name is one path component: the run directory is base_output_directory/run_name, never outside."""
  name = str(getattr(cfg, "run_name", "") or "")
  if "/" in name or "\\" in name or name in (".", ".."):
    raise ValueError(
      f"run_name={name!r} must be a single name (no '/' or '..'): runs live in base_output_directory/run_name; "
      "set base_output_directory for another place"
    )


# MaxText 0.2.5's attention kernels (layers/attention_op.py): its config takes any string here and an
# unknown one fails only when the model is traced, as a ValueError from deep inside (found by fuzzing).
ATTENTION_KERNELS = (
  "autoselected",
  "dot_product",
  "flash",
  "cudnn_flash_te",
  "cudnn_flash_jax",
  "paged",
  "vllm_rpa",
  "vllm_batched_rpa",
)


def check_attention_kernel(cfg: Any) -> None:
  kernel = str(getattr(cfg, "attention", "autoselected"))
  if kernel not in ATTENTION_KERNELS:
    raise ValueError(f"attention={kernel!r} is not one of MaxText's attention kernels: {', '.join(ATTENTION_KERNELS)}")


def check_num_slices(cfg: Any) -> None:
  """-1 (count them from the devices) or a positive number; 0 divided by zero inside (found by fuzzing)."""
  slices = int(getattr(cfg, "num_slices", -1))
  if slices == 0 or slices < -1:
    raise ValueError(f"num_slices={slices} must be -1 (counted from the devices) or the number of slices (>= 1)")


def check_sequence_length(cfg: Any) -> None:
  """At least one token per sequence: 0 or less was a numpy error from inside the model (found by fuzzing)."""
  length = int(getattr(cfg, "max_target_length", 1))
  if length < 1:
    raise ValueError(f"max_target_length={length} must be at least 1 (tokens per training sequence)")


def check_vocab_tiling(cfg: Any) -> None:
  """MaxText's tiled loss cuts a device's tokens into `num_vocab_tiling` chunks: MaxText refuses a count
  that does not divide them without saying which would, and divides by 0 (a ZeroDivisionError from its
  validator): the resolution runs this before it."""
  tiles = int(getattr(cfg, "num_vocab_tiling", 1))
  if tiles < 1:
    raise ValueError(f"num_vocab_tiling={tiles} must be 1 (the loss untiled) or a number of chunks above 1")
  tokens = float(cfg.per_device_batch_size) * int(cfg.max_target_length)
  if tiles > 1 and tokens > 0 and tokens % tiles:
    fits = [n for n in (2, 4, 8, 16) if tokens % n == 0]
    raise ValueError(
      f"num_vocab_tiling={tiles} must divide a device's tokens, per_device_batch_size x max_target_length = "
      f"{tokens:,g}; use {fits[0] if fits else 1}, or 1 (untiled: across nodes MaxText's tiling gathers the "
      "whole batch on each, which `maxtext-moe plan` counts)"
    )


ALL_CHECKS = (
  check_run_name,
  check_sequence_length,
  check_attention_kernel,
  check_num_slices,
  check_one_auto_axis,
  check_layout_fits_devices,
  check_experts_divisible_by_ep,
  check_tensor_parallelism,
  check_topk_routing,
  check_sparse_matmul,
  check_one_expert_computation,
  check_dispatch_serves_layout,
  check_buffers_and_capacity,
  check_routing_groups_on_nodes,
  check_gemm_quantization,
  check_block_supports_model,
  check_pipeline_for_moe,
  check_pipeline_quantization,
  check_microbatch_splits,
  check_exchange_chunks,
  check_finetune_has_weights,
  checkpointing.check_kept,
)
