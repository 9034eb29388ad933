"""The one private JAX symbol we use: whether this process has started an XLA backend yet."""

from jax._src import xla_bridge


def backends_are_initialized() -> bool:
  """Whether an XLA backend started in this process (after which XLA_FLAGS no longer matter)."""
  return xla_bridge.backends_are_initialized()
