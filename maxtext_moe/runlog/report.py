"""`maxtext-moe report RUN_DIR`: a run's pictures and summary rebuilt from its row files alone, so a run
copied off a cluster can be looked at anywhere."""

import json
from pathlib import Path
from typing import Any

from maxtext_moe.errors import UserError
from maxtext_moe.runlog.files import LOAD, METRICS, read_jsonl, read_layers
from maxtext_moe.runlog.plots import LOSS_PNG, moe_plots, plot_loss
from maxtext_moe.runlog.summary import summarize


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
    return {"run_dir": str(run_dir)} | summarize(rows, layers=layers), written
  except UserError:
    raise  # already the one line (a UserError is a ValueError)
  except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
    raise UserError(f"{foreign} ({type(e).__name__}: {str(e).splitlines()[0][:120]})") from None
