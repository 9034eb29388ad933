"""The prepared GPU check (`scripts/gpu_check.sh` runs it): what a GPU gives our MoE block, in one run of
under 8 minutes, as a table and JSON.

1. Where we are: `maxtext-moe doctor`'s facts (GPU, TE, NCCL, what `auto` picks and why).
2. Grouped-GEMM efficiency of every backend available here against a dense bf16 matmul of equal FLOPs, at
   DeepSeek-V3's expert shape: D=7168, F=2048, 32 or 8 local experts (256 experts over EP=8 or 32),
   4,096 tokens x top-8 = 32,768 routed rows per GPU, forward and forward+backward. The rows are split
   over the local experts with realistic imbalance: expert popularity log-normal (sigma 0.6, so the
   busiest expert gets about 2-3x the mean), group sizes drawn multinomially. Backends: tiled and
   ragged_dot always, tokamax where it imports, te (bf16) and te fp8 / mxfp8 where TE runs them here
   (mxfp8 with 128-row aligned groups, as te_ep delivers them).
3. Our MoE layer's forward+backward against MaxText's sparse_matmul and dense_matmul on the same
   parameters, if maxtext imports here (else the table says why not).
Targets printed with the rows: best backend fwd+bwd >= 0.7 of dense bf16; layer >= 5x sparse_matmul.

Needs only JAX for parts 1 and 2 (no maxtext, pydantic or rich), so it runs on a bare CUDA JAX machine;
`--cpu-smoke` runs every part at toy shapes on CPU in under a minute (CI does, so it cannot rot).

  python -m maxtext_moe.bench.gpu_check --out DIR [--cpu-smoke] [--budget-s 450]
"""

import argparse
import contextlib
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from maxtext_moe.bench.moe_speed import gemm_efficiency, layer_times
from maxtext_moe.tools import doctor
from maxtext_moe.upstream.te import calls as te

FULL = {"tokens": 4096, "top_k": 8, "dim": 7168, "hidden": 2048, "local_experts": (32, 8), "rounds": 3, "reps": 5}
SMOKE = {"tokens": 64, "top_k": 8, "dim": 64, "hidden": 32, "local_experts": (8, 4), "rounds": 1, "reps": 1}
# The layer part: large enough that launch overheads do not decide it, small enough that MaxText's
# dense_matmul (every token through every expert) fits and finishes on one GPU.
LAYER_GPU = [
  "override_model_config=true",
  "hardware=gpu",
  "dtype=bfloat16",
  "weight_dtype=bfloat16",
  "base_emb_dim=2048",
  "base_moe_mlp_dim=1024",
  "num_experts=64",
  "num_experts_per_tok=8",
  "n_routing_groups=8",
  "topk_routing_group=4",
  "per_device_batch_size=4",
  "max_target_length=2048",
]
LAYER_SMOKE = [
  "override_model_config=true",
  "base_emb_dim=64",
  "base_moe_mlp_dim=32",
  "num_experts=16",
  "num_experts_per_tok=4",
  "n_routing_groups=4",
  "topk_routing_group=2",
  "per_device_batch_size=1",
  "max_target_length=64",
]
TARGET_GEMM, TARGET_LAYER = 0.7, 5.0
POPULARITY_SIGMA = 0.6


def imbalanced_sizes(rows: int, experts: int, *, align: int = 1, seed: int = 0) -> np.ndarray:
  """Rows per local expert, summing to `rows`: blocks of `align` rows drawn multinomially over log-normal
  expert popularity; what does not fill a block goes to the last expert."""
  rng = np.random.default_rng(seed)
  popularity = rng.lognormal(0.0, POPULARITY_SIGMA, experts)
  sizes = rng.multinomial(rows // align, popularity / popularity.sum()) * align
  sizes[-1] += rows - sizes.sum()
  return sizes.astype(np.int32)


def _variants(dtype: Any) -> tuple[dict[str, dict[str, Any]], list[str]]:
  """{label: grouped_matmul keywords} of every backend this machine runs, and notes on the ones left out."""
  variants = {"tiled": {"backend": "tiled"}, "ragged_dot": {"backend": "ragged_dot"}}
  notes = []
  try:
    import tokamax  # noqa: F401  # pylint: disable=import-outside-toplevel,unused-import

    variants["tokamax"] = {"backend": "tokamax"}
  except ImportError as e:
    notes.append(f"tokamax: not measured ({e})")
  status = te.status()
  if not status.available or jax.default_backend() != "gpu":
    notes.append(f"te: not measured ({status.reason or 'not a GPU'})")
    return variants, notes
  if dtype == jnp.bfloat16:
    variants["te"] = {"backend": "te"}
  for quantization in ("fp8", "mxfp8"):
    supported, why = te.scaling_mode_supported(quantization)
    if supported:
      variants[f"te {quantization}"] = {"backend": "te", "quantization": quantization}
    else:
      notes.append(f"te {quantization}: not supported here ({why})")
  return variants, notes


def gemm_rows(shape: dict[str, Any], dtype: Any, deadline: float) -> tuple[list[dict[str, Any]], list[str]]:
  variants, notes = _variants(dtype)
  rows = []
  for experts in shape["local_experts"]:
    r = shape["tokens"] * shape["top_k"]
    gemm_shape = {"rows": r, "dim": shape["dim"], "hidden": shape["hidden"], "experts": experts}
    for label, kwargs in variants.items():
      if time.monotonic() > deadline:
        notes.append(f"{label} at {experts} experts: skipped, out of time")
        continue
      aligned = kwargs.get("quantization") == "mxfp8"
      sizes = imbalanced_sizes(r, experts, align=128 if aligned else 1)
      try:
        eff = gemm_efficiency(
          {label: kwargs},
          rounds=shape["rounds"],
          reps=shape["reps"],
          shape=gemm_shape,
          dtype=dtype,
          sizes_E=jnp.asarray(sizes),
        )[label]
      except Exception as e:  # pylint: disable=broad-except  # one backend failing must not hide the others
        notes.append(f"{label} at {experts} experts: failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
        continue
      load = float(sizes.max() / sizes.mean())
      rows.append({"backend": label, "local_experts": experts, "rows": r, "load_max_over_mean": load, **eff})
  return rows, notes


def layer_row(overrides: list[str], reps: int) -> dict[str, Any]:
  try:
    from maxtext_moe.upstream.maxtext import model  # noqa: F401  # pylint: disable=import-outside-toplevel,unused-import
  except Exception as e:  # pylint: disable=broad-except  # ImportError, or a dependency failing at import
    return {"skipped": f"maxtext does not import here ({type(e).__name__}: {e}); pass its wheels with --wheels"}
  times, diffs = layer_times(reps=reps, overrides=overrides)
  return {
    "seconds": times,
    "max_abs_diff_vs_dense": diffs,
    "speedup_vs_sparse": times["maxtext_sparse"] / times["ours"],
    "speedup_vs_dense": times["maxtext_dense"] / times["ours"],
  }


def table(result: dict[str, Any]) -> str:
  lines = [
    f"GPU check on {result['environment']['device_kind']} ({result['mode']}), "
    f"{result['seconds']:.0f} s; ratios to baselines measured in this run",
    "",
    doctor.table(result["environment"]),
    "",
    f"grouped GEMM / dense {result['dtype']} matmul of equal FLOPs (D={result['shape']['dim']}, "
    f"F={result['shape']['hidden']}, {result['shape']['tokens']} tokens x top-{result['shape']['top_k']}):",
    f"  {'backend':<12}{'experts':>8}{'max/mean':>10}{'fwd':>8}{'fwd+bwd':>9}",
  ]
  for r in result["gemm"]:
    lines.append(
      f"  {r['backend']:<12}{r['local_experts']:>8}{r['load_max_over_mean']:>10.2f}{r['fwd']:>8.3f}{r['fwd_bwd']:>9.3f}"
    )
  best = result["best_gemm_fwd_bwd"]
  if best:
    verdict = "met" if best["fwd_bwd"] >= TARGET_GEMM else "NOT met"
    lines.append(
      f"  best fwd+bwd: {best['backend']} {best['fwd_bwd']:.3f} at {best['local_experts']} experts "
      f"(target >= {TARGET_GEMM}: {verdict})"
    )
  lines += [f"  note: {n}" for n in result["notes"]]
  layer = result["layer"]
  lines.append("")
  if "skipped" in layer:
    lines.append(f"MoE layer vs MaxText: skipped: {layer['skipped']}")
  else:
    lines.append("MoE layer fwd+bwd vs MaxText (same parameters):")
    for name, secs in layer["seconds"].items():
      lines.append(f"  {name:<16}{secs:>10.4f} s   max |y - dense y| {layer['max_abs_diff_vs_dense'][name]:.1e}")
    verdict = "met" if layer["speedup_vs_sparse"] >= TARGET_LAYER else "NOT met"
    lines.append(f"  speedup vs sparse_matmul {layer['speedup_vs_sparse']:.1f}x (target >= {TARGET_LAYER}x: {verdict})")
    lines.append(f"  speedup vs dense_matmul  {layer['speedup_vs_dense']:.2f}x")
  return "\n".join(lines)


def run(*, smoke: bool, budget_s: float) -> dict[str, Any]:
  start = time.monotonic()
  shape = SMOKE if smoke else FULL
  dtype = jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16
  environment = doctor.probe()
  gemm, notes = gemm_rows(shape, dtype, deadline=start + budget_s * 0.6)
  if time.monotonic() - start < budget_s * 0.6:
    layer = layer_row(LAYER_SMOKE if smoke else LAYER_GPU, reps=1 if smoke else 3)
  else:
    layer = {"skipped": "out of time after the GEMM rows"}
  best = max(gemm, key=lambda r: r["fwd_bwd"], default=None)
  return {
    "mode": "cpu-smoke" if smoke else "full",
    "environment": environment,
    "dtype": jnp.dtype(dtype).name,
    "shape": {k: v for k, v in shape.items() if k not in ("rounds", "reps")},
    "popularity_sigma": POPULARITY_SIGMA,
    "gemm": gemm,
    "best_gemm_fwd_bwd": best,
    "notes": notes,
    "layer": layer,
    "targets": {"gemm_fwd_bwd": TARGET_GEMM, "layer_speedup_vs_sparse": TARGET_LAYER},
    "seconds": time.monotonic() - start,
  }


def main(argv: list[str] | None = None) -> int:
  parser = argparse.ArgumentParser(
    prog="gpu_check", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
  )
  parser.add_argument("--out", type=Path, required=True, help="directory for gpu_check.json and gpu_check.txt")
  parser.add_argument("--cpu-smoke", action="store_true", help="toy shapes on whatever backend this is (CI)")
  parser.add_argument("--budget-s", type=float, default=450, help="stop starting new measurements after this")
  ns = parser.parse_args(argv)
  if not ns.cpu_smoke and jax.default_backend() != "gpu":
    print(f"gpu_check: no GPU here (JAX backend {jax.default_backend()}); use --cpu-smoke", file=sys.stderr)
    return 2
  ns.out.mkdir(parents=True, exist_ok=True)
  out = sys.stdout
  with contextlib.redirect_stdout(sys.stderr):  # MaxText's import-time notices go to stderr, not into the table
    try:
      result = run(smoke=ns.cpu_smoke, budget_s=ns.budget_s)
    except Exception:  # pylint: disable=broad-except  # keep what explains the failure next to the results
      (ns.out / "gpu_check_error.txt").write_text(traceback.format_exc())
      raise
    (ns.out / "gpu_check.json").write_text(json.dumps(result, indent=1) + "\n")
    text = table(result)
    (ns.out / "gpu_check.txt").write_text(text + "\n")
    print(text, file=out)
  return 0


if __name__ == "__main__":
  sys.exit(main())
