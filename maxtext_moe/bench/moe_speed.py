"""`maxtext-moe bench moe`: grouped-GEMM efficiency, layer speed against MaxText, and dedup on the wire.

Proxy shapes, chosen so a 2-core CPU runs the whole benchmark in about a minute:
- GEMM: R = 8192 routed rows (1,024 tokens x top-8), D = 256, F = 512, E = 64 experts, f32, natural
  (uniform random) routing. Efficiency = time of a dense [R, D] x [D, F] matmul of equal FLOPs / backend time.
- Layer: MaxText's RoutedMoE with DeepSeek-V3 routing (sigmoid + bias, 8 groups top-4, top-8 of 64),
  emb 256, expert hidden 512, 4 x 256 tokens, f32, forward + backward, the same parameters for all three.
- Dedup: the all_to_all dispatcher at EP=8 on 8 (fake) devices, 64 experts top-8, natural routing; rows sent
  with dedup / without, against the analytic expectation for uniform top-k routing.
- Bounded-memory EP (`bench.bounded_ep`): XLA temporary bytes and time of the MoE block's forward+backward at
  EP=8, bounded (moe_buffer_factor) over worst-case buffers; rounds and time with every token on one rank.
"""

import json
import os
import statistics
import subprocess
import sys
from typing import IO, Any

import jax
import jax.numpy as jnp

from maxtext_moe.bench import bounded_ep
from maxtext_moe.bench.report import emit
from maxtext_moe.bench.timing import time_call
from maxtext_moe.moe import permute
from maxtext_moe.moe.gemm import grouped_matmul
from maxtext_moe.moe.settings import GemmBackend

GEMM = {"rows": 8192, "dim": 256, "hidden": 512, "experts": 64}
BOUNDED_KEYS = ("bounded_memory_ratio", "bounded_speed_ratio", "adversarial_rounds", "adversarial_speed_ratio")
DEDUP = {"ep": 8, "tokens": 16384, "experts": 64, "top_k": 8}
LAYER_OVERRIDES = [
  "override_model_config=true",
  "base_emb_dim=256",
  "base_moe_mlp_dim=512",
  "num_experts=64",
  "num_experts_per_tok=8",
  "n_routing_groups=8",
  "topk_routing_group=4",
  "per_device_batch_size=4",
  "max_target_length=256",
]
# Backends timed once (one round of two calls): ragged_dot and tokamax run at ~1.5% of dense on CPU.
_REPS = {GemmBackend.RAGGED_DOT, GemmBackend.TOKAMAX}


def _gemm_inputs(seed: int = 0, shape: dict[str, int] = GEMM, dtype=jnp.float32):
  k1, k2, k3 = jax.random.split(jax.random.PRNGKey(seed), 3)
  r, d, f, e = shape["rows"], shape["dim"], shape["hidden"], shape["experts"]
  sizes = jnp.bincount(jax.random.randint(k3, (r,), 0, e), length=e).astype(jnp.int32)
  x = jax.random.normal(k1, (r, d), dtype)
  return x, (jax.random.normal(k2, (e, d, f)) / 16).astype(dtype), sizes


def _sq_grad(fn):
  return jax.jit(jax.grad(lambda x, w, s: jnp.sum(fn(x, w, s) ** 2), argnums=(0, 1)))


def gemm_efficiency(
  backends: list[GemmBackend] | dict[str, dict[str, Any]],
  *,
  rounds: int = 5,
  reps: int = 3,
  shape: dict[str, int] = GEMM,
  dtype=jnp.float32,
  sizes_E: jax.Array | None = None,
) -> dict[str, dict[str, float]]:
  """{label: {"fwd": dense_time / time, "fwd_bwd": ...}} at `shape`: `backends` is a list of backends or
  {label: grouped_matmul keywords} (e.g. {"te fp8": {"backend": "te", "quantization": "fp8"}});
  `sizes_E` replaces the uniform random routing's group sizes.

  On a shared 2-core VM single timings swing by 2x (measured fwd+bwd ratios of 0.36 to 0.63 in four
  back-to-back runs), so each round times the dense baseline and the backend next to each other (best of
  `reps` calls each) and the result is the median of the per-round ratios."""
  x, w, sizes = _gemm_inputs(shape=shape, dtype=dtype)
  sizes = sizes if sizes_E is None else sizes_E
  variants = backends if isinstance(backends, dict) else {str(b): {"backend": b} for b in backends}
  slow = _REPS if jax.default_backend() == "cpu" else set()

  def dense(x, w2, s):  # one [D, F] weight: the same FLOPs as the grouped GEMM, forward and backward
    return x @ w2

  w2 = w[0]
  dense_fns = (jax.jit(dense), _sq_grad(dense))
  out = {}
  for label, kwargs in variants.items():

    def gmm(x, w, s, kwargs=kwargs):
      return grouped_matmul(x, w, s, **kwargs)

    fns = (jax.jit(gmm), _sq_grad(gmm))
    n_rounds, n = (1, 2) if GemmBackend(kwargs["backend"]) in slow else (rounds, reps)
    ratios = {"fwd": [], "fwd_bwd": []}
    for _ in range(n_rounds):
      for key, dense_fn, fn in zip(ratios, dense_fns, fns, strict=True):
        base = time_call(dense_fn, x, w2, sizes, reps=reps, best=True)
        ratios[key].append(base / time_call(fn, x, w, sizes, reps=n, best=True))
    out[label] = {k: statistics.median(v) for k, v in ratios.items()}
  return out


LAYER_VARIANTS = {
  "maxtext_sparse": ["moe_impl=maxtext", "sparse_matmul=true"],
  "maxtext_dense": ["moe_impl=maxtext", "sparse_matmul=false"],
  "ours": ["moe_impl=dropless", "sparse_matmul=true"],
}


def layer_times(*, reps: int = 3, overrides: list[str] = LAYER_OVERRIDES) -> tuple[dict[str, float], dict[str, float]]:
  """Seconds per forward+backward of MaxText's RoutedMoE: stock sparse, stock dense, ours (same params),
  and each variant's max |output - dense output| as a check that they compute the same layer."""
  from maxtext_moe.config.recipes import DEFAULT_RECIPE, recipe_path
  from maxtext_moe.upstream.maxtext.model import routed_moe_layer
  from maxtext_moe.upstream.resolution import resolved

  times, outputs = {}, {}
  for name, extra in LAYER_VARIANTS.items():
    cfg = resolved(recipe_path(DEFAULT_RECIPE), [*overrides, *extra])
    fwd, fwd_bwd, params, x, ctx = routed_moe_layer(cfg)
    with ctx():
      outputs[name] = fwd(params, x)
      times[name] = time_call(fwd_bwd, params, x, reps=1 if name == "maxtext_sparse" else reps)
  diffs = {n: float(jnp.max(jnp.abs(y - outputs["maxtext_dense"]))) for n, y in outputs.items()}
  return times, diffs


def dedup_measurement() -> dict[str, float]:
  """Runs the all_to_all dispatcher at EP=8 on 8 fake CPU devices (in a subprocess, so this process keeps
  its single device for timing) and returns measured and analytic wire-row ratios."""
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
  code = "import json; from maxtext_moe.bench.moe_speed import _dedup_in_process as f; print(json.dumps(f()))"
  r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
  return json.loads(r.stdout.strip().splitlines()[-1])


def _dedup_in_process() -> dict[str, float]:
  import numpy as np
  from jax.sharding import Mesh

  from maxtext_moe.moe.block import moe_block
  from maxtext_moe.moe.settings import DispatchKind, MoESettings

  ep, t, e, k = DEDUP["ep"], DEDUP["tokens"], DEDUP["experts"], DEDUP["top_k"]
  d, f = 512, 8  # wide tokens: a random gate's top-k is then close to a uniform random k-subset
  kx, kg = jax.random.split(jax.random.PRNGKey(0))
  x = jax.random.normal(kx, (t, d))
  logits = x @ (jax.random.normal(kg, (d, e)) / d**0.5)  # natural routing: a random gate's top-k
  top, ids = jax.lax.top_k(logits, k)  # on logits: sigmoid scores saturate and ties would favour low ids
  weights = jax.nn.sigmoid(top)
  w = jnp.zeros((e, d, f)), jnp.zeros((e, d, f)), jnp.zeros((e, f, d))
  mesh = Mesh(np.array(jax.devices()[:ep]), ("expert",))
  run = jax.jit(
    lambda *a: moe_block(*a, mesh=mesh, expert_axis="expert", settings=MoESettings(dispatch=DispatchKind.ALL_TO_ALL))[1]
  )
  stats = run(x, ids, weights, *w)
  expected = permute.expected_distinct_ranks(num_experts=e, top_k=k, num_ranks=ep) / k
  return {
    "measured": float(stats["rows_sent"] / stats["rows_sent_no_dedup"]),
    "expected": expected,
    "dropped": float(stats["dropped"]),
  }


def run(*, out: IO[str], as_json: bool = False, backends: list[str] | None = None) -> dict[str, Any]:
  """Runs everything, prints a table, and with as_json prints one JSON object as the last line."""
  from rich.table import Table

  from maxtext_moe.config import flags

  chosen = [GemmBackend(b) for b in (backends or ["tiled", "ragged_dot", "tokamax"])]  # te: gpu_check.py, bf16
  eff = gemm_efficiency(chosen)
  times, diffs = layer_times()
  dedup = dedup_measurement()
  bounded = bounded_ep.measure()
  result = {
    "platform": jax.default_backend(),
    "runtime_env": {k: os.environ.get(k) for k in flags.profile("cpu").env},
    "gemm_shape": GEMM,
    "gemm_efficiency": eff,
    "layer_seconds": times,
    "layer_max_abs_diff_vs_dense": diffs,
    "layer_speedup_vs_maxtext_sparse": times["maxtext_sparse"] / times["ours"],
    "layer_speedup_vs_maxtext_dense": times["maxtext_dense"] / times["ours"],
    "dedup_wire_ratio": dedup["measured"],
    "dedup_expected_ratio": dedup["expected"],
    "dedup_tokens_dropped": dedup["dropped"],
    **{k: bounded[k] for k in BOUNDED_KEYS},
    "bounded_ep": bounded,
  }
  table = Table(title=f"MoE benchmark ({result['platform']}; ratios to baselines measured in this run)")
  table.add_column("row")
  table.add_column("value", justify="right")
  for backend, v in eff.items():
    table.add_row(f"GEMM efficiency {backend} fwd (dense=1)", f"{v['fwd']:.3f}")
    table.add_row(f"GEMM efficiency {backend} fwd+bwd (dense=1)", f"{v['fwd_bwd']:.3f}")
  for name, secs in times.items():
    table.add_row(f"layer fwd+bwd seconds: {name} (max |y - dense y| {diffs[name]:.1e})", f"{secs:.4f}")
  table.add_row("layer speedup vs MaxText sparse_matmul", f"{result['layer_speedup_vs_maxtext_sparse']:.1f}x")
  table.add_row("layer speedup vs MaxText dense_matmul", f"{result['layer_speedup_vs_maxtext_dense']:.2f}x")
  table.add_row("dedup wire rows ratio at EP=8 (measured)", f"{dedup['measured']:.4f}")
  table.add_row("dedup wire rows ratio at EP=8 (analytic)", f"{dedup['expected']:.4f}")
  factor = bounded["factor"]
  table.add_row(
    f"bounded EP=8 temp bytes / worst-case (factor {factor}, natural)", f"{bounded['bounded_memory_ratio']:.3f}"
  )
  table.add_row("bounded EP=8 fwd+bwd time / worst-case (natural)", f"{bounded['bounded_speed_ratio']:.3f}")
  table.add_row("bounded EP=8 rounds, every token to one rank", f"{bounded['adversarial_rounds']:.0f}")
  table.add_row("bounded EP=8 fwd+bwd time / worst-case (one rank)", f"{bounded['adversarial_speed_ratio']:.3f}")
  env = " ".join(f"{k}={v}" for k, v in result["runtime_env"].items() if v is not None) or "glibc defaults"
  table.caption = f"host allocator: {env}"
  emit(table, result, as_json=as_json, out=out, width=100)
  return result
