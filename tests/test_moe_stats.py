"""Per-step MoE stats by name: layers reduced, micro-batches drained per step, the dropless guarantee."""

import jax.numpy as jnp
import numpy as np
import pytest

from maxtext_moe.moe import stats


def _layer_group(num_layers, load):
  """A scanned layer group's leaves: one value per layer."""
  return {
    "dropped": jnp.zeros((num_layers,)),
    "rows_sent": jnp.full((num_layers,), 10.0),
    "rows_sent_no_dedup": jnp.full((num_layers,), 16.0),
    "buffer_rows": jnp.full((num_layers,), 32.0),
    "load": jnp.asarray(load, jnp.float32),
    "bias_abs_mean": jnp.arange(num_layers, dtype=jnp.float32),
    "rounds": jnp.arange(num_layers, dtype=jnp.float32) + 1,
    "load_over_budget": jnp.full((num_layers,), 0.5),
    "rows_sent_network": jnp.full((num_layers,), 3.0),
    "nodes_per_token": jnp.arange(num_layers, dtype=jnp.float32) + 1,
  }


def test_reduce_layers_sums_scalars_and_stacks_loads_by_name():
  groups = [_layer_group(2, [[4, 0, 0, 0], [1, 1, 1, 1]]), _layer_group(1, [[2, 2, 0, 0]])]
  got = stats.reduce_layers({name: [g[name] for g in groups] for name in stats.NAMES})
  assert float(got["rows_sent"]) == 30.0 and float(got["rows_sent_no_dedup"]) == 48.0
  assert got["load"].shape == (3, 4)
  assert got["bias_abs_mean"].tolist() == [0.0, 1.0, 0.0]  # per layer, in layer order: not summed
  assert float(got["rounds"]) == 2.0 and float(got["load_over_budget"]) == 0.5  # the largest, not summed
  assert float(got["rows_sent_network"]) == 9.0 and float(got["nodes_per_token"]) == 2.0


def test_load_ratio_is_the_worst_layers():
  assert stats.load_max_over_mean(np.array([[1, 1, 1, 1], [4, 0, 0, 0]])) == 4.0


def test_channel_drains_one_entry_per_micro_batch_in_order():
  channel = stats.StatsChannel()
  for i in range(4):
    channel.push({"rows_sent": i})
  assert [e["rows_sent"] for e in channel.pop_step(2)] == [0, 1]
  assert [e["rows_sent"] for e in channel.pop_step(2)] == [2, 3]
  assert channel.pop_step(1) == []
  channel.push({"rows_sent": 9})
  channel.clear()
  assert channel.pop_step(1) == []


def _entry(dropped=0.0, load=((2, 2, 2, 2),), nodes=0.0):
  return {
    "dropped": np.float64(dropped),
    "rows_sent": np.float64(5),
    "rows_sent_no_dedup": np.float64(8),
    "buffer_rows": np.float64(16),
    "rows_sent_network": np.float64(2 if nodes else 0),
    "nodes_per_token": np.float64(nodes),
    "load": np.array(load, np.float64),
  }


def test_step_metrics_sum_micro_batches_and_take_the_worst_load():
  got = stats.step_metrics([_entry(), _entry(load=((8, 0, 0, 0),))], row_bytes=256, capacity_factor=0.0)
  assert got == {
    "moe/load_max_over_mean": 4.0,
    "moe/tokens_dropped": 0.0,
    "moe/dispatch_rows": 10.0,
    "moe/dispatch_rows_no_dedup": 16.0,
    "moe/dispatch_bytes": 2560.0,
    "moe/dispatch_bytes_no_dedup": 4096.0,
  }
  assert stats.step_metrics([], row_bytes=256, capacity_factor=0.0) == {}


def test_across_nodes_the_step_says_what_crossed_the_network():
  """Only where the exchange spans nodes: the rows that crossed to another node and the most nodes a token
  reached; inside a node neither appears."""
  got = stats.step_metrics([_entry(nodes=2.0), _entry(nodes=1.0)], row_bytes=256, capacity_factor=0.0)
  assert got["moe/nodes_per_token"] == 2.0 and got["moe/dispatch_rows_network"] == 4.0
  assert got["moe/dispatch_bytes_network"] == 4.0 * 256
  inside = stats.step_metrics([_entry()], row_bytes=256, capacity_factor=0.0)
  assert not any(k in inside for k in ("moe/nodes_per_token", "moe/dispatch_rows_network"))


def test_a_drop_stops_a_run_unless_allowed_with_a_capacity():
  with pytest.raises(stats.DroplessViolation, match="dropped 3 assignments; this is a bug"):
    stats.step_metrics([_entry(dropped=3)], row_bytes=4, capacity_factor=0.0)
  with pytest.raises(stats.CapacityOverflow, match="3 token-to-expert assignments did not fit moe_capacity_factor"):
    stats.step_metrics([_entry(dropped=3)], row_bytes=4, capacity_factor=1.25)
  got = stats.step_metrics([_entry(dropped=3)], row_bytes=4, capacity_factor=1.25, allow_drops=True)
  assert got["moe/tokens_dropped"] == 3.0
