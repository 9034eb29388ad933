"""MaxText's own counts of a training step: its FLOPs, and the step compiled ahead of time, for the visible
devices or for GPUs that are not there.

- `train_tflops_per_device`: MaxText's `calculate_tflops_training_per_device` (the planner's FLOPs);
  `expert_tflops_per_device` the routed and shared experts' part of it (the step-time model's classes).
- `compile_train_step`: MaxText's train step built as its `train_compile.py` builds it (shaped inputs, the
  ZeRO-1 shardings, `get_functional_train_with_signature`) and compiled; nothing is allocated.
  `compiled_train_memory` is its `memory_analysis()`.
- `gpu_topology` / `topology_mesh`: compile-only GPU devices (XLA:GPU with no GPU attached, from the
  jax-cuda12 plugin and a target description) and MaxText's mesh over them, grouped into partitions the
  way a real cluster reports them (see `topology_mesh`).
- `lowered_train_step`: the step lowered for any platform with `jax.export` (the offload tests).
- `holds_state_on_host` / `compile_train_step(..., lower_on=...)`: a step whose train state MaxText keeps in
  host memory (`optimizer_memory_host_offload`, `parameter_memory_host_offload`) is lowered over CPU devices
  of the same mesh shape, which have a host memory space (the compile-only GPU devices have none, and JAX
  drops a sharding's `pinned_host` there), for CUDA, and that module is compiled by the compile-only GPU
  client: the program holds the state in host memory and moves it as a GPU run's does.
"""

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from flax.linen import partitioning as nn_partitioning
from maxtext.trainers.pre_train import train, train_compile
from maxtext.utils import maxtext_utils, sharding

from maxtext_moe.upstream.maxtext import moe_layer
from maxtext_moe.upstream.maxtext.model import model_patches
from maxtext_moe.upstream.patches import Patch, installed
from maxtext_moe.upstream.pipeline import moe_stages as pipeline


def train_tflops_per_device(cfg: Any) -> tuple[float, float, float]:
  """(total, learnable-weight, attention) TFLOPs of one training step per device, MaxText's own count."""
  total, weights, attention = maxtext_utils.calculate_tflops_training_per_device(cfg, log=False)
  return float(total), float(weights), float(attention)


def expert_tflops_per_device(cfg: Any) -> tuple[float, float]:
  """(routed, shared) experts' TFLOPs of one training step per device, forward and backward (x 3), by
  MaxText's own helpers: the part of `train_tflops_per_device`'s weight FLOPs that the grouped GEMMs run,
  and the shared experts' beside them (MTP layers included, as MaxText counts them)."""
  if int(cfg.num_experts) <= 1:
    return 0.0, 0.0
  _, moe_layers = maxtext_utils.get_dense_moe_layers(cfg)
  moe_layers += int(getattr(cfg, "mtp_num_layers", 0) or 0)
  routed = maxtext_utils.calculate_ffn_mamtul_tflops_per_device(cfg, cfg.moe_mlp_dim) * cfg.num_experts_per_tok
  shared_dim = maxtext_utils.get_shared_expert_mlp_dim(cfg)
  shared = maxtext_utils.calculate_ffn_mamtul_tflops_per_device(cfg, shared_dim) * int(cfg.shared_experts or 0)
  scale = 3 * moe_layers * int(cfg.gradient_accumulation_steps) / 1e12
  return float(routed * scale), float(shared * scale)


@dataclasses.dataclass(frozen=True)
class _TrainStep:
  """MaxText's train step with its shaped inputs and shardings, as its `train_compile.py` prepares it."""

  func: Any
  args: Any
  kwargs: Any
  mesh: Any
  in_shardings: Any
  out_shardings: Any
  static_argnums: Any
  donate_argnums: Any

  def jitted(self) -> Any:
    """`jax.jit` of the step with its shardings (traced inside its mesh and MaxText's axis rules)."""
    return jax.jit(
      self.func,
      in_shardings=self.in_shardings,
      out_shardings=self.out_shardings,
      static_argnums=self.static_argnums,
      donate_argnums=self.donate_argnums,
    )


def _train_step(cfg: Any) -> _TrainStep:
  mesh = maxtext_utils.get_mesh_from_config(cfg)
  args, kwargs, state_shardings, _, model = train_compile.get_shaped_inputs(mesh, cfg)
  params_shardings, state_shardings = sharding.maybe_update_params_sharding_with_opt(cfg, state_shardings)
  input_shardings = sharding.build_zero1_input_state_mesh_shardings(cfg, state_shardings, params_shardings)
  data_sharding = sharding.get_input_data_sharding(cfg, mesh)
  func, in_sh, out_sh, static, donate = maxtext_utils.get_functional_train_with_signature(
    train.train_step, data_sharding, input_shardings, model, cfg, params_shardings
  )
  return _TrainStep(func, args, kwargs, mesh, in_sh, out_sh, static, donate)


@contextlib.contextmanager
def _on(mesh: Any | None) -> Iterator[None]:
  """MaxText asked for its mesh gets `mesh` (compile-only devices), and work that picks a kernel by the
  default device (tokamax) sees one of them; with None, the visible devices as they are."""
  if mesh is None:
    yield
    return
  answer = Patch(maxtext_utils, "get_mesh_from_config", lambda config, devices=None: mesh)
  with installed([answer]), jax.default_device(mesh.devices.flat[0]):
    yield


def holds_state_on_host(cfg: Any) -> bool:
  """Whether MaxText keeps part of the train state in host memory between steps (its offload keys)."""
  return bool(cfg.optimizer_memory_host_offload or cfg.parameter_memory_host_offload)


def compile_train_step(cfg: Any, *, mesh: Any | None = None, lower_on: Any | None = None) -> Any:
  """The compiled train step (`jax.stages.Compiled`) of a resolved config (HyperParameters), with our
  model patches, on `mesh` (default: MaxText's mesh over the visible devices). With `lower_on` (a mesh of
  CPU devices shaped as `mesh`, `lowering_mesh`) the step is lowered there for CUDA and compiled for
  `mesh`'s compile-only GPUs (`HostStateProgram`): the state MaxText offloads stays in host memory."""
  with installed([*model_patches(cfg), *pipeline.step_patches()]), moe_layer.te_guard(), _on(mesh):
    moe_layer.prepare_te_ep(cfg)  # TE's NCCL EP, as `train` bootstraps it (a compile's: `upstream.te_target`)
    if lower_on is not None:
      return _compiled_from_cpu_lowering(cfg, mesh, lower_on)
    s = _train_step(cfg)
    rules = nn_partitioning.axis_rules(cfg.logical_axis_rules)
    # Compiled inside the mesh, as MaxText's train loop compiles its step (train_compile lowers inside it
    # but compiles outside): TE EP's partitioning callbacks, which XLA runs while compiling, read it.
    shardings = (s.in_shardings, s.out_shardings, s.static_argnums, s.donate_argnums)
    with jax.set_mesh(s.mesh):
      return train_compile.jit_and_compile(s.func, s.args, s.kwargs, s.mesh, *shardings, cfg, rules)


def lowering_mesh(mesh: Any) -> Any:
  """A mesh of this process's CPU devices shaped and named as `mesh` (compile-only GPU devices): device i of
  `mesh.devices.flat` and of the result stand for the same GPU. Too few (the CPU backend started before
  `compile` set `--xla_force_host_platform_device_count`) is a bug in the caller: RuntimeError."""
  from jax.sharding import Mesh  # pylint: disable=import-outside-toplevel

  cpus = jax.devices("cpu")
  if len(cpus) < mesh.devices.size:
    raise RuntimeError(
      f"lowering the train step with its state in host memory needs {mesh.devices.size} CPU devices and this "
      f"process has {len(cpus)}: set XLA_FLAGS=--xla_force_host_platform_device_count={mesh.devices.size} "
      "before JAX starts"
    )
  devices = np.array(cpus[: mesh.devices.size]).reshape(mesh.devices.shape)
  return Mesh(devices, mesh.axis_names, axis_types=mesh.axis_types)


@dataclasses.dataclass(frozen=True)
class HostStateProgram:
  """The compiled step of `compile_train_step(..., lower_on=...)`: what the report reads of a
  `jax.stages.Compiled` (`memory_analysis()`, `as_text()`), from XLA's executable."""

  executable: Any

  def memory_analysis(self) -> Any:
    return self.executable.get_compiled_memory_stats()

  def as_text(self) -> str:
    return self.executable.hlo_modules()[0].to_string()


def _compiled_from_cpu_lowering(cfg: Any, mesh: Any, cpu_mesh: Any) -> HostStateProgram:
  """MaxText's train step traced over `cpu_mesh` (whose devices have host memory, so the state's
  `pinned_host` shardings and MaxText's moves of it to the device are lowered, as on a GPU), lowered for
  CUDA, and compiled by the compile-only client of `mesh`'s GPUs, each standing where its CPU device stood
  (JAX's shardings name devices by their place in the mesh). The compile options are the ones jit builds
  from the same lowering (`pxla.create_compile_options`: which outputs XLA may shard, MaxText's
  `compile_xla_flags`), for the GPUs."""
  from jax._src.interpreters import pxla  # pylint: disable=import-outside-toplevel
  from maxtext.utils import max_utils  # pylint: disable=import-outside-toplevel

  answer = Patch(maxtext_utils, "get_mesh_from_config", lambda config, devices=None: cpu_mesh)
  with installed([answer]):
    s = _train_step(cfg)
  rules = nn_partitioning.axis_rules(cfg.logical_axis_rules)
  with jax.set_mesh(s.mesh), rules:
    lowered = s.jitted().trace(*s.args, **s.kwargs).lower(lowering_platforms=("cuda",))
    module = lowered.compiler_ir("stablehlo")
  lowering = lowered._lowering.compile_args  # pylint: disable=protected-access  # what jit compiles it with
  effects = len(lowering["ordered_effects"])
  to_inputs, to_outputs = pxla.get_prop_to_input_output(lowering["in_shardings"], lowering["out_shardings"], effects)
  gpus = np.array(list(mesh.devices.flat), dtype=object)
  flags = max_utils.parse_libtpu_flags_to_dict(cfg.compile_xla_flags)
  client = gpus[0].client
  options = pxla.create_compile_options(module, lowering["tuple_args"], to_inputs, to_outputs, client, gpus, flags)
  with jax.set_mesh(s.mesh):  # TE EP's partitioning callbacks read it while XLA compiles
    devices = pxla._create_device_list(tuple(gpus))  # pylint: disable=protected-access  # JAX's own, as jit's
    executable = client.compile(module, executable_devices=devices, compile_options=options)
  return HostStateProgram(executable)


def memory(compiled: Any) -> dict[str, int]:
  """XLA's `memory_analysis()` per device: argument/output/alias/temp bytes, on device and host."""
  mem = compiled.memory_analysis()
  names = ("argument", "output", "alias", "temp")
  out = {f"{n}_bytes": int(getattr(mem, f"{n}_size_in_bytes")) for n in names}
  out.update({f"host_{n}_bytes": int(getattr(mem, f"host_{n}_size_in_bytes")) for n in names})
  return out


def compiled_train_memory(cfg: Any) -> dict[str, int]:
  """`memory` of the train step compiled for the visible devices."""
  return memory(compile_train_step(cfg))


def gpu_topology(target_config: str, *, partitions: int, hosts_per_partition: int, devices_per_host: int) -> Any:
  """Compile-only GPU devices ("partitions x hosts per partition x devices per host"). Needs the
  jax-cuda12 plugin and `JAX_PLATFORMS=cpu`; no GPU or CUDA driver."""
  from jax.experimental import topologies  # pylint: disable=import-outside-toplevel

  shape = f"{partitions}x{hosts_per_partition}x{devices_per_host}"
  return topologies.get_topology_desc(platform="cuda", target_config=target_config, topology=shape).devices


def topology_mesh(cfg: Any, devices: list, *, devices_per_partition: int) -> Any:
  """MaxText's mesh for `cfg` over compile-only devices. On a real cluster jax 0.12 gives each device a
  partition (`slice_index`, which MaxText's multi-slice mesh groups by) from its NVLink fabric (one per
  NVL72 rack) or else its host; the compile-only devices all report partition 0, so they are grouped here:
  consecutive `devices_per_partition` devices (in process order) form one partition, each laid out by ICI
  degrees, the partitions by DCN degrees, as `mesh_utils.create_hybrid_device_mesh` does."""
  from jax.experimental import mesh_utils  # pylint: disable=import-outside-toplevel
  from jax.sharding import Mesh  # pylint: disable=import-outside-toplevel

  slices = max(int(cfg.num_slices), 1)
  if slices == 1:
    array = maxtext_utils.create_device_mesh(cfg, devices)
  else:
    ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
    granules = [ordered[i : i + devices_per_partition] for i in range(0, len(ordered), devices_per_partition)]
    ici = list(cfg.ici_parallelism)
    dcn = list(cfg.dcn_parallelism)
    per_slice = [mesh_utils.create_device_mesh(ici, g) for g in granules]
    blocks = np.vectorize(lambda i: per_slice[i], otypes=[object])(np.arange(len(per_slice)).reshape(dcn))
    array = np.block(blocks.tolist())
  return Mesh(array, cfg.mesh_axes)


def lowered_train_step(cfg: Any, *, platform: str) -> str:
  """The train step's StableHLO text as lowered for `platform` ("cpu", "cuda", "rocm", "tpu"), on any
  machine: jax.export lowers for a platform it does not run on. Nothing is compiled."""
  from jax import export  # pylint: disable=import-outside-toplevel

  with installed([*model_patches(cfg), *pipeline.step_patches()]), moe_layer.te_guard():
    s = _train_step(cfg)
    with jax.set_mesh(s.mesh), nn_partitioning.axis_rules(cfg.logical_axis_rules):
      return export.export(s.jitted(), platforms=[platform])(*s.args, **s.kwargs).mlir_module()
