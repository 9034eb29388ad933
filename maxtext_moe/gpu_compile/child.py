"""`maxtext-moe compile RECIPE --json` in a child process, for callers that compile more than one program
(`plan --search --verify`, `bench plan --gpu`): XLA reads its flags once per process, when the backend
starts, and each recipe has its own flag profile, so every compile gets a process of its own.

The child is run by this environment's Python, or by the Transformer Engine compile environment's
(`te_python()`: `./setup.sh --gpu-compile-te` makes `.venv-te`), which compiles TE's own kernels where this
one substitutes them. A stop of the parent (Ctrl-C, SIGTERM under `signals.under_cleanup`) ends the child
too: a compile takes minutes, and nothing of it is kept.
"""

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TE_PYTHON = Path(__file__).resolve().parents[2] / ".venv-te" / "bin" / "python"


def te_python() -> Path | None:
  """The TE compile environment's Python, where `./setup.sh --gpu-compile-te` made it (a checkout's
  `.venv-te`), else None."""
  return TE_PYTHON if TE_PYTHON.is_file() else None


@dataclass(frozen=True)
class ChildCompile:
  """A child's compile: its report (`compile --json`), or the one line it ended with."""

  report: dict[str, Any] | None
  error: str | None
  seconds: float


def compile_in_child(recipe: str, overrides: list[str], *, python: str | None = None) -> ChildCompile:
  """`maxtext-moe compile RECIPE OVERRIDES --json` run by `python` (default: this one), in this directory,
  with the parent's XLA_FLAGS and JAX_PLATFORMS left out (the child sets its own)."""
  env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
  cmd = [python or sys.executable, "-m", "maxtext_moe", "compile", recipe, *overrides, "--json"]
  start = time.monotonic()
  proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  try:
    out, err = proc.communicate()
  except BaseException:
    proc.kill()  # an interrupted verify keeps nothing: the compile's minutes are not waited for
    proc.wait()
    raise
  seconds = time.monotonic() - start
  lines = [ln for ln in out.splitlines() if ln.startswith("{")]
  if proc.returncode in (0, 1) and lines:  # 1: compiled, and does not fit
    return ChildCompile(json.loads(lines[-1]), None, seconds)
  said = [ln for ln in err.splitlines() if ln.strip()]
  last = said[-1] if said else f"the compile ended with exit code {proc.returncode} and said nothing"
  return ChildCompile(None, last.removeprefix("maxtext-moe: error: ").removeprefix("maxtext-moe: "), seconds)
