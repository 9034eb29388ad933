#!/usr/bin/env python3
"""Write maxtext_moe/steptime/published_ratios.json: the step-time model's predicted / published ratio for
each point of `bench timemodel` (`steptime/spread.py` prints their spread beside `plan --time`). Run it
after changing the model; tests/test_step_time_costs.py fails while the stored ratios and the model's
differ."""

import json

from maxtext_moe.steptime import spread
from maxtext_moe.steptime.points import published


def main() -> None:
  rows = spread.of(published())
  spread.RATIOS_PATH.write_text(json.dumps({"points": rows}, indent=1) + "\n", encoding="utf-8")
  print(f"wrote {len(rows)} ratios to {spread.RATIOS_PATH}")


if __name__ == "__main__":
  main()
