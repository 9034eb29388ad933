"""How often a run saves, and what a failure can cost.

MaxText's own `checkpoint_period` is 10,000 steps: on a 671B layout at 6-10 s a step that is 17-28 hours
of work a node failure throws away, which is what resume exists to prevent. Our GPU recipes and the ones
`plan --search --write` writes carry a period from time instead: about `MINUTES` of steps by the step-time
model (`period_for`), rounded down to two significant digits; the recipes we ship aim at `SHIPPED` minutes,
so that a refinement of the step-time model by up to a fifth keeps them under `MINUTES`. A save costs a
pause of the state's size over the filesystem's bandwidth (docs/cluster.md), so much shorter periods trade
speed for little.
"""

import math
from typing import Any

MINUTES = 30  # the work a failure may cost at most, by the step-time model
SHIPPED = 25  # what a shipped recipe's period aims at: MINUTES with room for the model's refinements
MAXTEXT_DEFAULT = 10_000  # MaxText's base.yml checkpoint_period


def period_for(step_s: float, minutes: float = MINUTES) -> int:
  """Steps in about `minutes` at `step_s` seconds a step, rounded down to two significant digits (>= 1).

  Example: period_for(6.27) -> 280 (287 steps in 30 minutes); period_for(0.33) -> 5400."""
  raw = minutes * 60 / step_s
  if raw < 10:
    return max(1, int(raw))
  unit = 10 ** (int(math.log10(raw)) - 1)
  return int(raw // unit * unit)


def at_risk(cfg: Any, step_s: float | None = None) -> str:
  """One line: how often the run saves and the work a failure can cost (in minutes where `step_s`, the
  step-time model's seconds a step, is known)."""
  period, steps = int(cfg.checkpoint_period), int(cfg.steps)
  if not bool(getattr(cfg, "enable_checkpointing", True)):
    return "checkpointing is off (enable_checkpointing=false): a failure loses the whole run"
  minutes = _minutes(period * step_s) if step_s else ""
  if period >= steps:
    if period == MAXTEXT_DEFAULT:
      return (
        f"checkpoint_period={period} (MaxText's default) >= steps={steps}: no checkpoint before the last step, so "
        f"a failure loses all the run's work; set checkpoint_period (about {MINUTES} minutes of steps: "
        "docs/recipes.md)"
      )
    run = _minutes(steps * step_s) if step_s else ""
    return (
      f"checkpoint_period={period} >= steps={steps}: the run saves at its last step only; a failure loses it all{run}"
    )
  return f"checkpoints every {period} steps of {steps}: a failure costs at most {period} steps{minutes}"


def _minutes(seconds: float) -> str:
  """', about N minutes by the step-time model' (under a minute: 'under a minute')."""
  m = round(seconds / 60)
  said = "under a minute" if m < 1 else "about 1 minute" if m == 1 else f"about {m:,} minutes"
  return f", {said} by the step-time model"
