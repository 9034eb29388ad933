"""Cross-field checks on a resolved config, one concern each.

Each check takes the resolved config (any object with MaxText's attribute names) and raises
`ValueError` with a one-line message that says what is wrong and how to fix it. They run inside
the plugin's pydantic config class (see `upstream.config`), after MaxText's own validation.
"""

import math
from typing import Any

from maxtext_moe.moe.settings import check_dispatch, check_quantization

_ICI = "ici_"
_DCN = "dcn_"
_SUFFIX = "_parallelism"


def parallelism_axes(cfg: Any, *, prefix: str) -> dict[str, int]:
  """Returns {axis: degree} for every `<prefix><axis>_parallelism` field of `cfg`.

  Example: for MaxText's defaults, `parallelism_axes(cfg, prefix="ici_")["fsdp"] == -1`.
  """
  fields = type(cfg).model_fields if hasattr(type(cfg), "model_fields") else vars(cfg)
  axes = {}
  for name in fields:
    axis = name[len(prefix) : -len(_SUFFIX)]
    value = getattr(cfg, name)
    # `ici_parallelism` (no axis) is MaxText's derived list of all degrees, not an axis.
    if name.startswith(prefix) and name.endswith(_SUFFIX) and axis and isinstance(value, int):
      axes[axis] = value
  return axes


def check_one_auto_axis(cfg: Any) -> None:
  """At most one ICI and one DCN axis may be -1 (filled with the remaining devices)."""
  for prefix in (_ICI, _DCN):
    auto = [a for a, d in parallelism_axes(cfg, prefix=prefix).items() if d == -1]
    if len(auto) > 1:
      names = ", ".join(f"{prefix}{a}{_SUFFIX}" for a in auto)
      raise ValueError(f"impossible layout: {names} are all -1; at most one {prefix}*{_SUFFIX} may be -1 (auto)")
    bad = [a for a, d in parallelism_axes(cfg, prefix=prefix).items() if d == 0 or d < -1]
    if bad:
      raise ValueError(f"impossible layout: {prefix}{bad[0]}{_SUFFIX} must be >= 1 or -1 (auto)")


def fixed_layout_size(cfg: Any, *, prefix: str | None = None) -> tuple[int, bool]:
  """Returns (product of the fixed degrees, whether some axis is -1 auto), over ICI, DCN or both."""
  prefixes = (prefix,) if prefix else (_ICI, _DCN)
  degrees = [d for p in prefixes for d in parallelism_axes(cfg, prefix=p).values()]
  return math.prod(d for d in degrees if d > 0), any(d == -1 for d in degrees)


def _fits(cfg: Any, *, prefix: str, n: int, where: str) -> None:
  size, has_auto = fixed_layout_size(cfg, prefix=prefix)
  if (has_auto and n % size == 0) or (not has_auto and n == size):
    return
  rel = "divide" if has_auto else "equal"
  raise ValueError(
    f"impossible layout: the {prefix}*{_SUFFIX} product is {size} but must {rel} the {n} {where}; "
    f"change the parallelism degrees (or set one {prefix}*{_SUFFIX} to -1)"
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
  _fits(cfg, prefix=_DCN, n=slices, where="slices (num_slices)")
  _fits(cfg, prefix=_ICI, n=n // slices, where="devices per slice")


def check_experts_divisible_by_ep(cfg: Any) -> None:
  """Experts are split evenly over the expert-parallel ranks."""
  ep = max(cfg.ici_expert_parallelism, 1) * max(cfg.dcn_expert_parallelism, 1)
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


def check_dropless_block_applies(cfg: Any) -> None:
  """Our block sits at MaxText's sparse_matmul seam; say so when a setting would bypass or break it."""
  if str(cfg.moe_impl) != "dropless" or cfg.num_experts <= 1:
    return
  fix = "or set moe_impl=maxtext"
  if not cfg.sparse_matmul:
    raise ValueError(f"moe_impl=dropless replaces MaxText's sparse_matmul path: set sparse_matmul=true, {fix}")
  if getattr(cfg, "te_moe_block", False):
    raise ValueError(f"moe_impl=dropless and te_moe_block=true both replace the expert computation; {fix}")
  ep = max(cfg.ici_expert_parallelism, 1) * max(cfg.dcn_expert_parallelism, 1)
  check_dispatch(cfg.moe_dispatch, ep=ep, capacity_factor=cfg.moe_capacity_factor)
  if cfg.moe_buffer_factor > 0 and cfg.moe_capacity_factor > 0:
    raise ValueError(
      f"moe_buffer_factor={cfg.moe_buffer_factor} (bounded and dropless) and moe_capacity_factor="
      f"{cfg.moe_capacity_factor} (drops past a capacity) exclude each other; set one of them to 0"
    )
  if str(cfg.moe_gemm_backend) != "auto":  # `auto` is checked at launch, once the platform is known
    dispatch = None if str(cfg.moe_dispatch) == "auto" else cfg.moe_dispatch
    check_quantization(cfg.moe_gemm_quantization, cfg.moe_gemm_backend, dispatch)
  unsupported = {
    "quantization": bool(cfg.quantization and str(getattr(cfg.quantization, "value", cfg.quantization))),
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
    raise ValueError(f"moe_impl=dropless does not support {bad[0]} yet; {fix}")


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


ALL_CHECKS = (
  check_one_auto_axis,
  check_layout_fits_devices,
  check_experts_divisible_by_ep,
  check_topk_routing,
  check_dropless_block_applies,
  check_finetune_has_weights,
)
