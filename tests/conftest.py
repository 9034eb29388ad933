"""Test setup: 8 fake CPU devices before JAX is imported, so FSDP and expert-parallel meshes exist."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("DECOUPLE_GCLOUD", "TRUE")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"


def run_cli(args: list[str], *, cwd: Path, devices: int = 1, timeout: int = 600) -> subprocess.CompletedProcess:
  """Runs `python -m maxtext_moe ARGS` in a fresh process with `devices` fake CPU devices."""

  env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", PYTHONUNBUFFERED="1")
  return subprocess.run(
    [sys.executable, "-m", "maxtext_moe", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
  )


def quiet_env() -> dict[str, str]:
  """A user's environment on a CPU machine: no JAX_PLATFORMS or XLA_FLAGS (this conftest sets both)."""
  env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
  return env | {"PYTHONUNBUFFERED": "1"}


def compile_report(
  args: list[str], *, cwd: Path, python: Path | str = sys.executable, timeout: int | None = 1500
) -> dict:
  """`python -m maxtext_moe ARGS` for a `compile ... --json` as a user runs it on a CPU machine (`quiet_env`):
  its report, the command's success asserted."""
  r = subprocess.run(
    [str(python), "-m", "maxtext_moe", *args],
    cwd=cwd,
    env=quiet_env(),
    capture_output=True,
    text=True,
    timeout=timeout,
    check=False,
  )
  assert r.returncode == 0, r.stderr[-4000:]
  return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def resolution():
  """maxtext_moe.upstream.resolution: a recipe resolved through MaxText."""
  from maxtext_moe.upstream import resolution

  return resolution
