"""Test setup: 8 fake CPU devices before JAX is imported, so FSDP and expert-parallel meshes exist."""

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
  """Runs `python -m maxtext_moe ARGS` in a fresh process with `devices` fake CPU devices and the cpu flag
  profile's environment."""
  from maxtext_moe.launch import flags  # pylint: disable=import-outside-toplevel

  env = dict(os.environ, XLA_FLAGS=f"--xla_force_host_platform_device_count={devices}", PYTHONUNBUFFERED="1")
  env |= flags.profile("cpu").env  # what `train` re-executes itself with on CPU; starting with it saves that
  return subprocess.run(
    [sys.executable, "-m", "maxtext_moe", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
  )


@pytest.fixture(scope="session")
def adapter():
  from maxtext_moe import maxtext_adapter

  return maxtext_adapter
