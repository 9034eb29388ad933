"""XLA/NCCL flag profiles: composed per recipe, probed against the installed jaxlib, printed as shell."""

import os
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import numpy as np
import pytest

from conftest import run_cli
from maxtext_moe.config import flags, hardware, recipes
from maxtext_moe.errors import UserError
from maxtext_moe.steptime import gemm

PROFILES = ["h100", "h200", "gh200", "b200", "b300", "gb200", "gb300"]


@pytest.fixture(autouse=True)
def fresh_probe_cache(tmp_path, monkeypatch):
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # every probe really runs


@pytest.mark.parametrize("name", recipes.list_recipes())
def test_every_recipe_resolves_its_profile(name, resolution):
  overrides = ["finetune=false"] if name.endswith(("-finetune", "-sft")) else []  # no checkpoint needed here
  cfg = resolution.resolve(recipes.recipe_path(name), overrides)
  got = flags.for_config(cfg)
  if name.startswith("cpu/"):
    profile_only = flags.for_config(cfg, keep_process_flags=False)
    assert set(profile_only.full_env()) == {"MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_"}, "no XLA flags on CPU"
    own = dict(f.partition("=")[::2] for f in os.environ.get("XLA_FLAGS", "").split())  # the last of a name wins
    assert dict(f.partition("=")[::2] for f in got.xla_flags) == own, "the process's own, kept (and probed)"
    return
  names = [f.split("=")[0] for f in got.xla_flags]
  assert "--xla_gpu_experimental_enable_collective_multi_streaming" in names
  assert "--xla_gpu_enable_latency_hiding_scheduler" in names
  hopper = gemm.arch(hardware.GPUS[str(cfg.recipe_hardware)]) == "hopper"
  assert (got.env.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1") == hopper, "Hopper only, never on Blackwell"
  assert ("--xla_gpu_enable_command_buffer=" in got.xla_flags) == hopper


@pytest.mark.parametrize("name", PROFILES)
def test_shipped_profiles_pass_the_installed_jaxlib(name):
  flags.probe(flags.profile(name).xla_flags)  # raises UserError naming a flag this jaxlib lacks


@pytest.mark.ci
@pytest.mark.parametrize(
  ("flag", "message"),
  [
    ("--xla_gpu_enable_latency_hiding_schedular=true", "is not a flag of the installed jaxlib"),
    pytest.param(
      "--xla_gpu_enable_latency_hiding_scheduler=maybe",
      "has a value rejected by the installed jaxlib",
      marks=pytest.mark.extended,
    ),
  ],
)
def test_bad_flag_is_named_with_the_jaxlib_version(flag, message):
  from importlib.metadata import version

  good = flags.profile("gb200").xla_flags
  with pytest.raises(UserError) as e:
    flags.probe([*good, flag])
  assert f"XLA flag {flag} {message} {version('jaxlib')}" in str(e.value)


def test_extra_flags_replace_the_profiles_and_env_extra_adds(resolution, monkeypatch):
  monkeypatch.delenv("XLA_FLAGS", raising=False)
  cfg = resolution.resolve(
    recipes.recipe_path("gb200-nvl72/deepseek3-671b"),
    ["xla_flags_extra=[--xla_gpu_experimental_parallel_collective_overlap_limit=4]", "env_extra=[NCCL_DEBUG=INFO]"],
  )
  got = flags.for_config(cfg)
  limits = [f for f in got.xla_flags if "parallel_collective_overlap_limit" in f]
  assert limits == ["--xla_gpu_experimental_parallel_collective_overlap_limit=4"]
  assert got.env["NCCL_DEBUG"] == "INFO" and got.env["NCCL_MNNVL_ENABLE"] == "1"
  with pytest.raises(UserError, match="is not of the form --xla_name=value"):
    flags.for_config(resolution.resolve(recipes.recipe_path("gb200-nvl72/deepseek3-671b"), ["xla_flags_extra=[oops]"]))


def test_flags_command_prints_valid_shell(tmp_path):
  proc = run_cli(["flags", "b200x8/deepseek3-proxy-16b"], cwd=tmp_path)
  assert proc.returncode == 0, proc.stderr
  script = proc.stdout
  assert subprocess.run(["bash", "-n"], input=script, text=True, check=False).returncode == 0
  shown = subprocess.run(
    ["bash", "-c", script + '\nprintf "%s|%s" "$XLA_FLAGS" "${CUDA_DEVICE_MAX_CONNECTIONS-unset}"'],
    capture_output=True,
    text=True,
    check=True,
    env={"PATH": os.environ["PATH"]},
  ).stdout
  xla, cuda = shown.split("|")
  assert "--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL" in xla.split()
  assert "--xla_force_host_platform_device_count=1" in xla.split(), "the caller's own XLA_FLAGS are kept"
  assert cuda == "unset"


def test_flags_of_a_finetune_recipe_are_its_base_recipes_without_weights(tmp_path):
  """The XLA/NCCL environment does not depend on the weights: a *-finetune recipe prints it without
  load_parameters_path (it refused: 'finetune=true needs weights to start from'), its base recipe's."""
  tuned = run_cli(["flags", "h100x8/deepseek3-671b-finetune"], cwd=tmp_path)
  base = run_cli(["flags", "h100x8/deepseek3-671b"], cwd=tmp_path)
  assert (tuned.returncode, tuned.stderr) == (0, ""), tuned.stderr[-2000:]
  assert (base.returncode, base.stderr) == (0, "")
  assert tuned.stdout == base.stdout


def test_a_sharded_step_compiles_with_a_gpu_profile_on_cpu():
  """The GB200 profile's XLA_FLAGS parse, and a sharded jitted step compiles and runs under them (CPU)."""
  env = dict(os.environ, **flags.profile("gb200").full_env())
  env["XLA_FLAGS"] += " --xla_force_host_platform_device_count=8"
  code = """
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
mesh = Mesh(np.array(jax.devices()), ("x",))
x = jax.device_put(jnp.arange(64.0).reshape(8, 8), NamedSharding(mesh, P("x")))
f = jax.jit(lambda a: (a @ a.T).sum(), out_shardings=NamedSharding(mesh, P()))
assert "all-reduce" in f.lower(x).compile().as_text()
print(float(f(x)))
"""
  proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
  assert proc.returncode == 0, proc.stderr[-2000:]
  a = np.arange(64.0).reshape(8, 8)
  assert float(proc.stdout.strip()) == pytest.approx(float((a @ a.T).sum()))


_FAULTS = """
import resource, sys, jax, jax.numpy as jnp
if sys.argv[1] == "applied":  # what `train` does: the profile applied in-process, after jax is imported
  from maxtext_moe.config import flags
  from maxtext_moe.launch import environment
  environment.apply(flags.profile("cpu"))
f = jax.jit(lambda a: a * 2)
a = jnp.ones((64, 256, 512))  # a 32 MiB output: the size at which glibc starts to munmap on free
faults = []
for _ in range(48):
  before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  jax.block_until_ready(f(a))
  faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(sorted(faults[-8:])[4])
"""


def _anonymous_fault_bytes() -> int:
  """The memory one minor fault maps in for a fresh anonymous mapping: the page size, or the largest of
  the kernel's multi-size transparent huge pages enabled `always` (or `inherit` from a top-level `always`)
  below 2 MiB (a 32 MiB mapping is rarely 2 MiB aligned). Seen: 16 KiB folios on a 6.18 kernel, so a
  32 MiB buffer faulted in with 2,100 faults instead of 8,192."""
  root = Path("/sys/kernel/mm/transparent_hugepage")
  top = (root / "enabled").read_text() if (root / "enabled").is_file() else ""
  size = os.sysconf("SC_PAGE_SIZE")
  for path in root.glob("hugepages-*kB/enabled"):
    kib = int(path.parent.name.removeprefix("hugepages-").removesuffix("kB"))
    mode = path.read_text()
    if kib < 2048 and ("[always]" in mode or ("[inherit]" in mode and "[always]" in top)):
      size = max(size, kib * 1024)
  return size


@pytest.mark.parametrize("mode", ["applied", "at_start", "glibc_defaults"])
def test_cpu_profile_keeps_large_xla_buffers_mapped(mode):
  """Under the cpu profile a 32 MiB XLA:CPU output is reused from the heap from step to step, whether the
  profile is applied in-process (mallopt, as `train` does) or was in the environment at start (as a child
  inherits it); under glibc's defaults it is unmapped on free and faulted in again every call (8,192 minor
  faults of 4 KiB, or fewer where the kernel maps larger folios). Counts page faults, not time, so it does
  not depend on the machine's load; but the heap takes a number of calls to settle that does (XLA keeps
  more results in flight on a busy machine: 10 calls of faults were seen before it did), so the median is
  taken over calls 41-48 of 48."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
  for key in ("MALLOC_MMAP_MAX_", "MALLOC_TRIM_THRESHOLD_"):
    env.pop(key, None)
  if mode == "at_start":
    env |= flags.profile("cpu").full_env()
  proc = subprocess.run([sys.executable, "-c", _FAULTS, mode], env=env, capture_output=True, text=True, check=False)
  assert proc.returncode == 0, proc.stderr[-2000:]
  median_faults = int(proc.stdout.split()[-1])
  if mode == "glibc_defaults":
    every_page = 32 * 2**20 // _anonymous_fault_bytes()  # the whole buffer faulted in again
    assert median_faults >= every_page, "glibc's default changed: the cpu profile's MALLOC_* may no longer be needed"
  else:
    assert median_faults < 100


def test_an_unknown_flag_in_the_environments_xla_flags_is_one_line(tmp_path):
  """XLA aborts the process on an unknown flag in XLA_FLAGS (a fatal log line, exit 1): the user's own
  XLA_FLAGS are probed with the profile's, before the backend starts."""
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=1 --xla_not_a_flag=1")
  r = subprocess.run(
    [sys.executable, "-m", "maxtext_moe", "train", "--check"], cwd=tmp_path, env=env, capture_output=True, text=True
  )
  assert r.returncode == 2, r.stderr[-2000:]
  assert r.stderr.strip().splitlines()[-1] == (
    "maxtext-moe: error: XLA flag --xla_not_a_flag=1 is not a flag of the installed jaxlib "
    f"{version('jaxlib')}; fix or drop it (XLA_FLAGS, xla_flags_extra)"
  )
  assert list(tmp_path.iterdir()) == []
