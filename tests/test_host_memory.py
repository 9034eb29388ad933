"""The converter's glibc settings return freed chunk-sized blocks to the OS, even under the cpu flag
profile's environment (which tells glibc to keep them, for training)."""

import os
import subprocess
import sys

import pytest

from maxtext_moe.config import flags

_CODE = """
import ctypes, sys
from pathlib import Path
def anon_mb():
  line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("RssAnon"))
  return int(line.split()[1]) // 1024
if sys.argv[1] == "bound":
  from maxtext_moe.checkpoint.host_memory import bound_host_memory
  bound_host_memory()
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype = ctypes.c_void_p
base = anon_mb()
blocks = [libc.malloc(8 << 20) for _ in range(16)]  # 128 MiB of chunk-sized blocks
for b in blocks:
  ctypes.memset(b, 1, 8 << 20)
for b in blocks:
  libc.free(ctypes.c_void_p(b))
print(anon_mb() - base)
"""


@pytest.mark.parametrize("bound", [True, False])
def test_freed_chunks_leave_the_process_under_the_cpu_profile(bound):
  env = dict(os.environ, **flags.profile("cpu").env)
  proc = subprocess.run(
    [sys.executable, "-c", _CODE, "bound" if bound else "plain"], env=env, capture_output=True, text=True, check=False
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  kept_mb = int(proc.stdout.split()[-1])
  if bound:
    assert kept_mb < 16, "freed 8 MiB blocks must be unmapped"
  else:
    assert kept_mb > 100, "the cpu profile keeps freed blocks in the heap (what bound_host_memory undoes)"
