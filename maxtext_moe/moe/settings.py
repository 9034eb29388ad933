"""The MoE block's settings and every rule about them, in one place.

The enums are the values of the config keys `moe_dispatch` and `moe_gemm_backend`; `MoESettings` is what
the block runs with. The rules below (what `auto` picks, which dispatch accepts a capacity, which runs in
rounds; the buffers' sizes are `buffers.py`'s) are imported by the config checks, the block, the planner
and the benchmarks, never restated.

Shape legend: T tokens per device, K top-k, P expert-parallel ranks.
"""

import functools
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from maxtext_moe.moe import mesh_axes


class MoEImpl(StrEnum):
  """Which code computes the routed experts."""

  DROPLESS = "dropless"  # ours: maxtext_moe.moe, patched in at MaxText's sparse_matmul seam
  MAXTEXT = "maxtext"  # MaxText's own sparse_matmul / dense_matmul


class DispatchKind(StrEnum):
  """How routed tokens reach their experts' devices (each token sent once per destination rank)."""

  AUTO = "auto"  # see resolve_dispatch
  LOCAL = "local"  # no expert parallelism
  ALL_TO_ALL = "all_to_all"  # portable; padded worst-case buffers on the wire
  RAGGED_ALL_TO_ALL = "ragged_all_to_all"  # only real rows on the wire; XLA's NCCL send/recv on GPU
  TE_EP = "te_ep"  # Transformer Engine's NCCL EP: fused dispatch/combine, one GPU per process


class BufferMode(StrEnum):
  """How large the expert-parallel buffers are (all_to_all, ragged_all_to_all; te_ep sizes its own)."""

  BOUNDED = "bounded"  # moe_buffer_factor x the mean load, the overflow in further rounds (moe.rounds): dropless
  WORST_CASE = "worst_case"  # one exchange sized for every token on one rank (or capped by moe_capacity_factor)


DEFAULT_BUFFER_FACTOR = 1.5  # bounded buffers: 1.5 x the mean load (one round for natural routing)


class GemmBackend(StrEnum):
  """The grouped GEMM behind `gemm.grouped_matmul`."""

  AUTO = "auto"  # see resolve_backend
  RAGGED_DOT = "ragged_dot"
  TILED = "tiled"
  TOKAMAX = "tokamax"
  TE = "te"  # Transformer Engine's grouped_dense (GPU): BF16, FP8 or MXFP8


class GemmQuantization(StrEnum):
  """The grouped GEMM's number format (`te` backend only; TE's quantizer sets)."""

  NONE = "none"  # the activations' dtype (bf16 on GPU)
  FP8 = "fp8"  # e4m3 forward, e5m2 gradients, per-tensor current scaling; SM89+
  MXFP8 = "mxfp8"  # e4m3 with E8M0 scales per 32 values; SM100+ (Blackwell)


@dataclass(frozen=True)
class Platform:
  """What the `auto` policy knows of where the block runs (launch.doctor probes it)."""

  name: str  # jax.default_backend(): "cpu", "gpu" or "tpu"
  te_gemm: bool = False  # TE's grouped_dense imports here
  te_ep: bool = False  # TE's NCCL EP can serve this job: SM90+, NCCL >= 2.30.4, one GPU per process, >= 2 of them


@functools.cache
def detect_platform() -> Platform:
  """This process's Platform (probed once): TE's grouped GEMM where TE imports on a GPU, TE's EP where it can serve the
  job (`upstream.te.calls.ep_unready_reasons`). Starts the JAX backend."""
  import jax  # pylint: disable=import-outside-toplevel

  from maxtext_moe.upstream.te import calls as te  # pylint: disable=import-outside-toplevel  # the TE seam, a leaf module

  name = jax.default_backend()
  gpu = name == "gpu"
  return Platform(name, te_gemm=gpu and te.status().available, te_ep=gpu and not te.ep_unready_reasons())


# MaxText's remat names for the block's three GEMM outputs (`checkpoint_name` tags), so its custom remat
# policy (and our offload presets) can save or offload them; not under the bounded rounds
# (`outputs_recomputed`, checked at the block's GEMM call site).
REMAT_NAMES = ("moe_mlpwi_0", "moe_mlpwi_1", "moe_mlpwo")


@dataclass(frozen=True)
class MoESettings:
  """How the routed experts run. Built from the config keys (upstream.maxtext.moe_layer.settings_from_config)."""

  dispatch: DispatchKind = DispatchKind.AUTO
  gemm: GemmBackend = GemmBackend.AUTO
  capacity_factor: float = 0.0
  buffers: BufferMode = BufferMode.BOUNDED
  buffer_factor: float = DEFAULT_BUFFER_FACTOR  # bounded: buffers of this x the mean load (moe.rounds)
  activation: str = "silu"
  quantization: GemmQuantization = GemmQuantization.NONE
  te_recv_capacity: int = 0  # te_ep: rows each rank receives, as bootstrapped (0: TE's sizing for this call)
  top_k: int = 0  # set by the block from the routing it is given
  # The ragged dispatcher's collective; None: jax.lax.ragged_all_to_all. Tests on XLA:CPU pass
  # collectives.ragged_all_to_all_reference.
  ragged_exchange: Callable | None = None
  window_sizes: tuple[int, ...] | None = None  # the `tiled` GEMM's ladder; None: permute.window_sizes
  ep_nodes: int = 1  # nodes (NVLink domains) the expert axis spans: its DCN degree (moe.levels)
  routing_groups: tuple[int, int] = (0, 0)  # (n_routing_groups, topk_routing_group); (0, 0): none
  exchange_chunks: int = 1  # the bounded rounds' tokens in this many chunks, for overlap (moe.rounds)
  # FSDP-split expert weights gathered as TE's FP8 codes (`moe.fp8_gather`); only with quantization fp8
  fp8_gather: bool = False


def _platform(platform: Platform | str) -> Platform:
  return platform if isinstance(platform, Platform) else Platform(platform)


def resolve_dispatch(
  kind: DispatchKind | str,
  *,
  ep: int,
  platform: Platform | str,
  capacity_factor: float = 0.0,
  axis_sizes: dict[str, int] | None = None,
  num_experts: int = 0,
  nodes: int = 1,
) -> DispatchKind:
  """Turns `auto` into a concrete dispatcher. Without EP: local. With EP on a GPU: te_ep where TE's NCCL
  EP can serve the job (the platform, and the mesh `axis_sizes` when given: tokens split over expert and
  at most one of data or fsdp, as on N nodes of a layout with FSDP inside a node and data parallelism
  across, which TE EP cannot take), else the portable all_to_all, never ragged_all_to_all (XLA:GPU runs it as NCCL
  send/recv: about 2% of NVLink on 8 B200s, its one-shot kernel handles at most 8 peers and crashed above
  32 ranks; docs/design-facts.md). On a TPU ragged_all_to_all unless a capacity is set; on CPU all_to_all.

  Expert parallelism across `nodes` > 1 (its DCN degree), dropless: all_to_all's two levels in bounded
  rounds (`moe.levels`), for auto and te_ep alike: TE's dropless receive buffer is its worst case, every
  token of all P ranks (154 GiB per H100 at EP 64 for DeepSeek-V3), where the rounds size theirs from the
  mean (`cross_node_note` says so at start). te_ep with a capacity factor stays te_ep.

  Example: resolve_dispatch("auto", ep=8, platform=Platform("gpu", te_ep=True)) -> DispatchKind.TE_EP;
    with nodes=2 -> DispatchKind.ALL_TO_ALL.
  """
  kind, platform = DispatchKind(kind), _platform(platform)
  across = nodes > 1 and capacity_factor <= 0
  if kind == DispatchKind.TE_EP and across:
    return DispatchKind.ALL_TO_ALL
  if kind != DispatchKind.AUTO:
    return kind
  if ep == 1:
    return DispatchKind.LOCAL
  if platform.name == "gpu":
    served = axis_sizes is None or mesh_axes.te_ep_layout_problem(axis_sizes, num_experts=num_experts) is None
    return DispatchKind.TE_EP if platform.te_ep and served and not across else DispatchKind.ALL_TO_ALL
  if platform.name == "tpu" and capacity_factor <= 0 and nodes <= 1:
    return DispatchKind.RAGGED_ALL_TO_ALL
  return DispatchKind.ALL_TO_ALL


def cross_node_note(kind: DispatchKind | str, resolved: DispatchKind | str, *, ep: int, nodes: int) -> str | None:
  """The line said at start when expert parallelism across nodes runs our two-level rounds where TE's NCCL
  EP was asked for (or would be `auto`'s choice inside a node); None otherwise."""
  if nodes <= 1 or DispatchKind(resolved) != DispatchKind.ALL_TO_ALL:
    return None
  if DispatchKind(kind) not in (DispatchKind.TE_EP, DispatchKind.AUTO):
    return None
  asked = "moe_dispatch=te_ep" if DispatchKind(kind) == DispatchKind.TE_EP else "moe_dispatch=auto"
  return (
    f"{asked} with expert parallelism {ep} across {nodes} nodes: the exchange runs as all_to_all in two "
    "levels (the network once per token and node, then NVLink) in rounds of bounded buffers, not TE's NCCL "
    "EP, whose dropless receive buffer holds every token of all ranks; moe_dispatch=te_ep "
    "moe_capacity_factor=F keeps TE with F times the balanced load (an overflow stops the run)"
  )


def resolve_backend(backend: GemmBackend | str, *, platform: Platform | str) -> GemmBackend:
  """Turns `auto` into a concrete grouped GEMM. On a GPU: te where TE imports, else tokamax (its Mosaic GPU
  kernels: one custom call per GEMM, no data-dependent branch), never ragged_dot (XLA:GPU rewrites it to a
  dense dot: about 25 TFLOP/s on a B200) nor tiled (a conditional per expert and GEMM, each a host sync on
  XLA:GPU; docs/gpu-path.md). On a TPU ragged_dot (Mosaic's grouped matmul); on CPU tiled."""
  backend, platform = GemmBackend(backend), _platform(platform)
  if backend != GemmBackend.AUTO:
    return backend
  if platform.name == "gpu":
    return GemmBackend.TE if platform.te_gemm else GemmBackend.TOKAMAX
  return GemmBackend.RAGGED_DOT if platform.name == "tpu" else GemmBackend.TILED


def check_dispatch(kind: DispatchKind | str, *, ep: int, capacity_factor: float, nodes: int = 1) -> None:
  """Raises ValueError (one line, with the fix) for a dispatch that cannot serve this layout."""
  kind = DispatchKind(kind)
  if kind == DispatchKind.LOCAL and ep > 1:
    raise ValueError(f"moe_dispatch=local cannot serve expert parallelism {ep}; use all_to_all or auto")
  if kind == DispatchKind.RAGGED_ALL_TO_ALL and capacity_factor > 0:
    raise ValueError("moe_dispatch=ragged_all_to_all is always dropless: set moe_capacity_factor=0 or use all_to_all")
  if kind == DispatchKind.RAGGED_ALL_TO_ALL and nodes > 1:
    raise ValueError(
      f"moe_dispatch=ragged_all_to_all exchanges over the whole expert axis and cannot go by node; expert "
      f"parallelism across {nodes} nodes needs moe_dispatch=all_to_all (two levels: network, then NVLink) or auto"
    )
  if kind == DispatchKind.TE_EP and ep < 2:
    raise ValueError(f"moe_dispatch=te_ep needs expert parallelism of at least 2, got {ep}; use local or auto")
  if kind == DispatchKind.TE_EP and 0 < capacity_factor < 1:
    raise ValueError(f"moe_dispatch=te_ep takes moe_capacity_factor 0 (dropless) or >= 1, got {capacity_factor}")
  if nodes > 1 and ep % nodes:
    raise ValueError(f"expert parallelism {ep} does not split evenly over the {nodes} nodes it spans")


def check_buffers(
  kind: DispatchKind | str, buffers: BufferMode | str, *, capacity_factor: float, nodes: int = 1
) -> None:
  """Bounded buffers are dropless; a capacity factor caps single-shot buffers and drops what overflows: the
  two exclude each other where the buffers are ours (all_to_all; ragged_all_to_all takes no capacity). Across
  nodes all_to_all always runs in rounds (`moe.levels`): dropless, whatever its buffers."""
  if not (runs_in_rounds(kind, buffers, nodes=nodes) and capacity_factor > 0):
    return
  if nodes > 1 and BufferMode(buffers) == BufferMode.WORST_CASE:
    raise ValueError(
      f"expert parallelism across {nodes} nodes runs moe_dispatch=all_to_all in dropless rounds, which take no "
      f"moe_capacity_factor ({capacity_factor}); set moe_capacity_factor=0"
    )
  raise ValueError(
    f"moe_buffers=bounded (dropless rounds) and moe_capacity_factor={capacity_factor} (a cap that drops) exclude "
    "each other: set moe_buffers=worst_case to cap the single-shot buffers, or moe_capacity_factor=0"
  )


def check_quantization(
  quantization: GemmQuantization | str, backend: GemmBackend | str, dispatch: DispatchKind | str | None = None
) -> None:
  """FP8 and MXFP8 are TE's: a quantized grouped GEMM needs the te backend. MXFP8 also needs every group
  128-row aligned (TE 2.20's V2 kernel reads the wrong scales otherwise), which only te_ep's receive
  buffer guarantees."""
  quantization = GemmQuantization(quantization)
  if quantization != GemmQuantization.NONE and GemmBackend(backend) != GemmBackend.TE:
    raise ValueError(
      f"moe_gemm_quantization={quantization} needs moe_gemm_backend=te (Transformer Engine's quantized "
      f"grouped GEMM), not {backend}"
    )
  if quantization == GemmQuantization.MXFP8 and dispatch is not None and DispatchKind(dispatch) != DispatchKind.TE_EP:
    raise ValueError(
      f"moe_gemm_quantization=mxfp8 needs 128-row aligned expert groups, which only moe_dispatch=te_ep gives "
      f"(this run uses {dispatch}); use fp8 or none"
    )


def runs_in_rounds(kind: DispatchKind | str, buffers: BufferMode | str, *, nodes: int = 1) -> bool:
  """Whether this dispatch runs in rounds (`moe.rounds`): all_to_all and ragged_all_to_all with
  `moe_buffers: bounded`, and all_to_all across nodes whatever its buffers (two levels, `moe.levels`; with
  worst_case their budgets are ones no routing exceeds); te_ep sizes its own buffers and local has none."""
  kind = DispatchKind(kind)
  exchanged = kind in (DispatchKind.ALL_TO_ALL, DispatchKind.RAGGED_ALL_TO_ALL)
  return exchanged and (BufferMode(buffers) == BufferMode.BOUNDED or (kind == DispatchKind.ALL_TO_ALL and nodes > 1))


def outputs_recomputed(kind: DispatchKind | str, buffers: BufferMode | str, *, nodes: int = 1) -> bool:
  """Whether the experts' GEMM outputs are recomputed whatever the remat policy says of REMAT_NAMES: in
  rounds, whose backward recomputes each round (a custom VJP that keeps only the rounds' inputs)."""
  return runs_in_rounds(kind, buffers, nodes=nodes)
