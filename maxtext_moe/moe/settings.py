"""The MoE block's settings and every rule about them, in one place.

The enums are the values of the config keys `moe_dispatch` and `moe_gemm_backend`; `MoESettings` is what
the block runs with. The rules below (what `auto` picks, which dispatch accepts a capacity, the buffer
sizes) are imported by the config checks, the block, the planner and the benchmarks, never restated.

Shape legend: T tokens per device, K top-k, P expert-parallel ranks.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum


class DispatchKind(StrEnum):
  """How routed tokens reach their experts' devices (each token sent once per destination rank)."""

  AUTO = "auto"  # see resolve_dispatch
  LOCAL = "local"  # no expert parallelism
  ALL_TO_ALL = "all_to_all"  # portable; padded worst-case buffers on the wire
  RAGGED_ALL_TO_ALL = "ragged_all_to_all"  # only real rows on the wire; GPU/TPU


class GemmBackend(StrEnum):
  """The grouped GEMM behind `gemm.grouped_matmul`."""

  AUTO = "auto"  # see resolve_backend
  RAGGED_DOT = "ragged_dot"
  TILED = "tiled"
  TOKAMAX = "tokamax"


# MaxText's remat names for the block's three GEMM outputs (`checkpoint_name` tags), so its custom remat
# policy (and our offload presets) can save or offload them.
REMAT_NAMES = ("moe_mlpwi_0", "moe_mlpwi_1", "moe_mlpwo")


@dataclass(frozen=True)
class MoESettings:
  """How the routed experts run. Built from the config keys (upstream.moe_layer.settings_from_config)."""

  dispatch: DispatchKind = DispatchKind.AUTO
  gemm: GemmBackend = GemmBackend.AUTO
  capacity_factor: float = 0.0
  activation: str = "silu"
  # The ragged dispatcher's collective; None: jax.lax.ragged_all_to_all. Tests on XLA:CPU pass
  # collectives.ragged_all_to_all_reference.
  ragged_exchange: Callable | None = None
  window_sizes: tuple[int, ...] | None = None  # the `tiled` GEMM's ladder; None: permute.window_sizes


def resolve_dispatch(kind: DispatchKind | str, *, ep: int, platform: str, capacity_factor: float = 0.0) -> DispatchKind:
  """Turns `auto` into a concrete dispatcher: local without EP; with EP, ragged_all_to_all where XLA has
  it (GPU/TPU) unless a capacity is set, else the portable all_to_all.

  Example: resolve_dispatch("auto", ep=8, platform="cpu") -> DispatchKind.ALL_TO_ALL.
  """
  kind = DispatchKind(kind)
  if kind != DispatchKind.AUTO:
    return kind
  if ep == 1:
    return DispatchKind.LOCAL
  if platform == "cpu" or capacity_factor > 0:
    return DispatchKind.ALL_TO_ALL
  return DispatchKind.RAGGED_ALL_TO_ALL


def resolve_backend(backend: GemmBackend | str, *, platform: str) -> GemmBackend:
  """Turns `auto` into a concrete grouped-GEMM backend: tiled on CPU, ragged_dot elsewhere."""
  backend = GemmBackend(backend)
  if backend != GemmBackend.AUTO:
    return backend
  return GemmBackend.TILED if platform == "cpu" else GemmBackend.RAGGED_DOT


def check_dispatch(kind: DispatchKind | str, *, ep: int, capacity_factor: float) -> None:
  """Raises ValueError (one line, with the fix) for a dispatch that cannot serve this layout."""
  kind = DispatchKind(kind)
  if kind == DispatchKind.LOCAL and ep > 1:
    raise ValueError(f"moe_dispatch=local cannot serve expert parallelism {ep}; use all_to_all or auto")
  if kind == DispatchKind.RAGGED_ALL_TO_ALL and capacity_factor > 0:
    raise ValueError("moe_dispatch=ragged_all_to_all is always dropless: set moe_capacity_factor=0 or use all_to_all")


def capacity(num_tokens: int, top_k: int, *, num_ranks: int, capacity_factor: float) -> int:
  """Rows per destination rank in the all_to_all buffers: T when dropless (capacity_factor <= 0), else
  ceil(capacity_factor * T * K / P), at most T.

  Example: capacity(8, 3, num_ranks=4, capacity_factor=0.5) -> 3.
  """
  if capacity_factor <= 0:
    return num_tokens
  return max(1, min(num_tokens, math.ceil(capacity_factor * num_tokens * top_k / num_ranks)))


def routed_rows(
  kind: DispatchKind | str, num_tokens: int, top_k: int, *, num_ranks: int, capacity_factor: float
) -> int:
  """Rows of the buffers handed to the grouped GEMM on one device (dropless sizes are worst cases):
  local T x K; all_to_all P x capacity x K; ragged_all_to_all T x P x K."""
  kind = DispatchKind(kind)
  if kind == DispatchKind.LOCAL:
    return num_tokens * top_k
  if kind == DispatchKind.ALL_TO_ALL:
    cap = capacity(num_tokens, top_k, num_ranks=num_ranks, capacity_factor=capacity_factor)
    return num_ranks * cap * top_k
  return num_tokens * num_ranks * top_k
