"""The range to plan on: how the step-time model has read published runs, printed beside its figure.

The model predicts; the sixteen published runs of `bench timemodel` (`points.py`) say how far its
predictions have been from what was measured, predicted / published, per point. `plan --time` prints that
spread over all of them and over the runs on the same GPU generation as the plan's, and the plan's figure
divided by the generation's highest and lowest ratios: what the figure would be had the model erred on
this plan as on those runs. Nothing is fitted: the ratios are read, not folded into the model.

The ratios are stored (`published_ratios.json`, written by `scripts/published_ratios.py`; predicting the
sixteen points takes half a minute, too long for every `plan --time`), and tests/test_step_time_costs.py
fails when the stored ones and the model's own differ.
"""

import json
import statistics
from pathlib import Path
from typing import Any

RATIOS_PATH = Path(__file__).with_name("published_ratios.json")
GENERATION = {"hopper": "Hopper (H100, H200, GH200)", "blackwell": "Blackwell (B200, B300, GB200, GB300)"}


def stored() -> list[dict[str, Any]]:
  """[{"point", "arch", "ratio"}] as last written."""
  return json.loads(RATIOS_PATH.read_text(encoding="utf-8"))["points"]


def of(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
  """What the stored file holds of `points.published()`'s rows."""
  return [{"point": r["point"], "arch": r["arch"], "ratio": r["ratio"]} for r in rows]


def lines(tokens_per_s: float, arch: str) -> list[str]:
  """The spread's lines for a plan of `tokens_per_s` per GPU on a GPU of `arch` ('hopper', 'blackwell')."""
  rows = stored()
  every = [r["ratio"] for r in rows]
  same = [r["ratio"] for r in rows if r["arch"] == arch]
  out = [
    f"  published runs: the model read {min(every):.2f}-{max(every):.2f}x what {len(every)} of them measured "
    f"(median {statistics.median(every):.2f}; bench timemodel)"
  ]
  if same:
    out.append(
      f"  on {GENERATION[arch]}: {min(same):.2f}-{max(same):.2f}x over {len(same)} runs (median "
      f"{statistics.median(same):.2f}): plan on {tokens_per_s / max(same):,.0f}-{tokens_per_s / min(same):,.0f} "
      "tokens/s per GPU, this figure over those ratios"
    )
  return out
