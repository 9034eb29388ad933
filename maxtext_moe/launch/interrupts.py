"""SIGTERM and SIGINT during training: finish the step, save a checkpoint, stop, say how to resume.

What SLURM and Kubernetes send before they evict a job is SIGTERM; a person at a terminal sends SIGINT.
Either asks the run to stop at the next step boundary (`upstream.maxtext.recovery`): MaxText saves a checkpoint
there, the launcher writes the summary and plot and exits with EXIT_RESUMABLE (75). A second signal stops
at once (KeyboardInterrupt: exit 130, the in-flight checkpoint, if any, is left to Orbax's atomic rename).

In a multi-process job JAX's own preemption service has SIGTERM (all processes must agree on the step to
save at), so only SIGINT is caught here, and turned into a SIGTERM for it.
"""

import contextlib
import os
import signal
from collections.abc import Iterator

from maxtext_moe import stderr
from maxtext_moe.upstream.maxtext.recovery import Recovery


@contextlib.contextmanager
def graceful_stop(rec: Recovery, *, distributed: bool) -> Iterator[list[str]]:
  """Signal handlers for a run; yields the list of signal names received (first one first)."""
  received: list[str] = []

  def handler(signum, frame):
    del frame
    name = signal.Signals(signum).name
    received.append(name)
    if len(received) > 1:
      raise KeyboardInterrupt
    stderr.say(f"maxtext-moe: {name}: finishing this step and saving a checkpoint; send it again to stop at once")
    if distributed:
      os.kill(os.getpid(), signal.SIGTERM)  # to JAX's preemption service, which agrees on a step
    else:
      rec.request_stop()

  names = [signal.SIGINT] if distributed else [signal.SIGINT, signal.SIGTERM]
  previous = {s: signal.signal(s, handler) for s in names}
  try:
    yield received
  finally:
    for s, h in previous.items():
      signal.signal(s, h)
