"""scripts/lint.sh passes: ruff format and check, yamllint on configs, codespell, shellcheck."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO


@pytest.mark.skipif(not (Path(sys.executable).parent / "ruff").exists(), reason="needs ./setup.sh --dev")
def test_lint_script_passes():
  bash = shutil.which("bash")
  r = subprocess.run([bash, str(REPO / "scripts" / "lint.sh")], cwd=REPO, capture_output=True, text=True)
  assert r.returncode == 0, r.stdout + r.stderr
