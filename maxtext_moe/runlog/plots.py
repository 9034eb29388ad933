"""A run's pictures, from its row files (`files.py`). Written next to them:
- `loss.png`: training loss, and the held-out eval loss when there is one;
- `moe_load.png`: one experts x steps heatmap per MoE layer, each expert's load over the layer's mean at
  that step (1 = balanced; the colour scale is clipped at 0 and 2), in a grid that stays readable for
  DeepSeek-V3's 58 layers of 256 experts;
- `moe_balance.png`: max/mean expert load and mean |routing bias| per layer over steps (every layer up to
  8 layers; past that the spread over layers, the median and the worst layer).
"""

import math
from pathlib import Path
from typing import Any

import numpy as np

from maxtext_moe.runlog.files import Layers, is_eval

LOSS_PNG, LOAD_PNG, BALANCE_PNG = "loss.png", "moe_load.png", "moe_balance.png"
MANY_LAYERS = 8


def relative_load(load_SLE: np.ndarray) -> np.ndarray:
  """Each expert's load over its layer's mean load at that step (1 = balanced)."""
  return load_SLE / np.maximum(load_SLE.mean(axis=-1, keepdims=True), 1e-9)


def _plt():
  import matplotlib  # pylint: disable=import-outside-toplevel

  matplotlib.use("Agg")
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

  return plt


def _whole(axis: Any) -> None:
  """Ticks at whole steps or experts only (a 1-step run's step axis was ticked 0.96 ... 1.04)."""
  from matplotlib.ticker import MaxNLocator  # pylint: disable=import-outside-toplevel

  axis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))


def _one_point(x: Any) -> str | None:
  """A marker where a line has one point (a 1-step run), which a line alone does not draw."""
  return "o" if len(x) == 1 else None


def _step_range(steps: np.ndarray) -> tuple[float, float]:
  """A heatmap's x range over `steps` (counted from 0; shown from 1): one sampled step spans one step
  (an equal low and high warned "identical xlims" on a 1-step run's standard error)."""
  first, last = float(steps[0] + 1), float(steps[-1] + 1)
  return (first - 0.5, first + 0.5) if last == first else (first, last)


def plot_loss(rows: list[dict[str, Any]], path: Path) -> Path:
  """Writes the loss curve as a PNG (matplotlib, no display needed)."""
  plt = _plt()
  steps = [r["step"] + 1 for r in rows if r.get("loss") is not None]
  losses = [r["loss"] for r in rows if r.get("loss") is not None]
  evals = [(r["step"] + 1, r["eval_loss"]) for r in rows if is_eval(r) and r["eval_loss"] is not None]
  fig, ax = plt.subplots(figsize=(6, 3.5), dpi=120)
  ax.plot(steps, losses, lw=1.5, marker=_one_point(steps), label="training loss")
  if evals:
    ax.plot(*zip(*evals, strict=True), "o-", lw=1.5, label="eval loss (held-out)")
    ax.legend()
  ax.set_xlabel("step")
  _whole(ax.xaxis)
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
  extent = (*_step_range(steps), -0.5, experts - 0.5)
  image = None
  for i, ax in enumerate(axes.flat):
    if i >= layers:
      ax.axis("off")
      continue
    image = ax.imshow(rel[:, i, :].T, aspect="auto", origin="lower", cmap="RdBu_r", vmin=0, vmax=2, extent=extent)
    ax.set_title(f"MoE layer {i}", fontsize=8)
    ax.tick_params(labelsize=6)
    _whole(ax.xaxis)
    _whole(ax.yaxis)
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
      ax.plot(x, values_SL[:, i], lw=1.2, marker=_one_point(x), label=f"layer {i}")
  else:
    worst = int(np.argmax(values_SL.max(axis=0)))
    ax.fill_between(x, values_SL.min(axis=1), values_SL.max(axis=1), alpha=0.25, label="min-max over layers")
    ax.plot(x, np.median(values_SL, axis=1), lw=1.2, marker=_one_point(x), label="median layer")
    ax.plot(x, values_SL[:, worst], lw=1.2, marker=_one_point(x), label=f"layer {worst} (the highest)")
  ax.set_ylabel(label, fontsize=8)
  ax.grid(alpha=0.3)
  ax.legend(fontsize=6, ncol=2)


def plot_balance(steps: np.ndarray, load_SLE: np.ndarray, bias_SL: np.ndarray, path: Path) -> Path:
  plt = _plt()
  fig, (top, bottom) = plt.subplots(2, 1, figsize=(7, 5.5), dpi=100, sharex=True)
  _per_layer(top, steps, relative_load(load_SLE).max(axis=-1), "max / mean expert load")
  _per_layer(bottom, steps, bias_SL, "mean |routing bias|")
  bottom.set_xlabel("step")
  _whole(bottom.xaxis)
  top.set_title(f"{path.parent.name}: MoE balance", fontsize=9)
  fig.tight_layout()
  fig.savefig(path)
  plt.close(fig)
  return path


def moe_plots(run_dir: Path, layers: Layers) -> list[Path]:
  """moe_load.png and moe_balance.png in `run_dir` from `read_layers` of its moe_load.jsonl ([] without)."""
  if layers is None:
    return []
  steps, load, bias = layers
  return [plot_load(steps, load, run_dir / LOAD_PNG), plot_balance(steps, load, bias, run_dir / BALANCE_PNG)]
