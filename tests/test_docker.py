"""The image's recipe, without a Docker engine (none runs here): the guard that keeps the NGC base's JAX,
TE and NCCL, build.sh's tags and pushes, and the Dockerfile's promises. hadolint and shellcheck run in
test_lint.py (scripts/lint.sh)."""

import importlib.util
import subprocess
import sys

from conftest import REPO

DOCKER = REPO / "docker"


def _pins():
  spec = importlib.util.spec_from_file_location("pins", DOCKER / "pins.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_the_guard_reports_every_change_to_the_base():
  pins = _pins()
  base = {"jax": "0.12.0", "jaxlib": "0.12.0", "transformer-engine": "2.20.2", "nvidia-nccl-cu13": "2.30.4"}
  assert pins.problems(base, dict(base)) == []
  changed = dict(base) | {"jax": "0.12.0.1"}
  del changed["nvidia-nccl-cu13"]
  assert pins.problems(base, changed) == ["pip changed jax 0.12.0 -> 0.12.0.1", "pip removed nvidia-nccl-cu13 2.30.4"]
  old = {"jax": "0.6.0", "transformer-engine": "2.4.0"}
  assert pins.problems(old, old) == ["transformer-engine 2.4.0 is older than 2.20: use a newer base image"]
  assert pins.problems({"jax": "0.6.0"}, {"jax": "0.6.0"})[0].startswith("the base image has no Transformer Engine")


def test_freeze_then_check_sees_this_environment(tmp_path):
  """On this (CPU) machine: jax and jaxlib are guarded and unchanged; the missing TE is reported."""
  frozen = tmp_path / "base.txt"
  run = [sys.executable, str(DOCKER / "pins.py")]
  assert subprocess.run([*run, "freeze", str(frozen)], check=False).returncode == 0
  lines = frozen.read_text().splitlines()
  assert any(line.startswith("jax==") for line in lines) and any(line.startswith("jaxlib==") for line in lines)
  r = subprocess.run([*run, "check", str(frozen)], capture_output=True, text=True, check=False)
  assert r.returncode == 1 and r.stderr.startswith("pins.py: the base image has no Transformer Engine")
  frozen.write_text(frozen.read_text().replace("jaxlib==", "jaxlib==0.0.1-was-"))
  r = subprocess.run([*run, "check", str(frozen)], capture_output=True, text=True, check=False)
  assert "pins.py: pip changed jaxlib 0.0.1-was-" in r.stderr


def test_build_script_tags_with_version_and_commit_and_pushes():
  r = subprocess.run(
    [
      "bash",
      str(DOCKER / "build.sh"),
      "--dry-run",
      "--push",
      "reg.example.com/team",
      "--base",
      "nvcr.io/nvidia/jax:26.11-py3",
    ],
    capture_output=True,
    text=True,
    check=False,
  )
  assert r.returncode == 0, r.stderr
  build, *rest = r.stdout.splitlines()
  assert build.startswith(f"docker build -f {DOCKER / 'Dockerfile'} --build-arg VERSION=0.1.0 --build-arg GIT_SHA=")
  assert "--build-arg BASE_IMAGE=nvcr.io/nvidia/jax:26.11-py3 -t maxtext-moe:0.1.0 -t maxtext-moe:0.1.0-" in build
  assert [line.split()[:2] for line in rest] == [["docker", "tag"], ["docker", "push"]] * 2
  assert rest[1].strip() == "docker push reg.example.com/team/maxtext-moe:0.1.0"
  r = subprocess.run(["bash", str(DOCKER / "build.sh"), "--bogus"], capture_output=True, text=True, check=False)
  assert r.returncode == 2 and "unknown argument '--bogus'" in r.stderr


def test_dockerfile_keeps_the_base_and_runs_as_a_user():
  text = (DOCKER / "Dockerfile").read_text()
  assert "ARG BASE_IMAGE=nvcr.io/nvidia/jax:26.10-py3\n" in text and "maxtext-py3" not in text.split("FROM")[1]
  # Every pip install is followed by the guard, and installs under the base's own versions.
  installs = [line for line in text.splitlines() if "pip install" in line]
  assert len(installs) == 2 and "-c /tmp/ours.txt" in installs[0] and "--no-deps ." in installs[1]
  assert text.count("python3 pins.py check /tmp/base.txt") == 2
  assert 'ENTRYPOINT ["maxtext-moe"]' in text and 'CMD ["doctor"]' in text and "\nUSER 1000\n" in text
