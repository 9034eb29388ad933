"""The config surface, fuzzed: every key a user can set, at boundary values and of the wrong type, and
malformed YAML layerings. Each case ends in `train --check` passing (exit 0: the value is in the key's
domain) or in one line starting `maxtext-moe: error:` with exit 2; never a traceback, never a file written.

What is tried (the catalogue):
- keys: every plugin key (`PluginKeys`' fields, config/keys.py) and every MaxText key our shipped configs
  set (configs/base.yml, the recipes, the model files), minus the ones MaxText derives (refused by name,
  tests/test_bad_input.py) and our own bookkeeping keys;
- values (VALUES): zero, minus one, a huge integer, a float where an integer may be wanted, an empty
  string, a word, a list, a mapping, a boolean, a path outside the run, an unterminated list;
- layerings (LAYERINGS): a base_config that does not exist, one that includes itself, a file that is a list
  not a mapping, an empty file, a key with no value, a duplicated key, tabs for indentation.

Each key gets three of the values, rotating (so every value is tried on every kind of key); the default
suite runs every sixteenth key with one of them, `pytest -m extended` the rest. Which values a key accepts
comes from its declared domain (pydantic types and constraints, our named checks), not from this file:
the test only insists on the two ways to end. The first run found: a recipe file that is a YAML list (TypeError from
OmegaConf's merge), a base_config chain that comes back to itself (RecursionError), `attention=''` (a
ValueError when the model is traced) and `attention=flash` on CPU (NotImplementedError at trace time);
each is now one line (config/layers.py, checks.check_attention_kernel, preflight.check_platform).
Round four added the typed values (TYPED: 123 cases over the integer and float keys, 14 in the default
suite) and found `steps=0`/`-1` (MaxText's assertion once its trainer ran: now `upstream.maxtext.trainer.validate`
before anything is written) and `max_target_length=0`/`-3` (numpy errors from inside the model:
`checks.check_sequence_length`).
"""

import io
import os
import sys
import threading
from pathlib import Path

import pytest
import yaml

from conftest import REPO
from maxtext_moe import cli
from maxtext_moe.config.keys import PluginKeys

VALUES = ["0", "-1", "99999999999999999999", "0.5", "''", "banana", "[1,2]", "{a: 1}", "true", "../outside", "[1"]
# Ours that name files the run writes (tested for escaping elsewhere) or that only the launcher sets.
SKIP = {"base_config", "model_name", "run_name", "base_output_directory", "recipe_hardware", "recipe_num_devices"}


def _config_keys() -> list[str]:
  """Every top-level key set in our shipped YAML (base, recipes, model files)."""
  keys: set[str] = set()
  for path in sorted((REPO / "configs").rglob("*.yml")):
    if "flags" in path.parts:
      continue
    data = yaml.safe_load(path.read_text()) or {}
    if isinstance(data, dict):
      keys |= {k for k in data if isinstance(k, str)}
  return sorted(keys)


def _keys() -> list[str]:
  from maxtext.configs import types  # pylint: disable=import-outside-toplevel

  keys = set(PluginKeys.model_fields) | set(_config_keys())
  return sorted(keys - SKIP - set(types.DerivedValues.model_fields))


def _cases() -> list:
  """Key i gets VALUES[i], VALUES[i + 4] and VALUES[i + 8] (mod len): over the keys every value meets every
  kind of key. The default suite runs every sixteenth key with its first value (each case resolves the config
  and traces the model: about 3 s on a busy 2-core machine); the rest is `pytest -m extended`."""
  cases = []
  for i, key in enumerate(_keys()):
    for j, offset in enumerate((0, 4, 8)):
      value = VALUES[(i + offset) % len(VALUES)]
      marks = () if (j == 0 and i % 16 == 0) else (pytest.mark.extended,)
      cases.append(pytest.param(key, value, marks=marks, id=f"{key}={value!r}"))
  return cases


def _check(argv: list[str], cwd: Path, capfd, monkeypatch) -> tuple[int, str]:
  """`maxtext-moe ARGV` in this process from `cwd`: (exit code, standard error); asserts nothing was
  written under cwd."""
  monkeypatch.chdir(cwd)
  before = sorted(p.relative_to(cwd) for p in cwd.rglob("*"))
  code = cli.main(argv)
  err = capfd.readouterr().err
  after = sorted(p.relative_to(cwd) for p in cwd.rglob("*"))
  assert after == before, f"{argv} wrote {set(after) - set(before)}"
  return code, err


def _ends_well(argv: list[str], code: int, err: str) -> None:
  lines = err.strip().splitlines()
  assert "Traceback" not in err, f"{argv}: a traceback\n{err[-3000:]}"
  assert code in (0, 2), f"{argv}: exit {code}\n{err[-3000:]}"
  if code == 2:
    assert lines and lines[-1].startswith("maxtext-moe: error:"), f"{argv}: {lines[-3:]}"


@pytest.fixture
def quiet(monkeypatch):
  """As in test_bad_input: the CLI's last word printed plainly, Python's hooks and the environment (which
  a recipe's flag profile sets) restored."""
  saved_env = dict(os.environ)
  monkeypatch.setattr(sys, "unraisablehook", sys.unraisablehook)
  monkeypatch.setattr(threading, "excepthook", threading.excepthook)
  monkeypatch.setattr(cli, "last_word", lambda line, verbose: print(line, file=sys.stderr))
  yield
  os.environ.clear()
  os.environ.update(saved_env)


@pytest.mark.parametrize(("key", "value"), _cases())
def test_every_key_at_every_boundary_ends_in_a_check_or_one_line(key, value, tmp_path, capfd, monkeypatch, quiet):
  del quiet
  argv = ["train", "--check", f"{key}={value}"]
  code, err = _check(argv, tmp_path, capfd, monkeypatch)
  _ends_well(argv, code, err)


def _kind(key: str) -> str | None:
  """'int' or 'float' for a key whose declared type (ours, else MaxText's) is that number, else None."""
  from maxtext.configs import types  # pylint: disable=import-outside-toplevel

  field = PluginKeys.model_fields.get(key) or types.MaxTextConfig.model_fields.get(key)
  kind = getattr(field, "annotation", None)
  return {int: "int", float: "float"}.get(kind)


# Round four: every integer key also at 0 and a negative value, every float key at 0, a negative value and
# NaN (MaxText asserts some of these only once its trainer runs: steps=0 was a traceback after the run had
# started). The default suite runs every eighth typed key, `-m extended` all of them.
TYPED = {"int": ["0", "-3"], "float": ["0", "-0.5", "nan"]}


def _typed_cases() -> list:
  cases = []
  typed = [(k, _kind(k)) for k in _keys()]
  for i, (key, kind) in enumerate([t for t in typed if t[1]]):
    for value in TYPED[kind]:
      marks = () if i % 8 == 0 else (pytest.mark.extended,)
      cases.append(pytest.param(key, value, marks=marks, id=f"{key}={value}"))
  return cases


@pytest.mark.parametrize(("key", "value"), _typed_cases())
def test_every_number_key_at_zero_negative_and_nan_ends_in_a_check_or_one_line(
  key, value, tmp_path, capfd, monkeypatch, quiet
):
  del quiet
  argv = ["train", "--check", f"{key}={value}"]
  code, err = _check(argv, tmp_path, capfd, monkeypatch)
  _ends_well(argv, code, err)


LAYERINGS = {
  "missing_base": "base_config: nowhere.yml\nsteps: 3\n",
  "self_base": "base_config: self.yml\nsteps: 3\n",
  "a_list": "- steps\n- 3\n",
  "empty": "",
  "no_value": "base_config: {base}\nsteps:\n",
  "duplicate_key": "base_config: {base}\nsteps: 3\nsteps: 4\n",
  "tabs": "base_config: {base}\n\tsteps: 3\n",
}


@pytest.mark.parametrize("name", sorted(LAYERINGS))
def test_malformed_layerings_end_in_a_check_or_one_line(name, tmp_path, capfd, monkeypatch, quiet):
  del quiet
  base = REPO / "configs" / "recipes" / "cpu" / "deepseek3-tiny.yml"
  recipe = tmp_path / ("self.yml" if name == "self_base" else f"{name}.yml")
  recipe.write_text(LAYERINGS[name].format(base=base))
  argv = ["train", "--check", str(recipe)]
  code, err = _check(argv, tmp_path, capfd, monkeypatch)
  _ends_well(argv, code, err)


def test_check_passes_the_default_and_writes_nothing(tmp_path, capfd, monkeypatch, quiet):
  del quiet
  monkeypatch.setattr(sys, "stdout", io.StringIO())
  code, err = _check(["train", "--check"], tmp_path, capfd, monkeypatch)
  assert code == 0, err[-3000:]
