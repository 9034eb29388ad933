"""The ragged_all_to_all stand-in against the worked example in jax.lax.ragged_all_to_all's docstring,
and the real op's absence on XLA:CPU (the reason the stand-in exists)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from maxtext_moe.moe.collectives import ragged_all_to_all_reference

# Per rank: operand, output, input_offsets, send_sizes, output_offsets, recv_sizes (JAX's example, axis size 2).
EXAMPLE = (
  [[1, 2, 2], [3, 4, 0]],
  [[0, 0, 0, 0], [0, 0, 0, 0]],
  [[0, 1], [0, 1]],
  [[1, 2], [1, 1]],
  [[0, 0], [1, 2]],
  [[1, 1], [2, 1]],
)
EXPECTED = [[1, 3, 0, 0], [2, 2, 4, 0]]


def _run(collective):
  mesh = Mesh(np.array(jax.devices()[:2]), ("x",))

  def per_rank(*args):
    return collective(*(a[0] for a in args), axis_name="x")[None]

  fn = jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
  args = [jax.device_put(jnp.array(a, jnp.int32), NamedSharding(mesh, P("x"))) for a in EXAMPLE]
  return fn(*args)


def test_reference_matches_the_documented_example():
  assert _run(ragged_all_to_all_reference).tolist() == EXPECTED


def test_unfilled_output_rows_keep_their_values():
  mesh = Mesh(np.array(jax.devices()[:2]), ("x",))

  def per_rank(x):
    zero = jnp.zeros((2,), jnp.int32)
    return ragged_all_to_all_reference(x[0], jnp.full((3,), 7), zero, zero, zero, zero, axis_name="x")[None]

  got = jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=P("x"), out_specs=P("x")))(jnp.ones((2, 3), jnp.int32))
  assert got.tolist() == [[7, 7, 7], [7, 7, 7]]


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="documents an XLA:CPU gap")
def test_xla_cpu_still_lacks_ragged_all_to_all():
  """When this starts failing, XLA:CPU gained the op: test the dispatcher with the real one instead."""
  with pytest.raises(Exception, match="ragged-all-to-all"):
    _run(jax.lax.ragged_all_to_all)


def test_ragged_offsets_worked_example():
  from maxtext_moe.moe.collectives import ragged_offsets

  sizes = jnp.array([[1, 2], [3, 4]])
  fwd = [a.tolist() for a in ragged_offsets(sizes, jnp.int32(1), back=False)]
  assert fwd == [[0, 3], [3, 4], [1, 2], [2, 4]]
  back = [a.tolist() for a in ragged_offsets(sizes, jnp.int32(1), back=True)]
  # Back: rank 1 returns what it received from q (at q's landing offset there) to where q sent it from.
  assert back == [[0, 2], [2, 4], [1, 3], [3, 4]]


def test_ragged_offsets_drive_the_reference_to_the_documented_example():
  """The offsets ragged_offsets derives from a [P, P] count matrix give the documented exchange."""
  from maxtext_moe.moe.collectives import ragged_offsets

  mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
  sizes = jnp.array([[1, 2], [1, 1]])  # rank 0 sends 1 row to itself and 2 to rank 1; rank 1 one to each

  def per_rank(x):
    offsets = ragged_offsets(sizes, jax.lax.axis_index("x"), back=False)
    return ragged_all_to_all_reference(x[0], jnp.zeros((4,), jnp.int32), *offsets, axis_name="x")[None]

  got = jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=P("x"), out_specs=P("x")))(jnp.array(EXAMPLE[0]))
  assert got.tolist() == EXPECTED
