"""A config's parallelism layout, read once: the degree of each mesh axis, the expert-parallel degree, the
nodes it spans and the dispatch that serves it, as the MoE block, the checks and the planner read them.

Every function takes a resolved config (any object with MaxText's attribute names), so this pure module
sits with the MoE math and imports nothing above it. MaxText names its
ICI degrees `ici_<axis>_parallelism` and its DCN (across slices) degrees `dcn_<axis>_parallelism`; -1 means
"the devices left over", at most one per side.
"""

import math
from typing import Any

ICI = "ici_"
DCN = "dcn_"
SUFFIX = "_parallelism"


def parallelism_axes(cfg: Any, *, prefix: str) -> dict[str, int]:
  """Returns {axis: degree} for every `<prefix><axis>_parallelism` field of `cfg`.

  Example: for MaxText's defaults, `parallelism_axes(cfg, prefix="ici_")["fsdp"] == -1`.
  """
  fields = type(cfg).model_fields if hasattr(type(cfg), "model_fields") else vars(cfg)
  axes = {}
  for name in fields:
    axis = name[len(prefix) : -len(SUFFIX)]
    value = getattr(cfg, name)
    # `ici_parallelism` (no axis) is MaxText's derived list of all degrees, not an axis.
    if name.startswith(prefix) and name.endswith(SUFFIX) and axis and isinstance(value, int):
      axes[axis] = value
  return axes


def fixed_layout_size(cfg: Any, *, prefix: str | None = None) -> tuple[int, bool]:
  """Returns (product of the fixed degrees, whether some axis is -1 auto), over ICI, DCN or both."""
  prefixes = (prefix,) if prefix else (ICI, DCN)
  degrees = [d for p in prefixes for d in parallelism_axes(cfg, prefix=p).values()]
  return math.prod(d for d in degrees if d > 0), any(d == -1 for d in degrees)


def expert_parallelism(cfg: Any) -> int:
  """The expert-parallel degree: ICI x DCN expert degrees (an auto -1 expert axis counts as 1 here).

  Example: ici_expert_parallelism=8, dcn_expert_parallelism=1 -> 8.
  """
  return max(int(cfg.ici_expert_parallelism), 1) * max(int(cfg.dcn_expert_parallelism), 1)


def _fill(degrees: list[int], total: int) -> list[int]:
  """A -1 degree replaced by what the others leave of `total`, as MaxText fills it."""
  degrees = [int(d) for d in degrees]
  if -1 in degrees:
    known = math.prod(d for d in degrees if d != -1)
    degrees[degrees.index(-1)] = max(total // known, 1)
  return degrees


def mesh_sides(cfg: Any, num_devices: int) -> dict[str, tuple[int, int]]:
  """{mesh axis: (ICI degree, DCN degree)} over `num_devices`, a -1 axis filled as MaxText does. The DCN
  degree of an axis is how many slices (NVLink partitions on a GPU cluster) its groups span."""
  slices = max(int(getattr(cfg, "num_slices", 1) or 1), 1)
  ici = _fill(list(cfg.ici_parallelism), num_devices // slices)
  dcn = _fill(list(cfg.dcn_parallelism), slices)
  return {axis: (i, d) for axis, i, d in zip(cfg.mesh_axes, ici, dcn, strict=True)}


def mesh_sizes(cfg: Any, num_devices: int) -> dict[str, int]:
  """{mesh axis: size} over `num_devices` from the ICI and DCN degrees, a -1 axis filled as MaxText does."""
  return {axis: i * d for axis, (i, d) in mesh_sides(cfg, num_devices).items()}


def expert_nodes(cfg: Any, num_devices: int | None = None) -> int:
  """Nodes (NVLink domains) the expert axis spans: its DCN degree, a -1 filled as MaxText does over
  `num_devices` (default the recipe's; 1 where neither is known)."""
  dcn = int(cfg.dcn_expert_parallelism)
  devices = int(cfg.recipe_num_devices) if num_devices is None else num_devices
  if dcn > 0 or devices <= 0:
    return max(dcn, 1)
  return mesh_sides(cfg, devices).get("expert", (1, 1))[1]


def dispatch_for(cfg: Any, *, num_devices: int, platform: Any, kind: Any = None) -> Any:
  """What `moe_dispatch` (or `kind`) resolves to for this config's mesh on `num_devices` devices of
  `platform` (`moe.settings.resolve_dispatch`: the expert-parallel degree, the nodes it spans, the
  layout TE's NCCL EP serves)."""
  from maxtext_moe.moe.settings import resolve_dispatch  # pylint: disable=import-outside-toplevel

  sides = mesh_sides(cfg, num_devices)
  sizes = {a: i * d for a, (i, d) in sides.items()}
  return resolve_dispatch(
    cfg.moe_dispatch if kind is None else kind,
    ep=sizes.get("expert", 1),
    platform=platform,
    capacity_factor=float(cfg.moe_capacity_factor),
    axis_sizes=sizes,
    num_experts=int(cfg.num_experts),
    nodes=sides.get("expert", (1, 1))[1],
  )


def check_resolved_dispatch(cfg: Any, kind: Any, *, num_devices: int) -> None:
  """The dispatch `kind` that `moe_dispatch` resolved to, checked as if named (ValueError, one line): the
  layout it must serve and the buffers beside a capacity factor (`moe.settings`)."""
  from maxtext_moe.moe import settings  # pylint: disable=import-outside-toplevel

  if str(cfg.moe_impl) != "dropless" or int(cfg.num_experts) <= 1:
    return
  nodes, capacity = expert_nodes(cfg, num_devices), float(cfg.moe_capacity_factor)
  ep = mesh_sizes(cfg, num_devices).get("expert", 1)
  settings.check_dispatch(kind, ep=ep, capacity_factor=capacity, nodes=nodes)
  settings.check_buffers(kind, cfg.moe_buffers, capacity_factor=capacity, nodes=nodes)


def routing_groups(cfg: Any) -> tuple[int, int]:
  """(n_routing_groups, topk_routing_group) of group-limited routing; (0, 0) without it."""
  groups = int(getattr(cfg, "n_routing_groups", -1) or -1)
  return (groups, int(cfg.topk_routing_group)) if groups > 0 else (0, 0)


def fp8_gathered(cfg: Any) -> bool:
  """Whether our block gathers its expert weights as TE's FP8 codes (`moe.fp8_gather`): `moe_fp8_gather`
  with `moe_gemm_quantization: fp8`."""
  return bool(getattr(cfg, "moe_fp8_gather", False)) and str(getattr(cfg, "moe_gemm_quantization", "none")) == "fp8"


def exchange_chunks(cfg: Any, *, nodes: int) -> int:
  """`moe_exchange_chunks`, its 0 (auto) made 4 where expert parallelism spans nodes, else 1 (the chained
  chunks' share of the exchange beside a GEMM, `steptime.constants.EXCHANGE_BESIDE`, is 24% at 2, 53% at 4)."""
  chunks = int(getattr(cfg, "moe_exchange_chunks", 0))
  return chunks if chunks > 0 else (4 if nodes > 1 else 1)


def check_tensor_parallelism(cfg: Any) -> None:
  """Tensor parallelism (MaxText's `tensor` and `tensor_sequence` axes) splits the attention heads: it must
  divide the query heads and the key/value heads."""
  tp = 1
  for axis in ("tensor", "tensor_sequence"):
    tp *= int(getattr(cfg, f"ici_{axis}_parallelism", 1)) * int(getattr(cfg, f"dcn_{axis}_parallelism", 1))
  heads = {"num_query_heads": int(cfg.num_query_heads), "num_kv_heads": int(cfg.num_kv_heads)}
  bad = [f"{k}={v}" for k, v in heads.items() if tp > 1 and v % tp]
  if bad:
    fits = [t for t in (2, 4, 8) if t < tp and all(v % t == 0 for v in heads.values())]
    raise ValueError(
      f"impossible layout: tensor parallelism {tp} (ici/dcn_tensor x tensor_sequence) does not divide {bad[0]}; "
      + (f"use ici_tensor_parallelism={fits[-1]}" if fits else "use ici_tensor_parallelism=1")
    )


def value_of(x: Any) -> str:
  """A config value as YAML spells it (MaxText's str-mixin enums print their class name)."""
  return str(getattr(x, "value", x) or "")


def layer_counts(cfg: Any) -> tuple[int, int]:
  """(dense layers, MoE layers) of the model, each multi-token-prediction layer a MoE one: a DeepSeek
  decoder's `first_num_dense_layers` are dense, every other decoder's layers MoE ones in a MoE model."""
  mtp = int(getattr(cfg, "mtp_num_layers", 0) or 0)
  layers = int(cfg.num_decoder_layers)
  if int(cfg.num_experts) <= 1:
    return layers + mtp, 0
  dense = int(getattr(cfg, "first_num_dense_layers", 0) or 0) if value_of(cfg.decoder_block) == "deepseek" else 0
  return dense, layers - dense + mtp
