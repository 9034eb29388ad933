"""A flag profile's environment applied in-process, before the XLA backend starts (no re-exec)."""

import os
import subprocess
import sys
import textwrap

import pytest

from maxtext_moe.config.flags import FlagSet
from maxtext_moe.errors import UserError
from maxtext_moe.launch import environment


def test_xla_flags_applied_after_importing_jax_take_effect():
  code = textwrap.dedent("""
    import jax
    from maxtext_moe.config.flags import FlagSet
    from maxtext_moe.launch import environment
    assert not environment.backend_started()
    environment.apply(FlagSet(env={"MAXTEXT_MOE_X": "1"}, xla_flags=["--xla_force_host_platform_device_count=3"]))
    print(jax.device_count(), environment.backend_started())
  """)
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu"}
  r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=False)
  assert r.returncode == 0, r.stderr[-2000:]
  assert r.stdout.split() == ["3", "True"]


def test_changing_xla_flags_after_the_backend_started_is_a_bug_not_a_silent_noop():
  import jax

  jax.devices()
  with pytest.raises(RuntimeError, match="backend started before the flag environment was applied"):
    environment.apply(FlagSet(xla_flags=["--xla_cpu_use_thunk_runtime=true"]))


def test_loader_variables_need_a_fresh_process(monkeypatch):
  monkeypatch.delenv("LD_PRELOAD", raising=False)
  with pytest.raises(UserError, match="LD_PRELOAD takes effect only when a process starts: export it before"):
    environment.apply(FlagSet(env={"LD_PRELOAD": "/usr/lib/libtcmalloc.so"}))
  assert "LD_PRELOAD" not in os.environ


def test_sizes_beyond_a_c_int_mean_never_and_other_overflows_are_refused():
  from maxtext_moe import glibc

  assert glibc.mallopt("MALLOC_TRIM_THRESHOLD_", 16 * 2**30)  # set as SIZE_MAX, not truncated to 0
  with pytest.raises(ValueError, match="does not fit glibc's mallopt"):
    glibc.mallopt("MALLOC_MMAP_MAX_", 2**40)
