"""The Transformer Engine seam (transformer-engine 2.20.2, JAX side): its grouped GEMM and NCCL EP.

Every TE call in maxtext_moe is in this module (or, for a compile without a GPU, in compile_target.py, the stand-ins
for what TE asks a device while a step is traced), and every one is checked by tests/test_te_contract.py
against manifest.json: the signatures read from TE 2.20.2's own Python sources (the
`transformer_engine-2.20.2-py3-none-any.whl` wheel holds transformer_engine/jax/*.py; the
transformer-engine-jax sdist holds only the C++ extension), written by scripts/pin_te.py. TE is imported
lazily: without CUDA `import transformer_engine` raises RuntimeError, not ImportError (`status` keeps
the reason), and this module imports nothing of ours, so the MoE math may use it on a bare JAX install.

What we use, as read from those sources:
- `dense.grouped_dense(x[M, K], kernel[G, K, N], group_sizes[G], contracting_dims=((1,), (1,)), ...,
  quantizer_set=...)`: a custom VJP; no sharding rules (we call it per shard, inside shard_map); asserts
  that FSDP-sharded kernels are not supported. Rows past sum(group_sizes) are skipped, their outputs left
  uninitialised: `grouped_dense` masks them, both ways.
- `ep.ep_bootstrap(world_size, rank, num_experts, max_tokens_per_rank, recv_capacity_per_rank, hidden_dim,
  ...)`: once per process, inside the mesh and a `global_shard_guard(MeshResource(ep_resource=...))`;
  bf16 tokens only; world size >= 2; one device per process unless TE was built with XLA's collectives.
- `ep.ep_dispatch(cfg, topk_idx, tokens, topk_weights, recv_capacity_per_rank)` -> (recv_tokens,
  recv_topk_weights, handle_mem, token_counts, total_recv_tokens) and `ep.ep_combine(cfg, handle_mem,
  token_counts, expert_out, num_local_tokens)`: global arrays whose leading dim is sharded over (dp/fsdp,
  ep); combine is unweighted; the receive capacity must equal the bootstrapped one.
- `moe.get_moe_recv_capacity_per_rank(...)`: TE's own sizing (dropless worst case, or a factor >= 1).
"""

import contextlib
import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

PINNED = "2.20.2"  # the TE whose Python API manifest.json records
MIN_VERSION = (2, 20)  # older TE lacks this EP API (its signatures changed between minor releases)
EP_ALIGNMENT = 128  # rows per local expert block in TE EP's receive buffer (NCCL EP HT's requirement)
MIN_NCCL = (2, 30, 4)  # TE EP's NCCL requirement


@dataclass(frozen=True)
class Status:
  """Whether TE imports here, and why not."""

  available: bool
  version: str | None
  reason: str


@functools.cache
def status() -> Status:
  """Imports TE's JAX side once. Any failure (RuntimeError without CUDA, ImportError, a broken build) is
  kept as the reason."""
  try:
    import transformer_engine  # pylint: disable=import-outside-toplevel
    from transformer_engine.jax import dense, ep  # noqa: F401  # pylint: disable=import-outside-toplevel,unused-import
  except Exception as e:  # pylint: disable=broad-except  # RuntimeError without CUDA, ImportError, OSError
    first_line = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return Status(False, None, f"{type(e).__name__}: {first_line}".rstrip(": "))
  version = str(getattr(transformer_engine, "__version__", "0"))
  if _release(version) < MIN_VERSION:
    return Status(False, version, f"Transformer Engine {version} is older than {'.'.join(map(str, MIN_VERSION))}")
  return Status(True, version, "")


def _release(version: str) -> tuple[int, ...]:
  """(major, minor) of a version string such as '2.20.2+cu13' or '2.21.0.dev0'."""
  parts = []
  for piece in version.split(".")[:2]:
    digits = "".join(c for c in piece if c.isdigit()) if piece[:1].isdigit() else ""
    parts.append(int(digits or 0))
  return tuple(parts)


def nccl_version() -> tuple[int, int, int] | None:
  """The NCCL this process would load (libnccl.so.2), None where there is none."""
  import ctypes  # pylint: disable=import-outside-toplevel

  try:
    lib = ctypes.CDLL("libnccl.so.2")
  except OSError:
    return None
  code = ctypes.c_int()
  if lib.ncclGetVersion(ctypes.byref(code)) != 0:
    return None
  v = code.value  # NCCL_VERSION_CODE: major * 10000 + minor * 100 + patch since 2.9
  return v // 10000, (v // 100) % 100, v % 100


def compute_capability() -> tuple[int, int] | None:
  """The first local GPU's (major, minor), None off CUDA."""
  device = jax.local_devices()[0]
  cc = getattr(device, "compute_capability", None)
  if device.platform != "gpu" or not cc:
    return None
  major, _, minor = str(cc).partition(".")
  return int(major), int(minor or 0)


def dotted(version: tuple[int, ...] | None) -> str:
  """(2, 30, 4) -> '2.30.4'; None -> 'none'."""
  return ".".join(map(str, version)) if version else "none"


def ep_unready_reasons() -> list[str]:
  """Why TE's NCCL EP cannot serve this job ([] when it can): TE, SM90+, NCCL >= 2.30.4, one GPU per
  process, at least two processes."""
  reasons = []
  if not status().available:
    reasons.append(f"Transformer Engine does not import ({status().reason})")
  cc = compute_capability()
  if cc is None or cc < (9, 0):
    reasons.append(f"needs a GPU of compute capability 9.0+ (Hopper), found {dotted(cc)}")
  nccl = nccl_version()
  if nccl is None or nccl < MIN_NCCL:
    reasons.append(f"needs NCCL >= {dotted(MIN_NCCL)}, found {dotted(nccl)}")
  if jax.local_device_count() != 1:
    reasons.append(f"needs one GPU per process, this process has {jax.local_device_count()} devices")
  if jax.process_count() < 2:
    reasons.append(f"needs at least 2 processes, the job has {jax.process_count()}")
  return reasons


def _scaling_mode(quantization: str) -> Any:
  """TE's ScalingMode for our `fp8` (current per-tensor scaling) or `mxfp8` (E8M0 scales per 32 values)."""
  from transformer_engine.jax.quantize import scaling_modes  # pylint: disable=import-outside-toplevel

  if quantization == "mxfp8":
    return scaling_modes.ScalingMode.MXFP8_1D_SCALING
  return scaling_modes.ScalingMode.CURRENT_TENSOR_SCALING


def scaling_mode_supported(quantization: str) -> tuple[bool, str]:
  """Whether this GPU runs TE's `fp8` or `mxfp8` grouped GEMM, and TE's reason where not."""
  from transformer_engine.jax.quantize import helper  # pylint: disable=import-outside-toplevel

  return helper.is_scaling_mode_supported(scaling_mode=_scaling_mode(quantization))


def _quantizer_set(quantization: str, num_groups: int) -> Any:
  from transformer_engine.jax import dense  # pylint: disable=import-outside-toplevel
  from transformer_engine.jax.quantize import quantizer  # pylint: disable=import-outside-toplevel

  if quantization == "none":
    return dense.noop_quantizer_set
  return quantizer.QuantizerFactory.create_set(
    scaling_mode=_scaling_mode(quantization),
    fwd_dtype=jnp.float8_e4m3fn,
    bwd_dtype=jnp.float8_e5m2,
    is_2x2x=True,
    n_groups=num_groups,
  )


def grouped_dense(rows_RD: jax.Array, w_EDF: jax.Array, group_sizes_E: jax.Array, *, quantization: str) -> jax.Array:
  """out[r] = rows[r] @ w[e(r)] by TE's grouped GEMM; rows past sum(group_sizes) give zeros and take no
  gradient (TE leaves them uninitialised). Call per shard."""
  from transformer_engine.jax import dense  # pylint: disable=import-outside-toplevel

  real_R1 = (jnp.arange(rows_RD.shape[0]) < jnp.sum(group_sizes_E))[:, None]
  out = dense.grouped_dense(
    jnp.where(real_R1, rows_RD, 0),
    w_EDF,
    group_sizes_E.astype(jnp.int32),
    contracting_dims=((1,), (1,)),
    preferred_element_type=rows_RD.dtype,
    quantizer_set=_quantizer_set(quantization, w_EDF.shape[0]),
  )
  return jnp.where(real_R1, out, 0).astype(rows_RD.dtype)


def recv_capacity(*, num_experts: int, top_k: int, tokens_per_rank: int, ep_size: int, factor: float) -> int:
  """Rows one rank receives per call, by TE's own sizing: its dropless worst case for factor <= 0, else
  `factor` times balanced routing's need (>= 1), 128-aligned per local expert."""
  from transformer_engine.jax import moe  # pylint: disable=import-outside-toplevel

  return moe.get_moe_recv_capacity_per_rank(
    num_experts=num_experts,
    num_experts_per_tok=top_k,
    max_tokens_per_rank=tokens_per_rank,
    ep_size=ep_size,
    recv_capacity_factor=None if factor <= 0 else factor,
  )


def shard_guard(axes: tuple[str, str, str]) -> Any:
  """TE's mesh resources named as MaxText names its axes (MaxText enters the same guard for its GPU runs):
  TE EP reads them when the step is traced, its backward included. A null context where TE is absent."""
  if not status().available:
    return contextlib.nullcontext()
  from transformer_engine.jax import sharding  # pylint: disable=import-outside-toplevel

  return sharding.global_shard_guard(_mesh_resource(axes))


def _mesh_resource(axes: tuple[str, str, str]) -> Any:
  """TE's MeshResource from the mesh's (data, fsdp, expert) axis names."""
  from transformer_engine.jax import sharding  # pylint: disable=import-outside-toplevel

  data, fsdp, expert = axes
  return sharding.MeshResource(dp_resource=data, fsdp_resource=fsdp, ep_resource=expert)


_BOOTSTRAPPED: dict[str, tuple] = {}  # TE EP's communicator is per process: the signature it was built with


def bootstrapped_capacity() -> int:
  """The receive capacity TE EP was bootstrapped with in this process (0: not bootstrapped)."""
  return _BOOTSTRAPPED["ep"][2] if "ep" in _BOOTSTRAPPED else 0


def bootstrap(
  mesh: Any,
  *,
  axes: tuple[str, str, str],
  num_experts: int,
  tokens_per_rank: int,
  capacity: int,
  hidden_dim: int,
  drop: bool,
) -> None:
  """ep_bootstrap, once per process (again only with the same sizes), inside `mesh` and a shard guard
  naming MaxText's axes."""
  from transformer_engine.jax import ep, sharding  # pylint: disable=import-outside-toplevel

  signature = (num_experts, tokens_per_rank, capacity, hidden_dim, drop)
  if _BOOTSTRAPPED.get("ep") == signature:
    return
  if "ep" in _BOOTSTRAPPED:
    raise RuntimeError(f"TE EP was bootstrapped with {_BOOTSTRAPPED['ep']}; this run needs {signature}")
  with jax.set_mesh(mesh), sharding.global_shard_guard(_mesh_resource(axes)):
    ep.ep_bootstrap(
      world_size=None,
      rank=None,
      num_experts=num_experts,
      max_tokens_per_rank=tokens_per_rank,
      recv_capacity_per_rank=capacity,
      hidden_dim=hidden_dim,
      max_token_dtype=jnp.bfloat16,
      drop_on_overflow=drop,
    )
  _BOOTSTRAPPED["ep"] = signature


def forget_bootstrap() -> None:
  """Forgets this process's TE EP bootstrap (after a compile's stand-in for it: `upstream.te_target`)."""
  _BOOTSTRAPPED.clear()


def ep_dispatch(x_TD: jax.Array, ids_TK: jax.Array, weights_TK: jax.Array, *, capacity: int) -> tuple:
  """TE EP dispatch of global [T, D] tokens (leading dim sharded over (data, fsdp, expert)): (recv rows
  [ranks, capacity, D] grouped by local expert in 128-row blocks, their weights [ranks, capacity],
  per-rank local expert counts [ranks, E_l], the handle for combine, rows each rank was sent [ranks, 1])."""
  from transformer_engine.jax import ep  # pylint: disable=import-outside-toplevel

  cfg = ep.EpLayerConfig(top_k=ids_TK.shape[-1], dispatch_output_per_expert_alignment=EP_ALIGNMENT)
  recv_x, recv_w, handle, counts, total = ep.ep_dispatch(
    cfg, ids_TK.astype(jnp.int32), x_TD.astype(jnp.bfloat16), weights_TK.astype(jnp.float32), capacity
  )
  return recv_x, recv_w, counts, (cfg, handle), total


def ep_combine(weighted_out: jax.Array, counts: jax.Array, handle: tuple, *, num_tokens: int) -> jax.Array:
  """TE EP combine: each token's sum of its (already weighted) expert rows, [T, D]."""
  from transformer_engine.jax import ep  # pylint: disable=import-outside-toplevel

  cfg, handle_mem = handle
  return ep.ep_combine(cfg, handle_mem, counts, weighted_out.astype(jnp.bfloat16), num_tokens)
