"""Per-step MoE statistics, from inside the jitted step to the host, by name.

Inside the step each MoE layer records the block's stats (`moe_block`'s `stats`: per-device-summed
scalars and the [E] expert load) under `INTERMEDIATE_PREFIX + name`; `reduce_layers` folds the layers
into one dict (scalars summed, loads stacked [L, E]) that a `jax.debug.callback` hands to the run's
`StatsChannel`. The metrics hook drains one entry per micro-batch for each logged step and turns them
into the `moe/*` scalars of metrics.jsonl (`step_metrics`) and the step's per-layer picture
(`step_layers`: [L, E] assignments per expert, [L] mean |routing bias|).
"""

import collections
import dataclasses
import threading
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

INTERMEDIATE_PREFIX = "moe_plugin_"
SCALARS = ("dropped", "rows_sent", "rows_sent_no_dedup", "buffer_rows", "rows_sent_network")
# Bounded-memory EP (moe.rounds): the largest over devices and layers; and across nodes (moe.levels) the
# most nodes any one token was sent to.
MAX_STATS = ("rounds", "load_over_budget", "nodes_per_token")
LOAD = "load"
BIAS = "bias_abs_mean"  # per layer: mean |routing bias| (recorded by the MaxText seam, not the block)
NAMES = (*SCALARS, *MAX_STATS, LOAD, BIAS)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DispatchStats:
  """What a dispatcher reports of one call, float32 scalars: rows delivered to the experts' ranks with and
  without per-rank dedup, rows of its receive buffers, dropped (token, expert) assignments (0 when
  dropless), for bounded-memory EP the rounds run and the largest load over one round's budget, and
  across nodes the rows that crossed the network (to another node) and the most nodes one token reached.
  Per device inside shard_map until `over_devices` adds the counts up (and takes the largest of the rest)."""

  rows_sent: jax.Array
  rows_sent_no_dedup: jax.Array
  buffer_rows: jax.Array
  dropped: jax.Array
  rounds: jax.Array
  load_over_budget: jax.Array
  rows_sent_network: jax.Array
  nodes_per_token: jax.Array

  @classmethod
  def of(
    cls,
    *,
    rows_sent,
    rows_sent_no_dedup,
    buffer_rows,
    dropped=0,
    rounds=1,
    load_over_budget=0,
    rows_sent_network=0,
    nodes_per_token=0,
  ) -> "DispatchStats":
    """Stats from numbers or arrays: one round, no budget and nothing across nodes unless given."""
    values = dict(rows_sent=rows_sent, rows_sent_no_dedup=rows_sent_no_dedup, buffer_rows=buffer_rows, dropped=dropped)
    values |= dict(rounds=rounds, load_over_budget=load_over_budget)
    values |= dict(rows_sent_network=rows_sent_network, nodes_per_token=nodes_per_token)
    return cls(**{k: jnp.asarray(v).astype(jnp.float32) for k, v in values.items()})

  def over_devices(self, axes: tuple[str, ...]) -> "DispatchStats":
    """Inside shard_map: counts summed over `axes`, rounds and load the largest (already global)."""
    if not axes:
      return self
    reduce = {name: jax.lax.pmax if name in MAX_STATS else jax.lax.psum for name in (*SCALARS, *MAX_STATS)}
    return DispatchStats(**{k: reduce[k](v, axes) for k, v in self.as_dict().items()})

  def as_dict(self) -> dict[str, jax.Array]:
    return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}


class DroplessViolation(RuntimeError):
  """The dropless block dropped a token: a bug in this package, never a setting."""


class CapacityOverflow(RuntimeError):
  """A step routed more assignments than moe_capacity_factor leaves room for, and drops are not allowed."""


def reduce_layers(per_name: Mapping[str, list[jax.Array]]) -> dict[str, jax.Array]:
  """{name: [one leaf per layer group]} -> scalars summed over layers, `load` as [L, E] and the bias
  magnitude as [L] (any leaf layout: a scanned group's leaf holds all its layers)."""
  out = {name: sum(jnp.sum(leaf) for leaf in per_name[name]) for name in SCALARS}
  for name in MAX_STATS:
    if per_name.get(name):
      out[name] = jnp.max(jnp.stack([jnp.max(leaf) for leaf in per_name[name]]))
  loads = per_name[LOAD]
  num_experts = loads[0].shape[-1]
  out[LOAD] = jnp.concatenate([leaf.reshape(-1, num_experts) for leaf in loads])
  if per_name.get(BIAS):
    out[BIAS] = jnp.concatenate([leaf.reshape(-1) for leaf in per_name[BIAS]])
  return out


def load_max_over_mean(load_LE: np.ndarray) -> float:
  """The worst layer's max/mean expert load (1.0 is perfectly balanced)."""
  load_LE = np.asarray(load_LE, np.float64)
  return float(np.max(load_LE.max(axis=1) / np.maximum(load_LE.mean(axis=1), 1e-9)))


class StatsChannel:
  """A run's per-micro-batch MoE stats on their way from device callbacks to the metrics hook.

  `push` is called from JAX's callback thread, the drain methods from the training loop's."""

  def __init__(self) -> None:
    self._queue: collections.deque[dict[str, np.ndarray]] = collections.deque()
    self._lock = threading.Lock()

  def push(self, stats: Mapping[str, Any]) -> None:
    with self._lock:
      self._queue.append({k: np.asarray(v, np.float64) for k, v in stats.items()})

  def clear(self) -> None:
    with self._lock:
      self._queue.clear()

  def pop_step(self, micro_batches: int) -> list[dict[str, np.ndarray]]:
    """The oldest logged step's entries, one per micro-batch ([] when the block did not run)."""
    with self._lock:
      if len(self._queue) < micro_batches:
        return []
      return [self._queue.popleft() for _ in range(micro_batches)]


def step_metrics(
  entries: list[dict[str, np.ndarray]], *, row_bytes: int, capacity_factor: float, allow_drops: bool = False
) -> dict[str, float]:
  """The moe/* scalars of one step from its micro-batches' entries: counts summed, the load ratio the
  worst micro-batch's. Raises DroplessViolation when a dropless run (capacity_factor <= 0) dropped, and
  CapacityOverflow when a run with a capacity dropped without `allow_drops`."""
  if not entries:
    return {}
  total = {name: float(sum(e[name] for e in entries)) for name in SCALARS}
  if total["dropped"] and capacity_factor <= 0:
    raise DroplessViolation(
      f"the dropless MoE block dropped {total['dropped']:.0f} assignments; this is a bug, please report it"
    )
  if total["dropped"] and not allow_drops:
    raise CapacityOverflow(
      f"{total['dropped']:.0f} token-to-expert assignments did not fit moe_capacity_factor={capacity_factor}; "
      "raise it, set moe_capacity_factor=0 (dropless), or moe_allow_drops=true to drop and count them"
    )
  maxed = {f"moe/{name}": max(float(e[name]) for e in entries) for name in MAX_STATS if all(name in e for e in entries)}
  if not maxed.get("moe/nodes_per_token"):  # the exchange stays inside a node: nothing crosses the network
    maxed.pop("moe/nodes_per_token", None)
  else:
    maxed |= {
      "moe/dispatch_rows_network": total["rows_sent_network"],
      "moe/dispatch_bytes_network": total["rows_sent_network"] * row_bytes,
    }
  return maxed | {
    "moe/load_max_over_mean": max(load_max_over_mean(e[LOAD]) for e in entries),
    "moe/tokens_dropped": total["dropped"],
    "moe/dispatch_rows": total["rows_sent"],
    "moe/dispatch_rows_no_dedup": total["rows_sent_no_dedup"],
    "moe/dispatch_bytes": total["rows_sent"] * row_bytes,
    "moe/dispatch_bytes_no_dedup": total["rows_sent_no_dedup"] * row_bytes,
  }


def step_layers(entries: list[dict[str, np.ndarray]]) -> tuple[np.ndarray, np.ndarray] | None:
  """(the step's [L, E] assignments per expert, summed over micro-batches; the [L] mean |routing bias|
  after the step's last micro-batch), or None when the block did not run."""
  if not entries:
    return None
  load = sum(e[LOAD] for e in entries)
  bias = entries[-1].get(BIAS, np.zeros(load.shape[0]))
  return np.asarray(load), np.asarray(bias)
