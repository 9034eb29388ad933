"""`maxtext-moe config RECIPE` prints what it printed when the golden files were written, for every shipped
recipe on its own nodes and on twice as many (`--nodes`): the whole resolution (YAML layers, model file,
overrides, the node layout, MaxText's derivations and our checks) held still while its code moves.

A deliberate change to a recipe or to how a recipe resolves rewrites them, and its diff is then read like
code:  .venv/bin/python tests/test_config_golden.py --write
"""

import argparse
import difflib
import io
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
GOLDEN = Path(__file__).resolve().parent / "golden" / "config"
WEIGHTS = "load_parameters_path=gs://bucket/checkpoint/items"
_STAMPS = [
  (re.compile(r"\d{8}-\d{6}"), "<stamp>"),  # our run name's second
  (re.compile(r"\d{4}-\d\d-\d\d-\d\d-\d\d"), "<minute>"),  # MaxText's default run name's minute
]


def _recipes() -> list[str]:
  from maxtext_moe.config.recipes import list_recipes

  return list_recipes()


def _file(name: str, twice: bool) -> Path:
  return GOLDEN / f"{name.replace('/', '__')}{'__twice_the_nodes' if twice else ''}.txt"


def printed(argv: list[str]) -> str:
  """What `maxtext-moe ARGV` prints (its stdout, or its one error line), with this checkout's path and
  the clock's run names made neutral."""
  from maxtext_moe.cli import build_parser
  from maxtext_moe.errors import UserError

  ns = build_parser().parse_args(argv)
  out = io.StringIO()
  try:
    ns.func(ns, out)
  except UserError as e:
    out.write(f"error: {e}\n")
  text = out.getvalue().replace(str(REPO), "<repo>")
  for pattern, neutral in _STAMPS:
    text = pattern.sub(neutral, text)
  return text


def both(name: str) -> tuple[str, str]:
  """`config NAME` and `config NAME --nodes 2N`, N the nodes the first printed; a fine-tuning recipe with
  weights to start from (a remote path: a local one must exist)."""
  argv = ["config", name]
  own = printed(argv)
  if own.startswith("error: finetune=true needs weights"):
    argv.append(WEIGHTS)
    own = printed(argv)
  nodes = re.search(r"^  nodes: (\d+)$", own, re.M)
  return own, printed([*argv, "--nodes", str(2 * int(nodes.group(1)) if nodes else 2)])


def _same(want: str, got: str, what: str) -> None:
  diff = "".join(difflib.unified_diff(want.splitlines(True), got.splitlines(True), "golden", "now"))
  assert got == want, f"{what} resolves otherwise than its golden file:\n{diff}"


# In the README's suite (the rest, about 80 s, in the `ci` tier): the default, the 671B across 32 nodes, a
# rack's, and a fine-tuning one on its own data.
SUITE = ("cpu/deepseek3-tiny", "h100x8/deepseek3-671b", "gb200-nvl72/deepseek3-671b", "h200x8/qwen3-30b-a3b-sft")


@pytest.mark.parametrize("name", [n if n in SUITE else pytest.param(n, marks=pytest.mark.ci) for n in _recipes()])
def test_config_prints_what_it_printed(name):
  own, twice = both(name)
  _same(_file(name, False).read_text(), own, name)
  _same(_file(name, True).read_text(), twice, f"{name} on twice its nodes")


def test_every_golden_file_is_a_shipped_recipe_s():
  assert sorted(GOLDEN.glob("*.txt")) == sorted(_file(n, t) for n in _recipes() for t in (False, True))


def _write() -> None:
  GOLDEN.mkdir(parents=True, exist_ok=True)
  for old in GOLDEN.glob("*.txt"):
    old.unlink()
  for name in _recipes():
    for twice, text in zip((False, True), both(name), strict=True):
      _file(name, twice).write_text(text)


if __name__ == "__main__":
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--write", action="store_true", help="rewrite tests/golden/config/ from this checkout")
  if not parser.parse_args().write:
    sys.exit(parser.print_help() or 2)
  import conftest  # noqa: F401  # the suite's environment (8 CPU devices): MaxText's batch keys count them

  _write()
