"""Per-step MoE block statistics, from inside the jitted train step to the metrics file.

Each MoE layer sows a small vector (`pack`); the wrapped loss_fn reduces the layers (`reduce_layers`)
and sends the result to the host with `jax.debug.callback` (`push`); the metric hook takes one entry
per micro-batch for each logged step (`pop_step`). Counts are summed over layers and micro-batches;
the load ratio is the worst layer's max/mean expert load.
"""

import collections
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

INTERMEDIATE = "moe_plugin_stats"
FIELDS = ("load_max", "load_mean", "dropped", "rows_sent", "rows_sent_no_dedup", "buffer_rows", "row_bytes")
_QUEUE: collections.deque = collections.deque()
_LOCK = threading.Lock()


def pack(stats: dict[str, jax.Array], *, itemsize: int, dim: int) -> jax.Array:
  """One layer's stats as a float32 vector in FIELDS order."""
  load = stats["load"]
  return jnp.stack(
    [
      jnp.max(load),
      jnp.mean(load),
      stats["dropped"],
      stats["rows_sent"],
      stats["rows_sent_no_dedup"],
      stats["buffer_rows"],
      jnp.float32(itemsize * dim),
    ]
  ).astype(jnp.float32)


def reduce_layers(found: list[jax.Array]) -> jax.Array:
  """[n_layers, len(FIELDS)] (any leaf layout) -> [5]: max load ratio, dropped, rows, rows no dedup, bytes/row."""
  v = jnp.concatenate([x.reshape(-1) for x in found]).reshape(-1, len(FIELDS))
  ratio = jnp.max(v[:, 0] / jnp.maximum(v[:, 1], 1e-9))
  return jnp.stack([ratio, v[:, 2].sum(), v[:, 3].sum(), v[:, 4].sum(), v[0, 6]])


def push(vec: Any) -> None:
  with _LOCK:
    _QUEUE.append(np.asarray(vec, np.float64))


def clear() -> None:
  with _LOCK:
    _QUEUE.clear()


def pop_step(config: Any) -> dict[str, float]:
  """The moe/* scalars of the oldest logged step ({} when the block did not run)."""
  n = max(int(getattr(config, "gradient_accumulation_steps", 1)), 1)
  with _LOCK:
    if len(_QUEUE) < n:
      return {}
    vecs = [_QUEUE.popleft() for _ in range(n)]
  ratio = max(v[0] for v in vecs)
  dropped, rows, rows_naive = (sum(v[i] for v in vecs) for i in (1, 2, 3))
  if dropped and float(getattr(config, "moe_capacity_factor", 0.0)) <= 0:
    raise RuntimeError(f"dropless MoE block dropped {dropped:.0f} assignments; this is a bug, please report it")
  row_bytes = vecs[0][4]
  return {
    "moe/load_max_over_mean": ratio,
    "moe/tokens_dropped": dropped,
    "moe/dispatch_rows": rows,
    "moe/dispatch_rows_no_dedup": rows_naive,
    "moe/dispatch_bytes": rows * row_bytes,
    "moe/dispatch_bytes_no_dedup": rows_naive * row_bytes,
  }
