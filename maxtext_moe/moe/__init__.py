"""Dropless MoE math in pure JAX, importable without MaxText (so it can be benchmarked on a bare JAX install).

  settings.py     the enums behind `moe_dispatch`/`moe_gemm_backend`, MoESettings, and every rule about them
  permute.py      index math: sort by expert, inverse permutation, per-rank dedup, send/receive packing
  gemm.py         `grouped_matmul`, the one grouped-GEMM call site, and its backends
  collectives.py  the collectives handed to the dispatchers (all_to_all, ragged offsets, a ragged reference)
  dispatch.py     the `Dispatcher` contract: local, all_to_all, ragged_all_to_all
  block.py        `routed_experts` (dispatch -> experts -> combine) and `moe_block` (the same under shard_map)
  stats.py        per-step stats by name, from the jitted step to the run's metrics
  layout.py       a config's parallelism layout as the block reads it: mesh degrees, EP, its nodes, the dispatch

Shape legend used across this package: T tokens, K top-k, R = T*K routed rows, D model dim,
F expert hidden dim, E experts, P ranks, M window rows.
"""
