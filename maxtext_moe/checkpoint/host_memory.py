"""glibc settings that keep a converter's resident memory bounded by the chunks in flight.

A module of its own, importing nothing heavy, so `maxtext-moe convert` can apply them before JAX and
TensorStore start their threads."""

from maxtext_moe.glibc import mallopt

MMAP_THRESHOLD = 4 << 20


def bound_host_memory() -> None:
  """Keeps the converter's memory bounded by what is in flight, through three glibc settings:
  - a fixed mmap threshold (MALLOC_MMAP_THRESHOLD_): glibc raises its threshold after large frees (up to
    32 MB), so chunk-sized arrays would then come from the heap and stay in the process when freed.
    Measured on `bench convert` (2 cores), peak RSS over the largest tensor / GB/s: glibc default
    2.4-4.0x / 0.25-0.27; 1 MB 1.4-1.7x / 0.19-0.22 (every small temporary page-faults afresh); 16 MB
    4.2-4.3x / 0.30-0.32 once chunks were 4 MB tiles; 4 MB (chosen) 2.2x / 0.27-0.29;
  - one arena (MALLOC_ARENA_MAX): chunks are made on XLA's threads and released on TensorStore's, and
    glibc's per-thread arenas kept what one thread freed out of the others' reach. With XLA making the
    chunks, peak RSS over the largest tensor grew steadily to 3.6-4.1x; with one arena it is 2.7x, at
    the same speed. It binds threads that allocate for the first time after this call;
  - mmap on (MALLOC_MMAP_MAX_, glibc's default 65536), in case the environment turned it off (the `cpu`
    flag profile does, for training).
  No-op where libc is not glibc."""
  mallopt("MALLOC_MMAP_MAX_", 65536)
  mallopt("MALLOC_MMAP_THRESHOLD_", MMAP_THRESHOLD)
  mallopt("MALLOC_ARENA_MAX", 1)
