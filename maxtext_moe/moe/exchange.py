"""One trip of expert-parallel rows to their ranks and back: the exchange every EP dispatcher is built on.

An `Exchange` moves the (token, rank) rows that a dispatcher chose (`sent_TP`, each at its `slot_TP` among
the rows for that rank) to their ranks, and the ranks' results back, inside shard_map over `axis`:

- `there`: packs each chosen row once per destination rank (`permute.pack_for_ranks`: the token, its top-k
  ids as that rank's local ids, its weights) and exchanges the buffers; returns the received rows and a
  `Trip` that remembers where each row went. Per token only its at most top-k destinations are laid out
  (`permute.compact_ranks`), never all P ranks: at EP=64 a [T, P, D] layout took 7 GiB per GB300.
- `back`: sends each received row's result to where it came from and sums each token's results over the
  ranks it was sent to (`permute.gather_returned`).

Two layouts, one contract. Padded (`jax.lax.all_to_all`): rank p's rows sit at [p x rows, (p + 1) x rows)
of a [P x rows] buffer, so the wire carries the padding. Ragged (`jax.lax.ragged_all_to_all`, or its
reference where XLA lacks it): rows are packed by rank and only real ones travel; all ranks share the
[P, P] matrix of row counts, from which each derives its slices' offsets (`collectives.ragged_offsets`).

Shape legend: T tokens, K top-k, D model dim, P ranks, N send rows, S received rows.
"""

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from maxtext_moe.moe import collectives, levels, permute


@jax.tree_util.register_dataclass
@dataclass(frozen=True)
class Trip:
  """Where the rows of one exchange went, for the way back."""

  sent_TP: jax.Array  # token t went to rank p
  dest_TJ: jax.Array  # the send rows of its J <= top-k destinations (`permute.compact_ranks`; N where none)
  sizes_PP: jax.Array | None  # ragged: rows rank q sent rank p, [q, p]


@dataclass(frozen=True)
class Exchange:
  """The rows of P = `num_ranks` ranks over mesh axis `axis`; experts split evenly, `local_experts` each.
  `groups`: the axis's ranks in groups of P that exchange among themselves (padded only; `moe.levels`:
  the network and NVLink levels of an exchange across nodes); None: the whole axis, P ranks."""

  axis: str
  num_ranks: int
  local_experts: int
  ragged: bool = False
  collective: Callable = collectives.all_to_all  # ragged: jax.lax.ragged_all_to_all or its reference
  groups: collectives.Groups = None

  def __post_init__(self) -> None:
    if self.ragged and self.groups is not None:
      raise ValueError("the ragged exchange runs over a whole mesh axis; exchanges in groups are padded (all_to_all)")

  def _padded(self, x: jax.Array) -> jax.Array:
    if self.groups is None:
      return self.collective(x, axis_name=self.axis)
    return self.collective(x, axis_name=self.axis, groups=self.groups)

  def destinations(self, sent_TP: jax.Array, slot_TP: jax.Array, *, send_rows: int) -> jax.Array:
    """Row of the N = `send_rows` send buffer that each sent (token, rank) row takes: padded, p x (N / P)
    + slot; ragged, packed by rank (the rows for ranks < p first) + slot. N where not sent.

    Example: sent_TP = [[1, 1], [0, 1]], slot_TP = [[0, 0], [0, 1]], send_rows=4
      -> padded [[0, 2], [4, 3]]; ragged [[0, 1], [4, 2]].
    """
    if self.ragged:
      send_P = jnp.sum(sent_TP, axis=0, dtype=jnp.int32)
      first_P = jnp.cumsum(send_P) - send_P
    else:
      first_P = jnp.arange(self.num_ranks) * (send_rows // self.num_ranks)
    return jnp.where(sent_TP, first_P[None, :] + slot_TP, send_rows)

  def there(
    self, x_TD, ids_TK, weights_TK, sent_TP, slot_TP, *, send_rows: int, recv_rows: int
  ) -> tuple[tuple[jax.Array, jax.Array, jax.Array], Trip]:
    """((recv_x_SD, recv_ids_SK, recv_w_SK), trip): the chosen rows, received. Empty received rows have
    zero features and weights and the local id `local_experts` ("no expert here")."""
    dest_TP = self.destinations(sent_TP, slot_TP, send_rows=send_rows)
    rank_TJ, dest_TJ = permute.compact_ranks(dest_TP, num_rows=send_rows, max_ranks=ids_TK.shape[1])
    send = permute.pack_for_ranks(
      x_TD, ids_TK, weights_TK, dest_TJ, num_rows=send_rows, experts_per_rank=self.local_experts, rank_TJ=rank_TJ
    )
    if not self.ragged:
      return self._padded_together(*send), Trip(sent_TP, dest_TJ, None)
    sizes_PP = jax.lax.all_gather(jnp.sum(sent_TP, axis=0, dtype=jnp.int32), self.axis)
    empty = permute.empty_rows(recv_rows, *send, experts_per_rank=self.local_experts)
    recv = tuple(self._ragged(a, out, sizes_PP, back=False) for a, out in zip(send, empty, strict=True))
    return recv, Trip(sent_TP, dest_TJ, sizes_PP)

  def _padded_together(self, x_ND: jax.Array, ids_NK: jax.Array, w_NK: jax.Array) -> tuple[jax.Array, ...]:
    """The rows' features, weights and ids in one padded collective, not three: the ids as numbers in the
    features' dtype, exact while they stay below 2^(mantissa bits + 1) (256 in bf16: ids are local expert ids,
    at most `local_experts`), never as bit patterns (small ints are subnormal floats, which XLA may flush).
    One launch instead of three, and no small collectives between the large ones for XLA's scheduler to
    order (it runs one at a time beside the GEMMs). Otherwise (other dtypes, more local experts) three."""
    exact = 2 ** (jnp.finfo(x_ND.dtype).nmant + 1) if jnp.issubdtype(x_ND.dtype, jnp.floating) else 0
    if w_NK.dtype != x_ND.dtype or self.local_experts > exact:
      return tuple(self._padded(a) for a in (x_ND, ids_NK, w_NK))
    d, k = x_ND.shape[1], ids_NK.shape[1]
    ids_as = jax.lax.stop_gradient(ids_NK.astype(x_ND.dtype))
    out = self._padded(jnp.concatenate([x_ND, w_NK, ids_as], axis=1))
    ids_out = jnp.round(out[:, d + k :].astype(jnp.float32)).astype(jnp.int32)
    return out[:, :d], ids_out, out[:, d : d + k]

  def back(self, partial_SD: jax.Array, trip: Trip, *, send_rows: int) -> jax.Array:
    """y_TD: each token's results summed over the ranks it was sent to."""
    if self.ragged:
      output = jnp.zeros((send_rows, partial_SD.shape[1]), partial_SD.dtype)
      back_ND = self._ragged(partial_SD, output, trip.sizes_PP, back=True)
    else:
      back_ND = self._padded(partial_SD)
    # A column not sent holds send_rows, one past back's rows, where the gather reads zeros.
    assert back_ND.shape[0] == send_rows, (back_ND.shape, send_rows)
    return permute.gather_returned(back_ND, trip.dest_TJ)

  def _ragged(self, operand, output, sizes_PP, *, back: bool) -> jax.Array:
    offsets = collectives.ragged_offsets(sizes_PP, jax.lax.axis_index(self.axis), back=back)
    return self.collective(operand, output, *offsets, axis_name=self.axis)


def for_levels(axis: str, *, num_experts: int, ranks: int, nodes: int) -> tuple[Exchange, ...]:
  """The padded exchanges of expert parallelism over `ranks` ranks of `axis` on `nodes` nodes: one over
  the whole axis on one node, else the network level's then the NVLink level's (`moe.levels`)."""
  if nodes <= 1:
    return (Exchange(axis, ranks, num_experts // ranks),)
  per_node = ranks // nodes
  return (
    Exchange(axis, nodes, num_experts // nodes, groups=levels.network_groups(nodes, per_node)),
    Exchange(axis, per_node, num_experts // ranks, groups=levels.nvlink_groups(nodes, per_node)),
  )
