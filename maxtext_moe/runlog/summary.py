"""One summary of a run, from its rows: what `train` prints at its end and `maxtext-moe report` rebuilds.

`summarize(rows, this_run=..., layers=...)`: loss and eval loss first and last, the median throughput of
this invocation (its first step, which compiles, left out), dropped assignments, non-finite steps, and
from the load rows the worst-balanced MoE layer and step.
"""

import statistics
from typing import Any

import numpy as np

from maxtext_moe.runlog.files import Layers, is_eval
from maxtext_moe.runlog.plots import relative_load


def _losses(steps: list[dict[str, Any]], rows: list[dict[str, Any]]) -> dict[str, Any]:
  out: dict[str, Any] = {}
  finite = [r for r in steps if r.get("loss") is not None]
  if finite:
    out["first_step"], out["final_step"] = finite[0]["step"], finite[-1]["step"]
    out["first_loss"], out["final_loss"] = finite[0]["loss"], finite[-1]["loss"]
  evals = [r for r in rows if is_eval(r) and r["eval_loss"] is not None]
  if evals:
    out["first_eval_step"], out["final_eval_step"] = evals[0]["step"], evals[-1]["step"]
    out["first_eval_loss"], out["final_eval_loss"] = evals[0]["eval_loss"], evals[-1]["eval_loss"]
  return out


def _balance(layers: Layers) -> dict[str, Any]:
  if layers is None:
    return {}
  at, load, bias = layers
  ratio = relative_load(load).max(axis=-1)  # [S, L]
  s, layer = np.unravel_index(int(np.argmax(ratio)), ratio.shape)
  return {
    "worst_balance": {"max_over_mean": float(ratio[s, layer]), "moe_layer": int(layer), "step": int(at[s]) + 1},
    "final_max_over_mean": float(ratio[-1].max()),
    "final_bias_abs_mean_max": float(bias[-1].max()),
  }


def summarize(
  rows: list[dict[str, Any]], *, this_run: list[dict[str, Any]] | None = None, layers: Layers = None
) -> dict[str, Any]:
  """The summary of a run's rows (all of them, resumed invocations included); throughput from `this_run`'s
  rows (default: all), its first step excluded."""
  steps = [r for r in rows if not is_eval(r)]
  mine = [r for r in (rows if this_run is None else this_run) if not is_eval(r)]
  out: dict[str, Any] = {"steps": len(steps), "steps_this_run": len(mine), **_losses(steps, rows)}
  out["tokens_dropped"] = sum(r.get("moe/tokens_dropped", 0) for r in steps)
  out["nonfinite_steps"] = sum("loss_nonfinite" in r for r in steps)
  steady = mine[1:] or mine
  for key in ("tokens_per_s", "tflops_per_s_per_device"):
    vals = [r[key] for r in steady if key in r]
    if vals:
      out[key] = statistics.median(vals)
  return out | _balance(layers)


def _drop(first: float, final: float) -> str:
  drop = 100 * (1 - final / first) if first else 0.0
  return f"{drop:.0f}% lower" if drop >= 0 else f"{-drop:.0f}% higher"


def _measured(s: dict[str, Any]) -> list[str]:
  lines = []
  if "final_loss" in s:
    lines.append(
      f"  loss        {s['first_loss']:.4f} (step {s['first_step'] + 1}) -> {s['final_loss']:.4f} "
      f"(step {s['final_step'] + 1}), {_drop(s['first_loss'], s['final_loss'])}"
    )
  if "final_eval_loss" in s:
    lines.append(
      f"  eval loss   {s['first_eval_loss']:.4f} (after step {s['first_eval_step'] + 1}) -> "
      f"{s['final_eval_loss']:.4f} (after step {s['final_eval_step'] + 1}), "
      f"{_drop(s['first_eval_loss'], s['final_eval_loss'])}"
    )
  if "tokens_per_s" in s:
    lines.append(
      f"  throughput  {s['tokens_per_s']:,.0f} tokens/s, {s.get('tflops_per_s_per_device', 0):.3f} "
      "TFLOP/s per device (median, first step excluded)"
    )
  lines.append(f"  dropped     {s['tokens_dropped']:.0f} token-to-expert assignments")
  if s["nonfinite_steps"]:
    lines.append(f"  non-finite  {s['nonfinite_steps']} step(s) with a NaN/Inf loss (loss_nonfinite in the metrics)")
  if "worst_balance" in s:
    w = s["worst_balance"]
    lines.append(
      f"  balance     worst max/mean load {w['max_over_mean']:.2f} (MoE layer {w['moe_layer']}, step {w['step']}); "
      f"at the end {s['final_max_over_mean']:.2f}, largest mean |routing bias| {s['final_bias_abs_mean_max']:.4f}"
    )
  return lines


def format_summary(s: dict[str, Any]) -> str:
  """The summary as the lines `train` and `report` print."""
  lines = [f"run summary: {s['run_dir']}" if "run_dir" in s else "run summary", *_measured(s)]
  if s.get("ended_early_at") is not None:
    why = s.get("ended_because") or "MaxText stopped its loop (target_eval_loss was reached)"
    lines.append(f"  ended early after step {s['ended_early_at']} of {s['total_steps']}: {why}")
  files = {"metrics": s.get("metrics"), "loss plot": s.get("loss_plot"), "moe plots": s.get("moe_plots")}
  files["checkpoints"] = s.get("checkpoints")
  for label, value in files.items():
    if value:
      lines.append(f"  {label:<11} {', '.join(value) if isinstance(value, list) else value}")
  return "\n".join(lines)
