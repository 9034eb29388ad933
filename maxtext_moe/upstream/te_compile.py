"""Transformer Engine in a process that compiles for GPUs it does not have (`./setup.sh --gpu-compile-te`,
`.venv-te/bin/maxtext-moe compile`). Only `maxtext-moe compile` calls this module; `train` never loads
what it loads.

TE 2.20.2's JAX side cannot be imported without a CUDA driver, and asks the GPU for its compute capability
while a step is traced. Both are answered here, for a compile only:

- `load()`: the CUDA driver library is a stub built by the setup (`scripts/cuda_stub.c`: the entry points
  cuDNN's and TE's libraries link, each answering "no device"), loaded first so that every later
  `dlopen("libcuda.so.1")` finds it, never the machine's driver. The CUDA 12 libraries of the pip wheels
  (runtime, cuBLAS, cuDNN, NCCL, NVRTC, cuRAND) are loaded from this environment's `nvidia/` packages, and
  TE's search for "system" CUDA is pointed at the same folders (`CUDNN_HOME`, `NVRTC_HOME`,
  `CURAND_HOME`: TE looks there before `/usr/local/cuda`, which may hold another CUDA).
- `te.for_target(sm)` (in the TE seam): TE's C++ `get_device_compute_capability` answers the target's SM
  (90 for Hopper, 100 for Blackwell) in every TE module that imported it by name, and TE's cached answers
  are cleared, for as long as the context is open. TE picks its GEMM path and workspace size from it.

TE's NCCL EP cannot be compiled this way: its `ep_bootstrap` creates NCCL communicators (a real device
and its peers), and TE asks the bootstrapped backend for the handle size while the step is traced
(`tex.ep.run_borrowed_comm_bootstrap`: "so trace-time handle_mem_size finds it ready"). `compile`
substitutes `te_ep` with `all_to_all` and says so.
"""

import ctypes
import functools
import glob
import os
import sys
import sysconfig
from pathlib import Path

STUB = Path(sys.prefix) / "lib" / "maxtext-moe-cuda-stub" / "libcuda.so.1"
_HOMES = {"CUDNN_HOME": "cudnn", "NVRTC_HOME": "cuda_nvrtc", "CURAND_HOME": "curand"}
# Loaded in this order (each library's own dependencies first); cuDNN's are all of nvidia/cudnn/lib.
_LIBRARIES = (
  "cuda_runtime/lib/libcudart.so.12",
  "cuda_nvrtc/lib/libnvrtc.so.12",
  "cublas/lib/libcublasLt.so.12",
  "cublas/lib/libcublas.so.12",
  "curand/lib/libcurand.so.10",
  "nccl/lib/libnccl.so.2",
)


def prepared() -> bool:
  """Whether this environment was set up for it (`./setup.sh --gpu-compile-te` built the stub here)."""
  return STUB.is_file()


def _nvidia() -> Path:
  return Path(sysconfig.get_path("purelib")) / "nvidia"


def _load_all(paths: list[str]) -> None:
  """Loads every library of `paths` globally, in whatever order their dependencies on each other allow."""
  left = list(paths)
  while left:
    failed = []
    for path in left:
      try:
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
      except OSError as e:
        failed.append(path)
        last = e
    if len(failed) == len(left):
      raise OSError(f"cannot load {failed[0]}: {last}")
    left = failed


@functools.cache
def load() -> None:
  """The stub driver and the wheels' CUDA libraries, once per process (see the module docstring)."""
  nvidia = _nvidia()
  ctypes.CDLL(str(STUB), mode=ctypes.RTLD_GLOBAL)
  for key, package in _HOMES.items():
    os.environ[key] = str(nvidia / package)
  _load_all([str(nvidia / lib) for lib in _LIBRARIES])
  _load_all(sorted(glob.glob(str(nvidia / "cudnn" / "lib" / "lib*.so.*"))))
