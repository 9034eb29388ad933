"""glibc's malloc settings, set from inside the process (`mallopt`) rather than by environment at start-up.

glibc reads its MALLOC_* environment variables once, when the process starts; `mallopt` changes the same
parameters at any time, for every arena. So the launcher can apply a flag profile's MALLOC_* variables to
its own process (and export them for children) without re-executing itself. No-op where libc is not glibc.
"""

import ctypes
import functools

# glibc's environment variable -> its mallopt parameter (malloc.h: M_TRIM_THRESHOLD -1 ... M_ARENA_MAX -8).
MALLOPT_PARAMS = {
  "MALLOC_TRIM_THRESHOLD_": -1,
  "MALLOC_TOP_PAD_": -2,
  "MALLOC_MMAP_THRESHOLD_": -3,
  "MALLOC_MMAP_MAX_": -4,
  "MALLOC_PERTURB_": -6,
  "MALLOC_ARENA_TEST": -7,
  "MALLOC_ARENA_MAX": -8,
}


@functools.cache
def _mallopt():
  try:
    return ctypes.CDLL("libc.so.6").mallopt
  except (OSError, AttributeError):
    return None


# Parameters glibc keeps as size_t. mallopt takes a C int, converted to size_t inside glibc, so -1 sets
# SIZE_MAX; the environment takes any size.
_SIZE_PARAMS = {"MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_"}
_INT_MAX = 2**31 - 1


def mallopt(variable: str, value: int) -> bool:
  """Sets the parameter glibc's environment `variable` names; False where libc is not glibc.

  A size above what a C int holds (the cpu profile's 16 GiB trim threshold, "never trim") is set as
  SIZE_MAX: ctypes would otherwise pass it truncated to 32 bits (16 GiB -> 0: trim on every free).
  """
  fn = _mallopt()
  if fn is None:
    return False
  value = int(value)
  if value > _INT_MAX:
    if variable not in _SIZE_PARAMS:
      raise ValueError(f"{variable}={value} does not fit glibc's mallopt (at most {_INT_MAX})")
    value = -1  # SIZE_MAX
  if not fn(ctypes.c_int(MALLOPT_PARAMS[variable]), ctypes.c_int(value)):
    raise ValueError(f"glibc rejected {variable}={value}")
  return True
