"""`plan MODEL --gpu GPU --nodes N --search --verify K`: the search's first K layouts compiled by XLA:GPU on
this machine, each as the very recipe file `--write` would write, so that what is written is what compiled.

Each compile runs in a child process (`child.py`; with Transformer Engine's kernels where `.venv-te`
exists) and takes minutes: a line says when each starts and ends. The layouts are then ranked again by
what compiles to fit: those that do, in the search's order; then those not compiled; then those that
compiled and do not fit, or did not compile. An interrupted verify writes nothing (the caller writes only
after `verify` returns) and leaves no child running.
"""

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from maxtext_moe import signals
from maxtext_moe.errors import UserError
from maxtext_moe.gpu_compile.child import compile_in_child, te_python

GIB = 2**30


@dataclass(frozen=True)
class Verified:
  """One layout of the search (`rank` 1 the fastest) as XLA:GPU compiled it: its recipe text, the device bytes
  per GPU of the program and the usable memory (`compile`'s report), or why it did not compile."""

  rank: int
  found: Any  # steptime.fitting.Found
  text: str
  compiled_bytes: int | None
  usable_bytes: int | None
  error: str | None
  seconds: float

  @property
  def fits(self) -> bool:
    return (
      self.compiled_bytes is not None and self.usable_bytes is not None and self.compiled_bytes <= self.usable_bytes
    )

  @property
  def compiled_gib(self) -> float | None:
    return None if self.compiled_bytes is None else self.compiled_bytes / GIB

  @property
  def planner_error(self) -> float | None:
    """(planned - compiled) / compiled, the planner's relative error on this program."""
    if self.compiled_bytes is None:
      return None
    return (self.found.device_gib * GIB - self.compiled_bytes) / self.compiled_bytes

  def row(self) -> dict[str, Any]:
    return {
      "rank": self.rank,
      "planned_gib": round(self.found.device_gib, 1),
      "compiled_gib": None if self.compiled_gib is None else round(self.compiled_gib, 1),
      "usable_gib": None if self.usable_bytes is None else round(self.usable_bytes / GIB, 1),
      "fits": self.fits,
      "error": self.error,
      "compile_s": round(self.seconds, 1),
    }


def check_count(count: int | None, *, search: bool) -> None:
  """`--verify K` as given: with --search, K >= 1, and XLA:GPU's compiler installed (one line otherwise)."""
  if count is None:
    return
  if not search:
    raise UserError(
      "--verify K compiles the search's first K layouts: plan MODEL --gpu GPU --nodes N --search --verify K"
    )
  if count < 1:
    raise UserError(f"--verify must be >= 1 (the layouts to compile), got {count}")
  from maxtext_moe.gpu_compile.command import plugin_installed  # pylint: disable=import-outside-toplevel

  if not plugin_installed():
    raise UserError("--verify compiles with XLA:GPU's compiler (the jax-cuda12 plugin): run ./setup.sh --gpu-compile")


def verify(found: list[Any], count: int, *, text_of: Any, progress: IO[str]) -> list[Verified]:
  """Compiles the first `count` of `found` (ranked layouts), each written by `text_of(found)` as a recipe
  file, one after the other; a line on `progress` as each starts and ends."""
  python = te_python()
  kernels = "Transformer Engine's kernels (.venv-te)" if python else "tokamax for TE's grouped GEMM (no .venv-te)"
  todo = found[:count]
  print(
    f"verifying the first {len(todo)} layout(s) with XLA:GPU on this machine, {kernels}; a compile takes "
    "about 1 to 6 minutes on 2 cores",
    file=progress,
    flush=True,
  )
  out: list[Verified] = []
  with signals.under_cleanup(), tempfile.TemporaryDirectory(prefix="maxtext-moe-verify-") as tmp:
    for rank, chosen in enumerate(todo, 1):
      text = text_of(chosen)
      path = Path(tmp) / f"layout-{rank}.yml"
      path.write_text(text, encoding="utf-8")
      print(f"  [{rank}/{len(todo)}] compiling layout {rank} ({_words(chosen)}) ...", file=progress, flush=True)
      done = compile_in_child(str(path), [], python=str(python) if python else None)
      out.append(_verified(rank, chosen, text, done))
      print(f"  [{rank}/{len(todo)}] {_outcome(out[-1])}", file=progress, flush=True)
  return out


def _verified(rank: int, chosen: Any, text: str, done: Any) -> Verified:
  report = done.report or {}
  return Verified(
    rank, chosen, text, report.get("device_bytes"), report.get("usable_hbm_bytes"), done.error, done.seconds
  )


def _words(chosen: Any) -> str:
  lay = chosen.layout
  across = f", EP {lay.dcn_ep} across" * (lay.dcn_ep > 1) + f", {lay.stages} stages" * (lay.stages > 1)
  return f"EP {lay.ep} x FSDP {lay.fsdp}{across}, batch {lay.batch}, {lay.remat} remat, offload {lay.offload}"


def _outcome(v: Verified) -> str:
  took = time.strftime("%M:%S", time.gmtime(v.seconds))
  if v.compiled_bytes is None:
    return f"did not compile ({took}): {v.error}"
  verdict = "FITS" if v.fits else "DOES NOT FIT"
  usable = v.usable_bytes / GIB if v.usable_bytes else float("nan")
  return (
    f"{verdict}: {v.compiled_gib:.1f} GiB per GPU of {usable:.1f} usable, planned {v.found.device_gib:.1f} "
    f"({v.planner_error:+.1%}) ({took})"
  )


def _standing(v: Verified | None) -> int:
  """0: compiled to fit; 1: not compiled; 2: compiled and does not fit, or did not compile."""
  return 0 if v is not None and v.fits else 1 if v is None else 2


def reranked(found: list[Any], verified: list[Verified]) -> list[Any]:
  """`found` with what compiled to fit first (in the search's order), then what was not compiled, then what
  compiled and does not fit or did not compile."""
  by_rank = {v.rank: v for v in verified}
  order = sorted(range(len(found)), key=lambda i: (_standing(by_rank.get(i + 1)), i))
  return [found[i] for i in order]


def first_fitting(verified: list[Verified]) -> Verified:
  """The fastest layout that compiled to fit, or one line: none of them did."""
  fitting = [v for v in verified if v.fits]
  if fitting:
    return fitting[0]
  seen = "; ".join(
    f"#{v.rank} {v.compiled_gib:.1f} GiB of {v.usable_bytes / GIB:.1f}" if v.compiled_bytes else f"#{v.rank} {v.error}"
    for v in verified
  )
  raise UserError(
    f"none of the first {len(verified)} layouts compiles to fit ({seen}): verify more of them (--verify "
    f"{len(verified) * 2}), or use more nodes (--nodes)"
  )
