"""Rows TE's NCCL EP receives per rank per call: its receive buffer, which is also the grouped GEMM's input.

TE sizes it in `transformer_engine.jax.moe.get_moe_recv_capacity_per_rank` (TE 2.20.2), which the run
itself calls (`upstream.te.calls.recv_capacity`). The planner and the step-time model need the same number where
TE cannot be imported (no CUDA: `import transformer_engine` raises), so it is written out here, in TE's
terms; tests/test_fp8_container_program.py compares the two in the TE compile environment.

- Dropless (no factor): the worst case, every token of the EP group routed here, its top-k (at most the
  local experts) assignments each padded to a 128-row block per local expert: the smaller of
  `round_up(assignments + 127 x min(E_l, assignments), 128)` and `E_l x round_up(P x T, 128)`.
- With a factor F >= 1: F times balanced routing's need (`E_l x round_up(ceil(T x K / E_l), 128)`),
  rounded up to 128 rows, at most the worst case.
"""

import math

ALIGNMENT = 128  # rows per local expert block (NCCL EP's high-throughput requirement)


def _up(n: int) -> int:
  return -(-n // ALIGNMENT) * ALIGNMENT


def te_ep_capacity(*, num_tokens: int, top_k: int, num_ranks: int, num_experts: int, factor: float = 0.0) -> int:
  """Receive rows per rank for `num_tokens` tokens per rank (see the module docstring); factor <= 0:
  dropless."""
  local = num_experts // num_ranks
  group_tokens = num_ranks * num_tokens
  assignments = group_tokens * min(top_k, local)
  worst = min(local * _up(group_tokens), _up(assignments + (ALIGNMENT - 1) * min(local, assignments)))
  if factor <= 0:
    return worst
  balanced = local * _up(-(-num_tokens * top_k // local))
  return min(_up(math.ceil(balanced * factor)), worst)
