"""The collectives the expert-parallel dispatchers are given, and the offset math of the ragged one.

- `all_to_all`: rank p's block q of rows goes to rank q's block p (`jax.lax.all_to_all`, tiled), over the
  whole axis or inside groups of it.
- `ragged_offsets`: where each rank's slices start and land, from the [P, P] matrix of row counts.
- `ragged_all_to_all_reference`: the semantics of `jax.lax.ragged_all_to_all`, built from `all_gather`.

Why the reference is hand-written: XLA:CPU does not implement the ragged-all-to-all HLO
(docs/design-facts.md: "UNIMPLEMENTED: HLO opcode `ragged-all-to-all` is not supported by XLA:CPU"), so
the ragged exchange's offset math could not otherwise run on CPU fake devices. This stand-in follows the
documented contract of the real op (same arguments, same result) and lets tests drive the ragged
dispatchers with real expert parallelism on CPU. It gathers every rank's whole operand, so it moves P
times the data: a test and debugging aid, never the production path (the dispatchers default to
`jax.lax.ragged_all_to_all`).

Shape legend: N operand rows, M output rows, P ranks (the mapped axis), G = P * slices per rank.
"""

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import custom_batching

Groups = tuple[tuple[int, ...], ...] | None  # axis_index_groups: indices along one mesh axis, hashable


def all_to_all(x_ND: jax.Array, *, axis_name: str, groups: Groups = None) -> jax.Array:
  """Splits rows into P equal blocks and sends block q to rank q; returns the blocks received, in rank
  order. Call inside shard_map over `axis_name`. `groups` (`jax.lax`'s axis_index_groups): the ranks of
  the axis split into groups of P that exchange among themselves, a rank's q-th peer the q-th of its
  group (the two levels of an exchange across nodes, `moe.levels`); None: the whole axis is one group."""
  if groups is None:
    return jax.lax.all_to_all(x_ND, axis_name, 0, 0, tiled=True)
  return _grouped_exchange(axis_name, groups)(x_ND)


@functools.cache
def _grouped_exchange(axis_name: str, groups: tuple[tuple[int, ...], ...]) -> Callable:
  """`jax.lax.all_to_all` inside `groups`, under a `vmap` too. Why hand-written: JAX 0.12 batches no
  all_to_all with `axis_index_groups` ("Please open a feature request!"), even when the mapped axis is not
  the collective's, as under MaxText's pipeline stages (`vmap(spmd_axis_name="stage")`). Mapped, the same
  exchange runs on the stacked rows, split and joined one axis further in (`custom_batching.custom_vmap`);
  its transpose is itself (`custom_vjp`), so the backward is mapped the same way."""
  index_groups = [list(g) for g in groups]

  def exchange(x, axis: int = 0):
    return jax.lax.all_to_all(x, axis_name, axis, axis, tiled=True, axis_index_groups=index_groups)

  @custom_batching.custom_vmap
  def mapped(x):
    return exchange(x)

  @mapped.def_vmap
  def _mapped_rule(axis_size, in_batched, x):  # the mapped axis first, the rows after it
    del axis_size
    return (exchange(x, axis=1), True) if in_batched[0] else (mapped(x), False)

  @jax.custom_vjp
  def grouped(x):
    return mapped(x)

  grouped.defvjp(lambda x: (mapped(x), None), lambda _, ct: (mapped(ct),))
  return grouped


def all_gather_dims(x: jax.Array, gathers: tuple[tuple[int, tuple[str, ...]], ...]) -> jax.Array:
  """`x` all-gathered (tiled) along each (dimension, mesh axes) of `gathers` in turn, inside shard_map."""
  for dim, axes in gathers:
    x = jax.lax.all_gather(x, axes if len(axes) > 1 else axes[0], axis=dim, tiled=True)
  return x


def ragged_offsets(sizes_PP: jax.Array, me: jax.Array, *, back: bool) -> tuple[jax.Array, ...]:
  """(input_offsets, send_sizes, output_offsets, recv_sizes) of rank `me` for `jax.lax.ragged_all_to_all`,
  where sizes_PP[q, p] rows go from rank q to rank p, packed by destination on the sender and by source on
  the receiver. back=True: the same slices retrace their path.

  Example: sizes_PP = [[1, 2], [3, 4]], me = 1, back=False
    -> input_offsets [0, 3], send_sizes [3, 4], output_offsets [1, 2], recv_sizes [2, 4]
    (rank 1's 3 rows for rank 0 land after rank 0's own 1 row there).
  """
  send_off_PP = jnp.cumsum(sizes_PP, axis=1) - sizes_PP  # [q, p]: where q's slice for p starts on q
  recv_off_PP = jnp.cumsum(sizes_PP, axis=0) - sizes_PP  # [q, p]: where q's slice lands on p
  if not back:
    args = (send_off_PP[me], sizes_PP[me], recv_off_PP[me], sizes_PP[:, me])
  else:
    args = (recv_off_PP[:, me], sizes_PP[:, me], send_off_PP[:, me], sizes_PP[me])
  return tuple(a.astype(jnp.int32) for a in args)


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


@functools.cache
def has_ragged_all_to_all() -> bool:
  """Whether this backend compiles `jax.lax.ragged_all_to_all` (XLA:CPU does not), tried on one device."""
  import numpy as np  # pylint: disable=import-outside-toplevel
  from jax.sharding import Mesh  # pylint: disable=import-outside-toplevel
  from jax.sharding import PartitionSpec as P  # pylint: disable=import-outside-toplevel

  def exchange(x):
    zero, rows = jnp.zeros((1,), jnp.int32), jnp.full((1,), x.shape[0], jnp.int32)
    return jax.lax.ragged_all_to_all(x, jnp.zeros_like(x), zero, rows, zero, rows, axis_name="probe")

  mesh = Mesh(np.array(jax.local_devices()[:1]), ("probe",))
  fn = jax.jit(jax.shard_map(exchange, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False))
  try:
    fn.lower(jax.ShapeDtypeStruct((8, 2), jnp.float32)).compile()
  except Exception:  # pylint: disable=broad-except  # XlaRuntimeError (UNIMPLEMENTED) where the HLO is missing
    return False
  return True
