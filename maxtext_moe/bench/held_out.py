"""`maxtext-moe bench plan --held-out`: the planner against XLA:GPU's compile on the layouts users take:
every shipped GPU recipe at its own nodes, and the search's first three layouts on six clusters (H100, H200,
B200, GB200 and GH200 nodes; EP-heavy and FSDP-heavy, with and without pipeline stages, and a fine-tune).

Each case is compiled in a child process (`gpu_compile.child`, this environment's XLA:GPU: Transformer
Engine's kernels substituted as `compile` says, and given to the planner so) as the recipe file it is (a
search's layouts as the very files `plan --search --write` writes), twice: for the GPU's usable memory
(does it fit) and for the planner's figure (`compile --memory`: what XLA keeps when memory is what the
planner says; given more, its scheduler spends the rest on overlap). The planner's figure is the one `compile`
prints beside XLA's (`gpu_compile.report.planner_figures`). tests/test_plan_held_out.py (extended tier)
holds each within 10%; docs/planner.md lists the last table. A shipped recipe compiles in 1 to 8 minutes on
2 cores, a search in 1 to 3 more: the whole set takes hours.
"""

import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from maxtext_moe.bench.report import emit
from maxtext_moe.errors import UserError
from maxtext_moe.gpu_compile.child import compile_in_child

GIB = 2**30
TOLERANCE = 0.10  # |planned - compiled| / compiled, each case
# The searches: (MODEL, --gpu, --nodes). MODEL may be a recipe (its own keys searched: the fine-tune).
SEARCHES: dict[str, tuple[str, str | None, int]] = {
  "h100 32 nodes deepseek3-671b": ("deepseek3-671b", "h100", 32),
  "h200 16 nodes qwen3-235b-a22b": ("qwen3-235b-a22b", "h200", 16),
  "b200 2 nodes qwen3-30b-a3b": ("qwen3-30b-a3b", "b200", 2),
  "gb200 16 nodes deepseek3-671b": ("deepseek3-671b", "gb200", 16),
  "gh200 2 nodes qwen3-30b-a3b": ("qwen3-30b-a3b", "gh200", 2),
  "h100 2 nodes mixtral-8x7b-sft": ("h100x8/mixtral-8x7b-sft", None, 2),
}
FIRST = 3  # of each search


@dataclass(frozen=True)
class Case:
  """One program: a name, the recipe (a shipped name or a file) and overrides `compile` takes."""

  name: str
  recipe: str
  overrides: tuple[str, ...] = ()


def shipped() -> list[Case]:
  """Every shipped GPU recipe at its own nodes."""
  from maxtext_moe.config.recipes import list_recipes  # pylint: disable=import-outside-toplevel

  return [Case(r, r) for r in list_recipes() if not r.startswith("cpu/")]


def searched(name: str, folder: Path) -> list[Case]:
  """The first FIRST layouts `plan MODEL --gpu GPU --nodes N --search` ranks for SEARCHES[name], written as
  recipe files into `folder`."""
  from maxtext_moe.steptime import search  # pylint: disable=import-outside-toplevel

  model, gpu, nodes = SEARCHES[name]
  base = search.base_of(model, gpu, nodes, [])
  found, _, ctx = search.search(base)
  out = []
  for rank, chosen in enumerate(found[:FIRST], 1):
    path = folder / f"{name.replace(' ', '-')}-{rank}.yml"
    path.write_text(search.recipe_text(base, chosen, command="bench plan --held-out", hbm_gib=ctx.hbm_gib))
    out.append(Case(f"{name} #{rank}", str(path)))
  return out


def measure(case: Case) -> dict[str, Any]:
  """The case compiled twice: for the GPU's usable memory, as it runs (whether it fits: XLA:GPU's scheduler
  spends memory it has to spare on overlap), and for the memory the planner says it needs (`compile
  --memory`): the planner's relative error is against that program."""
  done = compile_in_child(case.recipe, list(case.overrides))
  if done.report is None:
    return {"case": case.name, "error": done.error, "compile_s": round(done.seconds)}
  r = done.report
  need = compile_in_child(case.recipe, [*case.overrides, "--memory", "planned"])
  if need.report is None:
    return {"case": case.name, "error": need.error, "compile_s": round(done.seconds + need.seconds)}
  n = need.report  # its rel_error is the planner's against this program (`gpu_compile.report.compare`)
  return {
    "case": case.name,
    "devices": r["devices"],
    "layout": r["layout"],
    "full_gib": round(r["device_bytes"] / GIB, 2),
    "compiled_gib": round(n["device_bytes"] / GIB, 2),
    "planned_gib": round(n["planner_device_bytes"] / GIB, 2),
    "rel_error": n["rel_error"],
    "usable_gib": round(r["usable_hbm_bytes"] / GIB, 2),
    "fits": r["fits"],
    "planner_fits": r["planner"]["fits"],
    "compile_s": round(done.seconds + need.seconds),
  }


def run(*, out: IO[str], as_json: bool = False, only: str | None = None) -> dict[str, Any]:
  """Every held-out case (or those whose name contains `only`), a table and the JSON."""
  with tempfile.TemporaryDirectory(prefix="maxtext-moe-held-out-") as tmp:
    cases = [c for c in shipped() if only is None or only in c.name]
    for name in SEARCHES:
      if only is None or only in name:
        cases += searched(name, Path(tmp))
    if not cases:
      raise UserError(f"no held-out case contains {only!r}; the searches: {', '.join(SEARCHES)}")
    rows = [measure(c) for c in cases]
  worst = max((abs(r["rel_error"]) for r in rows if "rel_error" in r), default=0.0)
  result = {"cases": rows, "max_rel_error": worst, "tolerance": TOLERANCE}
  emit(_table(rows), result, as_json=as_json, out=out, width=160)
  return result


def _table(rows: list[dict[str, Any]]) -> Any:
  from rich.table import Table  # pylint: disable=import-outside-toplevel

  t = Table(title="Planner vs XLA:GPU, the held-out set (GiB per GPU; compiled without a GPU)")
  cols = (
    "case",
    "GPUs",
    "XLA at usable",
    "XLA at planned",
    "planned",
    "planner vs XLA",
    "usable",
    "fits (XLA / planner)",
  )
  for col in (*cols, "s"):
    t.add_column(col, justify="left" if col == "case" else "right")
  for r in rows:
    if "error" in r:
      t.add_row(r["case"], "", "did not compile", "", "", "", "", "", str(r["compile_s"]))
      continue
    t.add_row(
      r["case"], str(r["devices"]), f"{r['full_gib']:.1f}", f"{r['compiled_gib']:.1f}", f"{r['planned_gib']:.1f}",
      f"{r['rel_error']:+.1%}",
      f"{r['usable_gib']:.1f}", f"{r['fits']} / {r['planner_fits']}", str(r["compile_s"]),
    )  # fmt: skip
  return t
