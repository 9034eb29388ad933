"""How often a run saves, and what a failure can cost.

MaxText's own `checkpoint_period` is 10,000 steps: on a 671B layout at 6-10 s a step that is 17-28 hours
of work a node failure throws away, which is what resume exists to prevent. Our GPU recipes and the ones
`plan --search --write` writes carry a period from time instead: about `MINUTES` of steps by the step-time
model (`period_for`), rounded down to two significant digits; the recipes we ship aim at `SHIPPED` minutes,
so that a refinement of the step-time model by up to a fifth keeps them under `MINUTES`. A save costs a
pause of the state's size over the filesystem's bandwidth (docs/cluster.md), so much shorter periods trade
speed for little.

What the kept checkpoints take on disk (`Retention`, on the line `plan --check`, `k8s` and the sbatch print):
a run saves at step 0, every `checkpoint_period` steps and at its last step, and keeps them all unless
`max_num_checkpoints_to_keep` keeps the newest N (Orbax deletes the oldest once a newer save completes,
so N + 1 are on disk while a save completes).
"""

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

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


def check_kept(cfg: Any) -> None:
  """max_num_checkpoints_to_keep is Orbax's LatestN: the newest N checkpoints stay, each older one is
  deleted once a newer save has completed. N < 1 deletes every checkpoint right after its save, the run's
  last one included (LatestN(0) keeps none; Orbax's v0 manager refused negative values, the v1 one MaxText
  0.2.5 uses does not)."""
  keep = getattr(cfg, "max_num_checkpoints_to_keep", None)
  if keep is not None and int(keep) < 1:
    raise ValueError(
      f"max_num_checkpoints_to_keep={keep} would delete every checkpoint as soon as it is saved, the last one "
      "included; keep at least 1 (2 leaves a resume the previous one to fall back to), or unset it to keep all"
    )


def saves(steps: int, period: int) -> int:
  """Checkpoints a run of `steps` steps writes as MaxText's loop decides: steps 0, period, 2 x period, ...
  and its last step (steps - 1) when that is not one of them. 0 where steps is unknown (-1: MaxText's
  learning_rate_schedule_steps)."""
  if steps <= 0 or period <= 0:
    return 0
  return len(range(0, steps, period)) + int((steps - 1) % period != 0)


@dataclass(frozen=True)
class Retention:
  """How many checkpoints a run leaves on disk: its keys `steps`, `checkpoint_period`,
  `max_num_checkpoints_to_keep` (None: every one) and `enable_checkpointing`."""

  steps: int
  period: int
  keep: int | None
  enabled: bool = True

  # The keys it is read from, at MaxText's defaults (base.yml) where a layer leaves one unset.
  KEYS: ClassVar[dict[str, Any]] = {
    "steps": 150_001,
    "checkpoint_period": MAXTEXT_DEFAULT,
    "max_num_checkpoints_to_keep": None,
    "enable_checkpointing": True,
  }

  @classmethod
  def of(cls, keys: Mapping[str, Any]) -> "Retention":
    """From `KEYS`' values in `keys` (None or absent: MaxText's default)."""
    k = {name: default if keys.get(name) is None else keys[name] for name, default in cls.KEYS.items()}
    keep = None if k["max_num_checkpoints_to_keep"] is None else int(k["max_num_checkpoints_to_keep"])
    return cls(int(k["steps"]), int(k["checkpoint_period"]), keep, bool(k["enable_checkpointing"]))

  def kept(self, checkpoint_bytes: int) -> tuple[int, int]:
    """(checkpoints on disk at the run's end, the bytes they take), each `checkpoint_bytes`."""
    n = saves(self.steps, self.period) if self.enabled else 0
    n = n if self.keep is None else min(n, self.keep)
    return n, n * checkpoint_bytes

  def on_disk(self, checkpoint_bytes: int, size: Callable[[int], str]) -> str:
    """What the kept checkpoints take, in words; `size` formats bytes."""
    n, total = self.kept(checkpoint_bytes)
    if not self.enabled:
      return "checkpointing is off"
    if self.keep is None:
      every = f"all {n} checkpoints of its {self.steps:,} steps stay, {size(total)} on disk" if n else "every one stays"
      return f"{every} (max_num_checkpoints_to_keep=N keeps the newest N)"
    return (
      f"the newest {n} checkpoint(s) stay (max_num_checkpoints_to_keep={self.keep}), {size(total)} on disk, "
      f"{size(total + checkpoint_bytes)} while a save completes"
    )
