"""The image's recipe, without a Docker engine (none runs here): the guard that keeps the NGC base's JAX,
TE and NCCL, build.sh's tags and pushes, and the Dockerfile's promises. hadolint and shellcheck run in
test_lint.py (scripts/lint.sh)."""

import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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


def _fake_nccl(tmp_path, code: int):
  """The stand-in base's libnccl.so.2 (docker/standin/nccl.c) answering `code` (NCCL_VERSION_CODE)."""
  if shutil.which("cc") is None:
    pytest.skip("needs a C compiler (cc) to build a stand-in libnccl.so.2")
  where = tmp_path / str(code)  # one folder per library: the loader keeps one per path
  where.mkdir()
  lib = where / "libnccl.so.2"
  source = DOCKER / "standin" / "nccl.c"
  subprocess.run(["cc", "-shared", "-fPIC", f"-DNCCL_CODE={code}", "-o", str(lib), str(source)], check=True)
  return str(lib)


def test_the_guard_asks_the_base_for_tes_nccl_ep_and_its_nccl(tmp_path):
  """One line each: TE without its NCCL EP, no NCCL, an NCCL older than 2.30.4 (read from the library the
  loader finds, as in the image: NGC installs NCCL as a system package)."""
  pins = _pins()
  te = {"transformer-engine": "2.20.2"}
  assert pins.nccl_version(_fake_nccl(tmp_path, 23203)) == (2, 32, 3)
  assert pins.nccl_version(str(tmp_path / "absent.so")) is None
  assert pins.gpu_path_problems(te, {pins.TE_EP_FILE, "x.py"}, (2, 32, 3)) == []
  assert pins.gpu_path_problems(te, {"transformer_engine/jax/dense.py"}, (2, 32, 3)) == [
    "the base image's Transformer Engine has no NCCL EP (transformer_engine/jax/ep.py): use an image with TE >= 2.20"
  ]
  old = pins.nccl_version(_fake_nccl(tmp_path, 22801))
  assert pins.gpu_path_problems(te, {pins.TE_EP_FILE}, old) == [
    "the base image's NCCL 2.28.1 is older than 2.30.4, which TE's NCCL EP needs: use a newer base"
  ]
  assert pins.gpu_path_problems(te, {pins.TE_EP_FILE}, None)[0].startswith("the base image has no NCCL")


def test_freeze_then_check_sees_this_environment(tmp_path):
  """On this (CPU) machine: jax and jaxlib are guarded and unchanged; the missing TE is reported."""
  frozen = tmp_path / "base.txt"
  run = [sys.executable, str(DOCKER / "pins.py")]
  assert subprocess.run([*run, "freeze", str(frozen)], check=False).returncode == 0
  lines = frozen.read_text().splitlines()
  assert any(line.startswith("jax==") for line in lines) and any(line.startswith("jaxlib==") for line in lines)
  r = subprocess.run([*run, "check", str(frozen)], capture_output=True, text=True, check=False)
  assert r.returncode == 1 and r.stderr.startswith("pins.py: the base image has no Transformer Engine")
  base = subprocess.run([*run, "base"], capture_output=True, text=True, check=False)  # before anything installs
  assert base.returncode == 1 and base.stderr.startswith("pins.py: the base image has no Transformer Engine")
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
      "--engine",
      "docker",
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
  # podman: Docker's image format (OCI's ignores SHELL), and its own tag and push
  podman = ["bash", str(DOCKER / "build.sh"), "--dry-run", "--engine", "podman", "--push", "reg.example.com/team"]
  build, *rest = subprocess.run(podman, capture_output=True, text=True, check=True).stdout.splitlines()
  assert build.startswith(f"podman build -f {DOCKER / 'Dockerfile'} --format docker --build-arg VERSION=")
  assert [line.split()[:2] for line in rest] == [["podman", "tag"], ["podman", "push"]] * 2
  r = subprocess.run([*podman[:3], "--engine", "rkt"], capture_output=True, text=True, check=False)
  assert r.returncode == 2 and r.stderr.strip() == "build.sh: --engine must be docker or podman, not 'rkt'"


def test_dockerfile_keeps_the_base_and_runs_as_a_user():
  text = (DOCKER / "Dockerfile").read_text()
  assert "ARG BASE_IMAGE=nvcr.io/nvidia/jax:26.10-py3\n" in text and "maxtext-py3" not in text.split("FROM")[1]
  # Every pip install is followed by the guard, and installs under the base's own versions.
  installs = [line for line in text.splitlines() if "pip install" in line]
  assert len(installs) == 2 and "-c /tmp/ours.txt" in installs[0] and "--no-deps ." in installs[1]
  assert text.count("python3 pins.py check /tmp/base.txt") == 2
  assert 'ENTRYPOINT ["/usr/local/bin/entrypoint.sh"]' in text and 'CMD ["doctor"]' in text
  assert "RUN /usr/local/bin/user.sh\nUSER 1000\n" in text


def _stubs(tmp_path, passwd: str) -> dict:
  """PATH with getent/useradd/usermod/groupmod that log their arguments, getent answering `passwd`."""
  bin_dir, log = tmp_path / "bin", tmp_path / "calls.log"
  bin_dir.mkdir()
  answers = {
    "getent": f'[ "$1" = passwd ] && [ -n "{passwd}" ] && echo "{passwd}" && exit 0; [ "$1" = group ] && exit 0; exit 2'
  }
  for name in ("getent", "useradd", "usermod", "groupmod", "maxtext-moe"):
    body = answers.get(name, "exit 0")
    (bin_dir / name).write_text(f'#!/bin/sh\necho "{name} $*" >> {log}\n{body}\n')
    (bin_dir / name).chmod(0o755)
  return {"PATH": f"{bin_dir}:/usr/bin:/bin", "LOG": str(log)}


@pytest.mark.parametrize(
  ("passwd", "want"),
  [
    ("", ["useradd --create-home --uid 1000 maxtext"]),
    ("ubuntu:x:1000:1000:Ubuntu:/home/ubuntu:/bin/bash",
     ["usermod --login maxtext --home /home/maxtext --move-home ubuntu", "groupmod --new-name maxtext ubuntu"]),
    ("maxtext:x:1000:1000::/home/maxtext:/bin/sh", []),
  ],
)  # fmt: skip
def test_the_image_user_is_uid_1000_whether_or_not_the_base_has_one(tmp_path, passwd, want):
  """Ubuntu 24.04 bases carry a uid-1000 `ubuntu` user, where useradd --uid 1000 fails: it is renamed."""
  env = _stubs(tmp_path, passwd)
  r = subprocess.run(["bash", str(DOCKER / "user.sh")], env=env, capture_output=True, text=True, check=False)
  assert r.returncode == 0, r.stderr
  calls = [c for c in Path(env["LOG"]).read_text().splitlines() if not c.startswith("getent")]
  assert calls == want


def test_the_entrypoint_runs_maxtext_moe_behind_ngcs_own_where_the_base_has_it(tmp_path):
  env = _stubs(tmp_path, "")
  r = subprocess.run(["bash", str(DOCKER / "entrypoint.sh"), "doctor", "--json"], env=env, check=False)
  assert r.returncode == 0 and Path(env["LOG"]).read_text() == "maxtext-moe doctor --json\n"
  text = (DOCKER / "entrypoint.sh").read_text()
  assert 'exec /opt/nvidia/nvidia_entrypoint.sh maxtext-moe "$@"' in text


def test_the_image_smoke_says_why_in_one_line_and_skips_where_podman_cannot_run(tmp_path):
  """Without podman, runc or debootstrap on PATH (or not as root): one line, exit 0, nothing built."""
  bin_dir = tmp_path / "bin"
  bin_dir.mkdir()
  for tool in ("bash", "id", "dirname", "sed", "mkdir"):  # what the script needs before it checks
    (bin_dir / tool).symlink_to(f"/usr/bin/{tool}" if Path(f"/usr/bin/{tool}").exists() else f"/bin/{tool}")
  script = REPO / "scripts" / "image_smoke.sh"
  r = subprocess.run(["bash", str(script)], env={"PATH": str(bin_dir)}, capture_output=True, text=True, check=False)
  assert r.returncode == 0, r.stderr
  assert r.stdout.startswith("image_smoke.sh: skipped: needs podman runc debootstrap cc") and r.stdout.count("\n") == 1
