"""glibc settings that keep a converter's resident memory bounded by the chunks in flight.

A module of its own, importing nothing heavy, so `maxtext-moe convert` can apply them before JAX and
TensorStore start their threads."""

MMAP_THRESHOLD = 4 << 20


def bound_host_memory() -> None:
  """Keeps the converter's memory bounded by what is in flight, through three glibc settings:
  - a fixed mmap threshold (M_MMAP_THRESHOLD = -3): glibc raises its threshold after large frees (up to
    32 MB), so chunk-sized arrays would then come from the heap and stay in the process when freed.
    Measured on `bench convert` (2 cores), peak RSS over the largest tensor / GB/s: glibc default
    2.4-4.0x / 0.25-0.27; 1 MB 1.4-1.7x / 0.19-0.22 (every small temporary page-faults afresh); 16 MB
    4.2-4.3x / 0.30-0.32 once chunks were 4 MB tiles; 4 MB (chosen) 2.2x / 0.27-0.29;
  - one arena (M_ARENA_MAX = -8): chunks are made on XLA's threads and released on TensorStore's, and
    glibc's per-thread arenas kept what one thread freed out of the others' reach. With XLA making the
    chunks, peak RSS over the largest tensor grew steadily to 3.6-4.1x; with one arena it is 2.7x, at
    the same speed. It binds threads that allocate for the first time after this call;
  - mmap on (M_MMAP_MAX = -4, glibc's default 65536), in case the environment turned it off (the `cpu`
    flag profile does, for training).
  No-op where libc is not glibc."""
  import ctypes  # pylint: disable=import-outside-toplevel

  try:
    mallopt = ctypes.CDLL("libc.so.6").mallopt
  except (OSError, AttributeError):
    return
  mallopt(-4, 65536)
  mallopt(-3, MMAP_THRESHOLD)
  mallopt(-8, 1)
