"""The private JAX symbols we use: whether this process has started an XLA backend yet, and the trace-time
device checks of JAX's cuDNN attention, answered for a GPU this process compiles for but does not have."""

import contextlib
from collections.abc import Iterator

from jax._src import xla_bridge


def backends_are_initialized() -> bool:
  """Whether an XLA backend started in this process (after which XLA_FLAGS no longer matter)."""
  return xla_bridge.backends_are_initialized()


def _capability(text: str) -> tuple[int, ...]:
  return tuple(int(x) for x in text.split("."))


@contextlib.contextmanager
def cudnn_attention_for_target(compute_capability: tuple[int, int], cudnn: tuple[int, int]) -> Iterator[None]:
  """While the context is open, JAX's cuDNN attention (`jax.nn.dot_product_attention(implementation="cudnn")`,
  MaxText's `cudnn_flash_jax`) is traced for a GPU of `compute_capability` with cuDNN `cudnn`, as in a
  deviceless compile for that GPU (`maxtext-moe compile`). JAX asks the first local GPU device and the loaded
  cuDNN library while tracing; a process whose backend is the CPU has neither, and JAX would refuse MLA's
  unequal head dims ("mla requires cudnn version >= 9.10 and at least hopper arch"). XLA:GPU then compiles
  the `__cudnn$fmha*` custom calls as they are; cuDNN sizes their workspace only when it builds the graph on
  a device."""
  from jax._src.cudnn import fused_attention_stablehlo as module  # pylint: disable=import-outside-toplevel

  real = (module.check_cudnn_version, module.check_compute_capability, module.is_cuda_compute_capability_equal)
  module.check_cudnn_version = lambda: cudnn[0] * 10000 + cudnn[1] * 100
  module.check_compute_capability = lambda capability: compute_capability >= _capability(capability)
  module.is_cuda_compute_capability_equal = lambda capability: compute_capability == _capability(capability)
  try:
    yield
  finally:
    module.check_cudnn_version, module.check_compute_capability, module.is_cuda_compute_capability_equal = real
