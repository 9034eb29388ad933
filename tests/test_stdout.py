"""Standard output carries only a command's output, whole: shell exports, JSON, YAML or names (issue 18).
MaxText's import-time notices and everything else go to standard error."""

import io
import json
import os
import subprocess
import sys

import pytest
import yaml

from conftest import run_cli
from maxtext_moe.config import recipes


def test_flags_output_evals_cleanly_under_set_e(tmp_path):
  r = run_cli(["flags", "gb200-nvl72/deepseek3-671b"], cwd=tmp_path)
  assert r.returncode == 0, r.stderr[-2000:]
  sh = subprocess.run(
    ["bash", "-ec", 'eval "$1"; printf "%s" "$NCCL_MNNVL_ENABLE"', "_", r.stdout],
    capture_output=True,
    text=True,
    env={"PATH": os.environ["PATH"]},
    check=False,
  )
  assert (sh.returncode, sh.stderr, sh.stdout) == (0, "", "1")
  assert "[DECOUPLED NO-OP]" not in r.stdout + r.stderr, "MaxText's notices are dropped without --verbose"


@pytest.mark.ci
def test_plan_json_is_the_whole_stdout(tmp_path):
  r = run_cli(["plan", "gb200-nvl72/deepseek3-671b", "--json"], cwd=tmp_path)
  assert r.returncode == 0, r.stderr[-2000:]
  plan = json.loads(r.stdout)
  assert plan["fits"] is True and plan["recipe"] == "gb200-nvl72/deepseek3-671b"


@pytest.mark.ci
def test_config_is_yaml_and_recipes_are_names(tmp_path):
  r = run_cli(["config", "cpu/deepseek3-tiny", "steps=7"], cwd=tmp_path)
  assert r.returncode == 0, r.stderr[-2000:]
  assert yaml.safe_load(r.stdout)["changed_vs_maxtext"]["steps"] == 7
  r = run_cli(["recipes"], cwd=tmp_path)
  assert r.stdout.splitlines() == recipes.list_recipes()


def test_verbose_keeps_maxtexts_notices_on_stderr(tmp_path):
  r = run_cli(["--help"], cwd=tmp_path)
  assert r.returncode == 0 and "COMMAND" in r.stdout
  r = run_cli(["flags", "--verbose", "gb200-nvl72/deepseek3-671b", "--no-check"], cwd=tmp_path)
  assert r.returncode == 0 and "NO-OP]" in r.stderr and "NO-OP]" not in r.stdout


def test_bench_json_mode_prints_only_json_on_the_output_stream():
  from rich.table import Table

  from maxtext_moe.bench.report import emit

  out = io.StringIO()
  emit(Table("row"), {"ratio": 0.5}, as_json=True, out=out)
  assert json.loads(out.getvalue()) == {"ratio": 0.5}


def _stopped_early(commands: list[list[str]], cwd) -> list[tuple[list[str], int, str]]:
  """(command, exit code, standard error) of each command run with a reader that closed the pipe before the
  command wrote (an output shorter than the pipe's buffer is written whole before a reader that stops after
  one line closes it, so that would not break the pipe): the first write breaks it."""
  env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # --help waits in Python's buffer
  procs = [
    subprocess.Popen(  # pylint: disable=consider-using-with  # all at once, each waited for below
      [sys.executable, "-m", "maxtext_moe", *args],
      cwd=cwd,
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
    )
    for args in commands
  ]
  for p in procs:
    p.stdout.close()
  errs = [p.communicate(timeout=600)[1] for p in procs]
  return [(args, p.returncode, err) for args, p, err in zip(commands, procs, errs, strict=True)]


def test_a_reader_that_stops_early_ends_a_command_quietly(tmp_path):
  """`maxtext-moe flags RECIPE | head -3` printed BrokenPipeError twice; a command ends as a Unix tool ends,
  saying nothing, with 141 (what a shell reports for SIGPIPE). --help is written at the end, from Python's
  own buffer."""
  commands = [["flags", "cpu/deepseek3-tiny"], ["recipes"], ["--help"]]
  assert _stopped_early(commands, tmp_path) == [(args, 141, "") for args in commands]


@pytest.mark.ci
def test_a_reader_that_stops_early_ends_plan_and_config_quietly(tmp_path):
  commands = [["plan", "cpu/deepseek3-tiny", "--json"], ["config", "cpu/deepseek3-tiny"]]
  assert _stopped_early(commands, tmp_path) == [(args, 141, "") for args in commands]
