"""`ragged_all_to_all_reference`: the semantics of `jax.lax.ragged_all_to_all`, built from `all_gather`.

Why hand-written: XLA:CPU does not implement the ragged-all-to-all HLO (DESIGN.md; "UNIMPLEMENTED: HLO
opcode `ragged-all-to-all` is not supported by XLA:CPU"), so the ragged dispatcher's offset math could
not otherwise run on CPU fake devices. This stand-in follows the documented contract of the real op
(same arguments, same result) and lets tests drive `RaggedAllToAllDispatcher` with real expert
parallelism on CPU. It gathers every rank's whole operand, so it moves P times the data: a test and
debugging aid, never the production path (the dispatcher defaults to `jax.lax.ragged_all_to_all`).

Shape legend: N operand rows, M output rows, P ranks (the mapped axis), G = P * slices per rank.
"""

import jax
import jax.numpy as jnp


def ragged_all_to_all_reference(
  operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name: str
) -> jax.Array:
  """Same contract as `jax.lax.ragged_all_to_all` (one slice per destination rank), call inside shard_map.

  Slice i of this rank's `operand` (rows input_offsets[i] .. + send_sizes[i]) lands on rank i at row
  output_offsets[i]; rows of `output` that nothing lands on keep their values. `recv_sizes` is checked
  by the real op's contract only and is unused here, as the senders' sizes say the same.
  """
  del recv_sizes
  num_ranks = jax.lax.axis_size(axis_name)
  if input_offsets.shape[0] != num_ranks:
    raise ValueError(
      f"ragged_all_to_all_reference supports one slice per rank ({num_ranks}), got {input_offsets.shape[0]}"
    )
  me = jax.lax.axis_index(axis_name)
  operands_PN = jax.lax.all_gather(operand, axis_name)
  # What each source q sends to me: where it starts in q's operand, how many rows, where it lands here.
  src_start_P, size_P, dst_start_P = (
    jax.lax.all_gather(a, axis_name)[:, me] for a in (input_offsets, send_sizes, output_offsets)
  )
  row_M = jnp.arange(output.shape[0])
  result = output
  for q in range(num_ranks):
    inside_M = (row_M >= dst_start_P[q]) & (row_M < dst_start_P[q] + size_P[q])
    src_row_M = jnp.clip(src_start_P[q] + row_M - dst_start_P[q], 0, operand.shape[0] - 1)
    mask = inside_M.reshape((-1,) + (1,) * (output.ndim - 1))
    result = jnp.where(mask, operands_PN[q][src_row_M], result)
  return result
