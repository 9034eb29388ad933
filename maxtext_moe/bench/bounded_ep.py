"""Bounded-memory dropless EP (`moe.rounds`) against the worst-case buffers, at EP=8 on 8 fake CPU devices.

Measured in one subprocess (8 devices; the caller keeps its one for its own timings), same run, same inputs:
- `bounded_memory_ratio`: XLA's temporary bytes (`memory_analysis`) of the compiled forward+backward of the
  MoE block, bounded (moe_buffers=bounded, the default factor) over worst_case, natural routing;
- `bounded_speed_ratio`: its time per forward+backward, bounded over worst-case, natural routing;
- `adversarial_rounds` and `adversarial_speed_ratio`: every token's experts all on one rank.
"""

import functools
import json
import os
import subprocess
import sys
from typing import Any

from maxtext_moe.moe.settings import DEFAULT_BUFFER_FACTOR as DEFAULT_FACTOR

SHAPE = {"ep": 8, "tokens": 8192, "dim": 256, "hidden": 128, "experts": 64, "top_k": 8}


def measure() -> dict[str, Any]:
  """Runs `_in_process` with 8 fake CPU devices and returns its numbers."""
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
  code = "import json; from maxtext_moe.bench.bounded_ep import _in_process as f; print(json.dumps(f()))"
  r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
  return json.loads(r.stdout.strip().splitlines()[-1])


def _inputs(routing: str):
  import jax
  import jax.numpy as jnp

  t, d, e, k = SHAPE["tokens"], SHAPE["dim"], SHAPE["experts"], SHAPE["top_k"]
  kx, kg = jax.random.split(jax.random.PRNGKey(0))
  x = jax.random.normal(kx, (t, d))
  logits = x @ (jax.random.normal(kg, (d, e)) / d**0.5)
  if routing == "one_rank":  # rank 0's experts only (E/P = 8 >= K)
    logits = logits.at[:, e // SHAPE["ep"] :].set(-1e9)
  top, ids = jax.lax.top_k(logits, k)
  return x, ids.astype(jnp.int32), jax.nn.sigmoid(top)


def _program(buffers: str):
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import Mesh

  from maxtext_moe.moe.block import moe_block
  from maxtext_moe.moe.settings import BufferMode, DispatchKind, MoESettings

  mesh = Mesh(np.array(jax.devices()[: SHAPE["ep"]]), ("expert",))
  settings = MoESettings(
    dispatch=DispatchKind.ALL_TO_ALL, buffers=BufferMode(buffers), buffer_factor=DEFAULT_FACTOR, window_sizes=None
  )
  block = functools.partial(moe_block, mesh=mesh, expert_axis="expert", settings=settings)

  def loss(x, w, ws):
    y, stats = block(x, ws[0], ws[1], *w)
    return jnp.sum(y.astype(jnp.float32) ** 2), stats

  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


def _in_process(*, timed: bool = True) -> dict[str, Any]:
  import jax

  from maxtext_moe.bench.timing import time_call

  e, d, f = SHAPE["experts"], SHAPE["dim"], SHAPE["hidden"]
  keys = jax.random.split(jax.random.PRNGKey(1), 3)
  w = (
    jax.random.normal(keys[0], (e, d, f)) / d**0.5,
    jax.random.normal(keys[1], (e, d, f)) / d**0.5,
    jax.random.normal(keys[2], (e, f, d)) / f**0.5,
  )
  out: dict[str, Any] = {"shape": SHAPE, "factor": DEFAULT_FACTOR}
  seconds, temp = {}, {}
  for routing in ("natural", "one_rank"):
    x, ids, weights = _inputs(routing)
    for name in ("worst_case", "bounded"):
      if not timed and (routing, name) == ("one_rank", "worst_case"):
        continue  # only the adversarial speed ratio needs it
      args = (x, w, (ids, weights))
      fn = _program(name).lower(*args).compile()  # compiled once, for the memory analysis and the runs
      if routing == "natural":
        temp[name] = fn.memory_analysis().temp_size_in_bytes
      (_, stats), _ = fn(*args)
      out[f"{routing}_{name}_rounds"] = float(stats["rounds"])
      out[f"{routing}_{name}_dropped"] = float(stats["dropped"])
      seconds[(routing, name)] = time_call(fn, *args, reps=3, best=True) if timed else 1.0
  out["worst_case_temp_bytes"], out["bounded_temp_bytes"] = temp["worst_case"], temp["bounded"]
  out["bounded_memory_ratio"] = temp["bounded"] / temp["worst_case"]
  out["bounded_speed_ratio"] = seconds[("natural", "bounded")] / seconds[("natural", "worst_case")]
  out["adversarial_rounds"] = out["one_rank_bounded_rounds"]
  if timed:
    out["adversarial_speed_ratio"] = seconds[("one_rank", "bounded")] / seconds[("one_rank", "worst_case")]
  return out
