"""A job's node count and what it makes of a recipe's layout: devices, NVLink domains, the cross-node axis.

A recipe lays out one NVLink domain with its ICI degrees (`ici_*_parallelism`: 8 GPUs of an HGX node, or
the 64 GPUs of 16 nodes in one NVL72 rack) and says which DCN axis takes the domains beyond that
(`dcn_*_parallelism: -1`, MaxText's own "the rest"; MaxText's base.yml makes it `dcn_data_parallelism`).
The job's size is one key, `nodes` (`--nodes N` on every command): devices = nodes x GPUs per node, NVLink
domains (MaxText's `num_slices`) = devices / the ICI product, and the -1 DCN axis = domains / the other DCN
degrees. `per_device_batch_size` stays, so the global batch grows with the nodes.

    >>> scale(Hardware("h100"), nodes=16, ici={"expert": 8, "fsdp": 1}, dcn={"data": -1}).overrides()
    ['nodes=16', 'recipe_num_devices=128', 'num_slices=16']

On CPU a node is one process with whatever (fake) devices it has: `nodes` sets the slices alone, and the
device count is the job's. Why an NVLink domain and not a node is the unit: on a real cluster JAX gives
each device a partition (`slice_index`) from its NVLink fabric, one per NVL72 rack, else one per host,
and MaxText's multi-slice mesh lays its ICI degrees out inside each partition.
"""

import math
from dataclasses import dataclass

from maxtext_moe.config.hardware import Hardware, gpu
from maxtext_moe.errors import UserError


@dataclass(frozen=True)
class NodeLayout:
  """The job a recipe's layout makes on `nodes` nodes."""

  nodes: int
  gpus_per_node: int | None  # None on CPU: a node is one process and its devices
  devices: int  # -1 on CPU (the job's own count)
  slices: int  # NVLink domains: MaxText's num_slices
  per_slice: int | None  # devices in one NVLink domain as laid out (the ICI product)
  dcn: dict[str, int]  # the DCN degrees with the -1 axis filled
  cross_axis: str | None  # the DCN axis that took the rest (its degree was -1)

  def overrides(self) -> list[str]:
    """What the launcher adds to MaxText's argv: the device count and slices, derived here."""
    devices = [f"recipe_num_devices={self.devices}"] if self.devices > 0 else []
    return [f"nodes={self.nodes}", *devices, f"num_slices={self.slices}"]

  def describe(self) -> str:
    """'2 nodes x 8 GPUs = 16 GPUs in 2 NVLink domains of 8; across them data 2'."""
    if self.gpus_per_node is None:
      head = f"{self.nodes} node(s) (processes) of this machine's devices"
    else:
      head = f"{self.nodes} node(s) x {self.gpus_per_node} GPUs = {self.devices} GPUs"
    across = ", ".join(f"{a} {d}" for a, d in self.dcn.items() if d > 1) or "nothing (one domain)"
    size = f" of {self.per_slice}" if self.per_slice else ""
    return f"{head} in {self.slices} NVLink domain(s){size}; across them: {across}"


def gpus_per_node(hardware: Hardware | str, override: int = 0) -> int | None:
  """GPUs one node (one pod, one SLURM node) drives: `override` when > 0, else the hardware table's."""
  model = gpu(hardware)
  if model is None:
    return None
  return override if override > 0 else model.gpus_per_node


def _per_slice(hardware: str, nodes: int, g: int, ici: dict[str, int]) -> int:
  """Devices in one NVLink domain: the ICI product, or with a -1 ICI axis every node of the job that one
  NVLink domain holds (one HGX node; up to 18 nodes of one NVL72 rack)."""
  fixed = math.prod(d for d in ici.values() if d > 0)
  if -1 not in ici.values():
    return fixed
  domain_nodes = max(gpu(hardware).nvlink_domain // g, 1)
  return g * min(nodes, domain_nodes)


def _problem(hardware: str, nodes: int, g: int, ici: dict[str, int], dcn: dict[str, int]) -> str | None:
  """Why `nodes` (>= 1) nodes cannot run this layout (None when they can)."""
  model = gpu(hardware)
  per_slice = _per_slice(hardware, nodes, g, ici)
  domain = min(model.nvlink_domain, g) if model.nvlink_domain == model.gpus_per_node else model.nvlink_domain
  if per_slice % g or per_slice > domain:
    span = "more GPUs than one NVLink domain" if per_slice > domain else "part of a node"
    return (
      f"the ICI degrees lay out {per_slice} GPUs per NVLink domain, {span} ({g} GPUs per node, NVLink domains "
      f"of {domain}); lay out whole nodes inside one domain and put the rest on a dcn_*_parallelism axis"
    )
  devices = nodes * g
  if devices % per_slice:
    return f"{nodes} nodes x {g} GPUs = {devices} GPUs is not a whole number of NVLink domains of {per_slice} GPUs"
  return _dcn_problem(devices // per_slice, dcn)


def _dcn_problem(slices: int, dcn: dict[str, int]) -> str | None:
  fixed = math.prod(d for d in dcn.values() if d > 0)
  auto = [a for a, d in dcn.items() if d == -1]
  if auto and slices % fixed:
    return f"{slices} NVLink domains do not divide by the fixed DCN degrees' product {fixed}"
  if not auto and slices != fixed:
    return (
      f"the DCN degrees lay out {fixed} NVLink domain(s) but the job has {slices}; set one dcn_*_parallelism "
      "to -1 to take the rest (dcn_data_parallelism=-1: data parallel across nodes)"
    )
  return None


def valid_nodes(hardware: str, g: int, ici: dict[str, int], dcn: dict[str, int], *, near: int) -> list[int]:
  """The node counts nearest `near` (one below, one above, when they exist) that can run this layout."""
  below = next((n for n in range(near - 1, 0, -1) if _problem(hardware, n, g, ici, dcn) is None), None)
  above = next((n for n in range(near + 1, 8 * near + 64) if _problem(hardware, n, g, ici, dcn) is None), None)
  return [n for n in (below, above) if n is not None]


def _fill(degrees: dict[str, int], total: int) -> tuple[dict[str, int], str | None]:
  auto = next((a for a, d in degrees.items() if d == -1), None)
  if auto is None:
    return dict(degrees), None
  fixed = math.prod(d for d in degrees.values() if d > 0)
  return degrees | {auto: total // fixed}, auto


def _nodes_from_devices(devices: int, g: int) -> int:
  if devices % g:
    raise UserError(
      f"recipe_num_devices={devices} is not a whole number of {g}-GPU nodes; set nodes=N (--nodes N) instead"
    )
  return devices // g


def scale(
  hardware: Hardware | str,
  *,
  nodes: int,
  ici: dict[str, int],
  dcn: dict[str, int],
  recipe_devices: int = -1,
  num_slices: int = -1,
  gpus_per_node_override: int = 0,
) -> NodeLayout:
  """The layout on `nodes` nodes (-1: from `recipe_devices` if set, else 1), or one line naming what does
  not fit and the nearest node counts that do.

  Args:
    hardware: the recipe's `recipe_hardware`.
    nodes: the `nodes` key.
    ici, dcn: {axis: degree} of the `ici_*` / `dcn_*_parallelism` keys (-1: the rest).
    recipe_devices, num_slices: the keys of those names as set (-1: not set); they must agree with `nodes`.
    gpus_per_node_override: the `gpus_per_node` key (0: the hardware table's).
  """
  g = gpus_per_node(hardware, gpus_per_node_override)
  if g is None:
    return _cpu(nodes, dcn, recipe_devices)
  if nodes == -1:
    nodes = _nodes_from_devices(recipe_devices, g) if recipe_devices > 0 else 1
  elif recipe_devices > 0 and recipe_devices != nodes * g:
    raise UserError(
      f"recipe_num_devices={recipe_devices} and nodes={nodes} disagree ({nodes} x {g} GPUs = {nodes * g}); "
      "set only nodes (--nodes N): the device count follows from it"
    )
  if nodes < 1:
    raise UserError(f"nodes={nodes}: a job has at least one node (--nodes N, N >= 1)")
  why = _problem(str(hardware), nodes, g, ici, dcn)
  if why:
    near = valid_nodes(str(hardware), g, ici, dcn, near=max(nodes, 1))
    hint = f"; use --nodes {' or '.join(map(str, near))}" if near else ""
    raise UserError(f"{why}{hint}")
  per_slice = _per_slice(str(hardware), nodes, g, ici)
  slices = nodes * g // per_slice
  if num_slices > 0 and num_slices != slices:
    raise UserError(
      f"num_slices={num_slices} but {nodes} node(s) make {slices} NVLink domain(s) of {per_slice} GPUs; leave "
      "num_slices unset: it follows from nodes"
    )
  filled, cross = _fill(dcn, slices)
  return NodeLayout(nodes, g, nodes * g, slices, per_slice, filled, cross)


def _cpu(nodes: int, dcn: dict[str, int], recipe_devices: int) -> NodeLayout:
  """On CPU each node is one process: the slices are the nodes; the device count is the job's."""
  nodes = 1 if nodes == -1 else nodes
  if nodes < 1:
    raise UserError(f"nodes={nodes}: a job has at least one node")
  why = _cpu_problem(nodes, dcn)
  if why:
    raise UserError(why)
  if recipe_devices > 0 and recipe_devices % nodes:
    raise UserError(f"recipe_num_devices={recipe_devices} does not split over nodes={nodes}")
  filled, cross = _fill(dcn, nodes)
  per_slice = recipe_devices // nodes if recipe_devices > 0 else None
  return NodeLayout(nodes, None, recipe_devices, nodes, per_slice, filled, cross)


def _cpu_problem(nodes: int, dcn: dict[str, int]) -> str | None:
  """`_dcn_problem` on CPU, where a node is one process: fixed DCN degrees that need more nodes than the job
  has name the processes to start and the degrees to drop instead ("1 NVLink domains do not divide by the
  fixed DCN degrees' product 2" named neither)."""
  why = _dcn_problem(nodes, dcn)
  fixed = math.prod(d for d in dcn.values() if d > 0)
  auto = -1 in dcn.values()
  if why is None or (not auto and nodes > fixed):
    return why  # None, or more nodes than the degrees lay out: the line says to set a degree to -1
  need = fixed * math.ceil(nodes / fixed)
  degrees = {f"dcn_{a}_parallelism": d for a, d in dcn.items() if d > 1}
  return (
    f"{' x '.join(f'{k}={d}' for k, d in degrees.items())} needs {'a multiple of ' * auto}{fixed} nodes but this "
    f"job has {nodes}, and on CPU a node is one process: start {need} (maxtext-moe launch --nproc-per-node 1 "
    f"--nnodes {need}), or set {' '.join(f'{k}=1' for k in degrees)}"
  )


def global_batch(per_device_batch_size: float, devices: int, gradient_accumulation_steps: int = 1) -> int:
  """Sequences per optimizer step over the whole job, as MaxText counts them (its micro-batch x the
  accumulation steps)."""
  return int(devices * float(per_device_batch_size)) * max(int(gradient_accumulation_steps), 1)
