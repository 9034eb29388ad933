"""Transformer Engine's libraries in a process that compiles for GPUs it does not have (`./setup.sh
--gpu-compile-te`, `.venv-te/bin/maxtext-moe compile`). Only `maxtext-moe compile` calls this module; `train`
never loads what it loads.

TE 2.20.2's JAX side cannot be imported without a CUDA driver. `load()` answers that: the CUDA driver
library is a stub built by the setup (`scripts/cuda_stub.c`: the entry points cuDNN's and TE's libraries
link, each answering "no device"), loaded first so that every later `dlopen("libcuda.so.1")` finds it,
never the machine's driver. The CUDA 12 libraries of the pip wheels (runtime, cuBLAS, cuDNN, NCCL, NVRTC,
cuRAND) are loaded from this environment's `nvidia/` packages, and TE's search for "system" CUDA is pointed
at the same folders (`CUDNN_HOME`, `NVRTC_HOME`, `CURAND_HOME`: TE looks there before `/usr/local/cuda`,
which may hold another CUDA).

What TE then asks a device while the step is traced (its compute capability, its NCCL EP group) is
answered in `upstream.te_target`, the TE seam's stand-ins for a target.
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
