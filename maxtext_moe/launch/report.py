"""A run's pictures and summary, from its files alone: `maxtext-moe report RUN_DIR` (and the end of `train`).

Reads `metrics.jsonl` (one row per step, plus eval rows) and `moe_load.jsonl` (every moe_load_every steps:
each MoE layer's [E] routed assignments and mean |routing bias|), so a run copied off a cluster can be
looked at anywhere. Writes, next to them:
- `loss.png`: training loss, and the held-out eval loss when there is one;
- `moe_load.png`: one experts x steps heatmap per MoE layer, each expert's load over the layer's mean at
  that step (1 = balanced; the colour scale is clipped at 0 and 2), in a grid that stays readable for
  DeepSeek-V3's 58 layers of 256 experts;
- `moe_balance.png`: max/mean expert load and mean |routing bias| per layer over steps (every layer up to
  8 layers; past that the spread over layers, the median and the worst layer).
"""

import json
import math
import statistics
from pathlib import Path
from typing import Any

import numpy as np

from maxtext_moe.errors import UserError
from maxtext_moe.launch.recorder import is_eval, read_jsonl

METRICS, LOAD = "metrics.jsonl", "moe_load.jsonl"
LOSS_PNG, LOAD_PNG, BALANCE_PNG = "loss.png", "moe_load.png", "moe_balance.png"
MANY_LAYERS = 8


def read_layers(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
  """(steps [S], load [S, L, E], bias [S, L]) of a moe_load.jsonl, or None when there is none."""
  rows = read_jsonl(path)
  if not rows:
    return None
  steps = np.array([r["step"] for r in rows])
  return steps, np.array([r["load"] for r in rows], np.float64), np.array([r["bias_abs_mean"] for r in rows])


def relative_load(load_SLE: np.ndarray) -> np.ndarray:
  """Each expert's load over its layer's mean load at that step (1 = balanced)."""
  return load_SLE / np.maximum(load_SLE.mean(axis=-1, keepdims=True), 1e-9)


def _plt():
  import matplotlib  # pylint: disable=import-outside-toplevel

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  return plt


def plot_loss(rows: list[dict[str, Any]], path: Path) -> Path:
  """Writes the loss curve as a PNG (matplotlib, no display needed)."""
  plt = _plt()
  steps = [r["step"] + 1 for r in rows if r.get("loss") is not None]
  losses = [r["loss"] for r in rows if r.get("loss") is not None]
  evals = [(r["step"] + 1, r["eval_loss"]) for r in rows if is_eval(r) and r["eval_loss"] is not None]
  fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
  ax.plot(steps, losses, lw=1.5, label="training loss")
  if evals:
    ax.plot(*zip(*evals, strict=True), "o-", lw=1.5, label="eval loss (held-out)")
    ax.legend()
  ax.set_xlabel("step")
  ax.set_ylabel("loss")
  ax.set_title(path.parent.name)
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path)
  plt.close(fig)
  return path


def plot_load(steps: np.ndarray, load_SLE: np.ndarray, path: Path) -> Path:
  plt = _plt()
  rel = relative_load(load_SLE)
  layers, experts = rel.shape[1], rel.shape[2]
  cols = min(layers, 8)
  rows = math.ceil(layers / cols)
  fig, axes = plt.subplots(
    rows, cols, figsize=(2.4 * cols + 1, 2.0 * rows + 0.8), dpi=100, squeeze=False, layout="constrained"
  )
  extent = (steps[0] + 1, steps[-1] + 1, -0.5, experts - 0.5)
  image = None
  for i, ax in enumerate(axes.flat):
    if i >= layers:
      ax.axis("off")
      continue
    image = ax.imshow(rel[:, i, :].T, aspect="auto", origin="lower", cmap="RdBu_r", vmin=0, vmax=2, extent=extent)
    ax.set_title(f"MoE layer {i}", fontsize=8)
    ax.tick_params(labelsize=6)
    if i % cols == 0:
      ax.set_ylabel("expert", fontsize=7)
    if i >= layers - cols:
      ax.set_xlabel("step", fontsize=7)
  fig.suptitle(f"{path.parent.name}: expert load / layer mean (1 = balanced)", fontsize=9)
  fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8)
  fig.savefig(path)
  plt.close(fig)
  return path


def _per_layer(ax: Any, steps: np.ndarray, values_SL: np.ndarray, label: str) -> None:
  x = steps + 1
  if values_SL.shape[1] <= MANY_LAYERS:
    for i in range(values_SL.shape[1]):
      ax.plot(x, values_SL[:, i], lw=1.2, label=f"layer {i}")
  else:
    worst = int(np.argmax(values_SL.max(axis=0)))
    ax.fill_between(x, values_SL.min(axis=1), values_SL.max(axis=1), alpha=0.25, label="min-max over layers")
    ax.plot(x, np.median(values_SL, axis=1), lw=1.2, label="median layer")
    ax.plot(x, values_SL[:, worst], lw=1.2, label=f"layer {worst} (the highest)")
  ax.set_ylabel(label, fontsize=8)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=6, ncol=2)


def plot_balance(steps: np.ndarray, load_SLE: np.ndarray, bias_SL: np.ndarray, path: Path) -> Path:
  plt = _plt()
  fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5.5), dpi=100, sharex=True)
  _per_layer(top, steps, relative_load(load_SLE).max(axis=-1), "max / mean expert load")
  _per_layer(bottom, steps, bias_SL, "mean |routing bias|")
  bottom.set_xlabel("step")
  top.set_title(f"{path.parent.name}: MoE balance", fontsize=9)
  fig.tight_layout()
  fig.savefig(path)
  plt.close(fig)
  return path


Layers = tuple[np.ndarray, np.ndarray, np.ndarray] | None  # `read_layers`


def moe_plots(run_dir: Path, layers: Layers) -> list[Path]:
  """moe_load.png and moe_balance.png in `run_dir` from `read_layers` of its moe_load.jsonl ([] without)."""
  if layers is None:
    return []
  steps, load, bias = layers
  return [plot_load(steps, load, run_dir / LOAD_PNG), plot_balance(steps, load, bias, run_dir / BALANCE_PNG)]


def summarize(run_dir: Path, rows: list[dict[str, Any]], layers: Layers) -> dict[str, Any]:
  """Loss start/end, eval loss start/end, median throughput, dropped tokens and the worst-balanced layer,
  from the run's metrics rows and `read_layers` of its moe_load.jsonl."""
  steps = [r for r in rows if not is_eval(r)]
  out: dict[str, Any] = {"run_dir": str(run_dir), "steps": len(steps)}
  finite = [r for r in steps if r.get("loss") is not None]
  if finite:
    out |= {"first_loss": finite[0]["loss"], "final_loss": finite[-1]["loss"], "final_step": finite[-1]["step"] + 1}
  evals = [r for r in rows if is_eval(r) and r["eval_loss"] is not None]
  if evals:
    out |= {"first_eval_loss": evals[0]["eval_loss"], "final_eval_loss": evals[-1]["eval_loss"]}
  speeds = [r["tokens_per_s"] for r in steps[1:] if "tokens_per_s" in r]
  if speeds:
    out["tokens_per_s_median"] = statistics.median(speeds)
  out["tokens_dropped"] = sum(r.get("moe/tokens_dropped", 0) for r in steps)
  out["nonfinite_steps"] = sum("loss_nonfinite" in r for r in steps)
  if layers is not None:
    at, load, bias = layers
    ratio = relative_load(load).max(axis=-1)  # [S, L]
    s, layer = np.unravel_index(int(np.argmax(ratio)), ratio.shape)
    out["worst_balance"] = {"max_over_mean": float(ratio[s, layer]), "moe_layer": int(layer), "step": int(at[s]) + 1}
    out["final_max_over_mean"] = float(ratio[-1].max())
    out["final_bias_abs_mean_max"] = float(bias[-1].max())
  return out


def format_summary(s: dict[str, Any]) -> str:
  lines = [f"run {s['run_dir']}: {s['steps']} steps recorded"]
  if "final_loss" in s:
    lines.append(f"  loss          {s['first_loss']:.4f} -> {s['final_loss']:.4f} (step {s['final_step']})")
  if "final_eval_loss" in s:
    lines.append(f"  eval loss     {s['first_eval_loss']:.4f} -> {s['final_eval_loss']:.4f}")
  if "tokens_per_s_median" in s:
    lines.append(f"  throughput    {s['tokens_per_s_median']:,.0f} tokens/s (median, first row excluded)")
  lines.append(f"  dropped       {s['tokens_dropped']:.0f} token-to-expert assignments")
  if s["nonfinite_steps"]:
    lines.append(f"  non-finite    {s['nonfinite_steps']} step(s)")
  if "worst_balance" in s:
    w = s["worst_balance"]
    lines.append(
      f"  balance       worst max/mean load {w['max_over_mean']:.2f} (MoE layer {w['moe_layer']}, step {w['step']}); "
      f"at the end {s['final_max_over_mean']:.2f}, largest mean |routing bias| {s['final_bias_abs_mean_max']:.4f}"
    )
  return "\n".join(lines)


def report(run_dir: Path) -> tuple[dict[str, Any], list[Path]]:
  """Rebuilds a run directory's pictures; returns its summary and the files written."""
  if not run_dir.is_dir():
    raise UserError(f"{run_dir} is not a directory; pass a run directory (base_output_directory/run_name)")
  foreign = f"{run_dir} is not a maxtext-moe run directory: it has no readable {METRICS} with step rows"
  try:
    rows = read_jsonl(run_dir / METRICS) if (run_dir / METRICS).is_file() else []
    if not rows or not all(isinstance(r, dict) and "step" in r for r in rows):
      raise UserError(foreign)
    layers = read_layers(run_dir / LOAD)
    written = [plot_loss(rows, run_dir / LOSS_PNG), *moe_plots(run_dir, layers)]
    return summarize(run_dir, rows, layers), written
  except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
    raise UserError(f"{foreign} ({type(e).__name__}: {str(e).splitlines()[0][:120]})") from None
