"""MaxText's device mesh across nodes whose devices report no NVLink partition (CPU processes).

MaxText lays a multi-slice job out with `mesh_utils.create_hybrid_device_mesh`, which groups the devices
by their `slice_index`: on a GPU cluster JAX sets it from the NVLink fabric (one per NVL72 rack) or the
host. CPU devices all report slice 0, so a job of several CPU processes as several "nodes" (`nodes=N` on
CPU: our tests of the node-count path) would fail there ("Number of slices 1 must equal the product of
dcn_mesh_shape"). For CPU devices, and only those, the processes are the granules
(`process_is_granule=True`): each process's devices are one slice laid out by the ICI degrees, the
processes by the DCN degrees. Everything else goes to MaxText's own function.
"""

from typing import Any

import jax
from jax.experimental import mesh_utils
from maxtext.utils import max_utils, maxtext_utils

from maxtext_moe.upstream.patches import Patch, original


def create_device_mesh(config: Any, devices: Any = None) -> Any:
  """MaxText's `create_device_mesh`, with processes as slices where devices have no `slice_index`."""
  devices = jax.devices() if devices is None else devices
  slices = int(config.num_slices)
  reported = {getattr(d, "slice_index", 0) for d in devices}
  if slices <= 1 or len(reported) == slices or devices[0].platform != "cpu":
    return original(maxtext_utils, "create_device_mesh")(config, devices)
  per_slice = len(devices) // slices
  ici = max_utils.fill_unspecified_mesh_axes(list(config.ici_parallelism), per_slice, "ICI")
  dcn = max_utils.fill_unspecified_mesh_axes(list(config.dcn_parallelism), slices, "DCN")
  return mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, process_is_granule=True)


def patches() -> list[Patch]:
  return [Patch(maxtext_utils, "create_device_mesh", create_device_mesh)]
