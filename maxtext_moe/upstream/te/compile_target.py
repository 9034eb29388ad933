"""Transformer Engine answered for a GPU that is not there: the stand-ins `maxtext-moe compile` needs in a
process that compiles TE's kernels for a target (`.venv-te`, `gpu_compile.te_libraries` loads the
libraries first). Nothing else enters these contexts; `train` never does. Checked with calls.py against
manifest.json (tests/test_te_contract.py).

- `for_target(sm)`: TE's C++ `get_device_compute_capability` answers the target's SM (90 for Hopper, 100
  for Blackwell) in every TE module that imported it by name, and TE's cached answers are cleared, while
  the context is open. TE picks its GEMM path and workspace size from it.
- `ep_for_target(handle_size)`: TE's NCCL EP bootstrapped without NCCL. `ep_bootstrap` creates NCCL
  communicators (a device and its peers); of what it leaves behind, tracing reads the Python-side
  `EpConfig` (the group's sizes: dispatch and combine shape their outputs from it) and, in
  `EpPreparePrimitive.abstract`, the handle size the live group answers
  (`transformer_engine_jax.ep_handle_mem_size`); XLA:GPU runs the custom calls' instantiation handler
  while it compiles, which acquires the communicator unless the group was bootstrapped to borrow XLA's.
  While the context is open, `ep.ep_bootstrap` sets that `EpConfig` as TE's own does, records TE's
  bootstrap parameters in the borrowed-communicator mode (TE's own `set_ep_bootstrap_params(...,
  borrowed_comm=True)`: nothing is connected, and instantiation asks for nothing), and the handle size is
  `handle_size(config, top_k)` (`gpu_compile.nccl_ep`). The custom calls (`te_ep_prepare_ffi`,
  `te_ep_dispatch_ffi`, `te_ep_combine_ffi` and their backward) are compiled as the container runs them.
"""

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

from maxtext_moe.upstream.te import calls as te


@contextlib.contextmanager
def for_target(sm: int) -> Iterator[None]:
  """TE answers `sm` (major x 10 + minor) for the GPU's compute capability while the context is open (TE's
  C++ query, imported by name into several of its modules, is replaced in each)."""
  import transformer_engine.jax  # noqa: F401  # pylint: disable=import-outside-toplevel,unused-import
  import transformer_engine_jax  # pylint: disable=import-outside-toplevel
  from transformer_engine.jax.quantize import device_utils  # pylint: disable=import-outside-toplevel

  real = transformer_engine_jax.get_device_compute_capability

  def target(gpu_id: int = 0) -> int:
    del gpu_id
    return sm

  modules = [m for n, m in list(sys.modules.items()) if n.startswith("transformer_engine") and m is not None]
  patched = [m for m in modules if getattr(m, "get_device_compute_capability", None) is real]
  cached = (device_utils.get_device_compute_capability, device_utils.is_fp8_gemm_with_all_layouts_supported)
  for module in patched:
    module.get_device_compute_capability = target
  for f in cached:
    f.cache_clear()
  try:
    yield
  finally:
    for module in patched:
      module.get_device_compute_capability = real
    for f in cached:
      f.cache_clear()


def _config(num_experts: int, max_tokens_per_rank: int, recv_capacity_per_rank: int, hidden_dim: int) -> Any:
  """TE's EpConfig as its ep_bootstrap builds it, from the active mesh and shard guard (rank 0's)."""
  from transformer_engine.jax import sharding  # pylint: disable=import-outside-toplevel
  from transformer_engine.jax.cpp_extensions import ep as tex_ep  # pylint: disable=import-outside-toplevel

  ep_size = sharding.get_mesh_axis_size(sharding.global_mesh_resource().ep_resource)
  outer = tex_ep._ep_outer_axis()  # pylint: disable=protected-access  # as ep_bootstrap counts EP groups
  return tex_ep.EpConfig(
    world_size=sharding.get_num_devices_in_mesh(),
    rank=0,
    ep_size=ep_size,
    num_ep_groups=1 if outer is None else sharding.get_mesh_axis_size(outer),
    num_experts=num_experts,
    num_local_experts=num_experts // ep_size,
    max_tokens_per_rank=max_tokens_per_rank,
    recv_capacity_per_rank=recv_capacity_per_rank,
    hidden_dim=hidden_dim,
  )


@contextlib.contextmanager
def ep_for_target(handle_size: Callable[[Any, int], int]) -> Iterator[None]:
  """TE's NCCL EP bootstrapped without NCCL while the context is open (module docstring); `handle_size(
  config, top_k)` answers the dispatch handle's bytes for TE's EpConfig."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  import transformer_engine_jax  # pylint: disable=import-outside-toplevel
  from transformer_engine.jax import ep  # pylint: disable=import-outside-toplevel
  from transformer_engine.jax.cpp_extensions import ep as tex_ep  # pylint: disable=import-outside-toplevel
  from transformer_engine.jax.cpp_extensions import misc  # pylint: disable=import-outside-toplevel

  real_bootstrap, real_size = ep.ep_bootstrap, transformer_engine_jax.ep_handle_mem_size

  def bootstrap(world_size, rank, num_experts, max_tokens_per_rank, recv_capacity_per_rank, hidden_dim, **kw):
    del world_size, rank  # the mesh's, as TE reads them
    config = _config(num_experts, max_tokens_per_rank, recv_capacity_per_rank, hidden_dim)
    transformer_engine_jax.set_ep_bootstrap_params(
      bytes(128),  # no NCCL unique id: nothing connects
      config.ep_size,
      0,
      num_experts,
      max_tokens_per_rank,
      recv_capacity_per_rank,
      hidden_dim,
      max_num_sms=0,
      max_token_dtype=int(misc.jax_dtype_to_te_dtype(jnp.bfloat16)),
      drop_on_overflow=bool(kw.get("drop_on_overflow", False)),
      borrowed_comm=True,  # its parameters recorded, no communicator: XLA's instantiation asks for none
    )
    tex_ep.set_ep_config(config)

  def size(top_k: int, dispatch_output_per_expert_alignment: int = 0) -> int:
    del dispatch_output_per_expert_alignment  # NCCL EP's handle does not depend on it
    return handle_size(tex_ep.get_ep_config(), int(top_k))

  ep.ep_bootstrap, transformer_engine_jax.ep_handle_mem_size = bootstrap, size
  try:
    yield
  finally:
    ep.ep_bootstrap, transformer_engine_jax.ep_handle_mem_size = real_bootstrap, real_size
    transformer_engine_jax.release_ep_resources()
    tex_ep.reset_ep_config()
    te.forget_bootstrap()
