"""Dropless MoE math in pure JAX: permutation index math and grouped GEMM backends.

Imports and runs without maxtext, so it can be benchmarked on a bare JAX install.

Shape legend used across this package: T tokens, K top-k, R = T*K routed rows, D model dim,
F expert hidden dim, E experts, N tiles, M tile rows.
"""
