"""`plan MODEL --gpu GPU --nodes N --search --verify K`: the search's first K layouts compiled by XLA:GPU as the
recipe files `--write` writes, ranked again by what compiles to fit; the refusals; and an interrupted verify
that leaves nothing behind."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from conftest import REPO, run_cli
from maxtext_moe.errors import UserError
from maxtext_moe.gpu_compile.command import plugin_installed
from maxtext_moe.gpu_compile.verify import GIB, Verified, first_fitting, reranked

needs_plugin = pytest.mark.skipif(not plugin_installed(), reason="needs jax-cuda12-plugin (./setup.sh --gpu-compile)")


def _found(name: str, gib: float) -> SimpleNamespace:
  return SimpleNamespace(name=name, device_gib=gib)


def _verified(rank: int, found: SimpleNamespace, compiled_gib: float | None, error: str | None = None) -> Verified:
  compiled = None if compiled_gib is None else int(compiled_gib * GIB)
  return Verified(rank, found, "", compiled, int(72.8 * GIB), error, 60.0)


def test_what_compiles_to_fit_ranks_first_then_what_was_not_compiled_then_the_rest():
  found = [_found(n, 70.0) for n in "abcde"]
  verified = [_verified(1, found[0], 86.1), _verified(2, found[1], 62.7), _verified(3, found[2], None, "XLA failed")]
  assert [f.name for f in reranked(found, verified)] == ["b", "d", "e", "a", "c"]
  assert first_fitting(verified).found.name == "b"
  assert verified[0].row() == {
    "rank": 1, "planned_gib": 70.0, "compiled_gib": 86.1, "usable_gib": 72.8, "fits": False, "error": None,
    "compile_s": 60.0,
  }  # fmt: skip
  assert round(verified[1].planner_error, 3) == round((70.0 - 62.7) / 62.7, 3)


def test_none_compiling_to_fit_is_one_line_naming_each():
  found = [_found(n, 70.0) for n in "ab"]
  with pytest.raises(UserError) as e:
    first_fitting([_verified(1, found[0], 86.1), _verified(2, found[1], None, "XLA:GPU could not compile")])
  assert str(e.value) == (
    "none of the first 2 layouts compiles to fit (#1 86.1 GiB of 72.8; #2 XLA:GPU could not compile): verify more "
    "of them (--verify 4), or use more nodes (--nodes)"
  )


@pytest.mark.parametrize(
  ("args", "expected"),
  [
    (["plan", "deepseek3-tiny", "--gpu", "h100", "--verify", "2"], "--verify K compiles the search's first K layouts"),
    (["plan", "h100x8/qwen3-30b-a3b", "--verify", "1"], "--verify K compiles the search's first K layouts"),
    (["plan", "deepseek3-tiny", "--gpu", "h100", "--search", "--verify", "0"], "--verify must be >= 1"),
    (["plan", "deepseek3-tiny", "--gpu", "h100", "--search", "--verify", "-3"], "--verify must be >= 1"),
  ],
)
def test_verify_refusals_are_one_line(tmp_path, args, expected):
  r = run_cli([*args, "--write", str(tmp_path / "F.yml")] if "--search" in args else args, cwd=tmp_path)
  assert r.returncode == 2, r.stderr
  assert r.stderr.startswith(f"maxtext-moe: error: {expected}") and r.stderr.count("\n") == 1, r.stderr
  assert r.stdout == "" and not (tmp_path / "F.yml").exists()


@pytest.mark.ci
@needs_plugin
def test_verify_compiles_the_file_it_writes_and_says_so(tmp_path):
  out = tmp_path / "F.yml"
  args = ["plan", "deepseek3-tiny", "--gpu", "h100", "--nodes", "1", "--search", "--top", "3"]
  r = run_cli([*args, "--verify", "1", "--write", str(out), "--json"], cwd=tmp_path, timeout=1200)
  assert r.returncode == 0, r.stderr
  result = yaml.safe_load(r.stdout)
  (row,) = result["verified"]
  assert row["rank"] == 1 and row["fits"] and row["error"] is None and 0 < row["compiled_gib"] < row["usable_gib"]
  assert "[1/1] compiling layout 1" in r.stderr and "[1/1] FITS:" in r.stderr
  text = out.read_text()
  assert f"Compiled by XLA:GPU (plan --verify): {row['compiled_gib']:.1f} GiB per GPU of" in text
  keys = yaml.safe_load(text)
  first = dict(o.split("=", 1) for o in result["layouts"][0]["overrides"])
  # The layout's keys, but the cross-node data axis, written -1 so that --nodes scales the file further.
  assert keys.pop("dcn_data_parallelism") == -1 and first.pop("dcn_data_parallelism") == "1"
  assert {k: keys[k] for k in first} == {k: yaml.safe_load(v) for k, v in first.items()}


def _sigint_default() -> None:
  signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.ci
@needs_plugin
def test_an_interrupted_verify_writes_nothing_and_leaves_no_compile_running(tmp_path):
  out = tmp_path / "F.yml"
  args = ["plan", "deepseek3-tiny", "--gpu", "h100", "--nodes", "1", "--search", "--verify", "1", "--write", str(out)]
  env = {**os.environ, "PYTHONPATH": str(REPO)}
  proc = subprocess.Popen(
    [sys.executable, "-m", "maxtext_moe", *args], cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True,
    preexec_fn=_sigint_default,  # a runner in the background ignores SIGINT, and its children would too
  )  # fmt: skip
  line, deadline = "", time.monotonic() + 900
  while "compiling layout 1" not in line and time.monotonic() < deadline:
    line = proc.stderr.readline()
  assert "compiling layout 1" in line, "the verify never started compiling"
  time.sleep(5)  # the child compile is under way
  proc.send_signal(signal.SIGINT)
  rest = proc.communicate(timeout=120)[1]
  assert proc.returncode == 130 and rest.strip().endswith("maxtext-moe: interrupted"), rest
  assert not out.exists() and not list(Path(tmp_path).glob(".F.yml*"))
  ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True).stdout
  assert "maxtext-moe-verify-" not in ps, "a verify compile outlived its parent"
