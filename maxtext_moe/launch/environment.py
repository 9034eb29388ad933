"""Putting a flag profile's environment into effect in this process, before the XLA backend starts.

XLA reads XLA_FLAGS when its backend starts (the first `jax.devices()`, which MaxText's config validation
calls), not when jax is imported; the CUDA driver reads CUDA_DEVICE_MAX_CONNECTIONS when it creates its
context and NCCL its NCCL_* variables at its first communicator: all later than the launcher's first
lines. glibc's MALLOC_* variables are read at process start, so they are also applied with `mallopt`
(`maxtext_moe.glibc`), which sets the same parameters at run time. So `train` applies the whole
environment to itself and never re-executes. The one kind of variable that needs a fresh process is the
dynamic loader's (LD_*): it is refused, with the way to set it.
"""

import os

from maxtext_moe.config.flags import FlagSet
from maxtext_moe.errors import UserError
from maxtext_moe.glibc import MALLOPT_PARAMS, mallopt


def backend_started() -> bool:
  """Whether this process already started an XLA backend (after which XLA_FLAGS no longer matter)."""
  from maxtext_moe.upstream import jax_backend  # pylint: disable=import-outside-toplevel

  return jax_backend.backends_are_initialized()


def _flags(value: str) -> dict[str, str]:
  """XLA_FLAGS as XLA reads them: {name: value}, the last of a name winning (so a repeated flag, which the
  flag set keeps once, is the same environment)."""
  return dict(f.partition("=")[::2] for f in value.split())


def apply(flags: FlagSet) -> dict[str, str]:
  """Sets the flag environment in os.environ (children inherit it) and in this process; returns it.

  Raises:
    UserError: a variable only a fresh process can take (LD_*), with how to set it.
    RuntimeError: XLA_FLAGS must change but the backend has already started (a bug in the caller).
  """
  env = flags.full_env()
  late = sorted(k for k in env if k.startswith("LD_"))
  if late:
    raise UserError(f"{late[0]} takes effect only when a process starts: export it before running maxtext-moe")
  if "XLA_FLAGS" in env and _flags(env["XLA_FLAGS"]) != _flags(os.environ.get("XLA_FLAGS", "")) and backend_started():
    raise RuntimeError("the XLA backend started before the flag environment was applied")
  os.environ.update(env)
  for key, value in env.items():
    if key in MALLOPT_PARAMS:
      mallopt(key, int(value))
  return env
