"""`maxtext-moe compile RECIPE`: the recipe's train step compiled by XLA:GPU for its own GPUs and full device
count, on any machine (no GPU needed), and what the compiled program does per step.

The step is built as `train` builds it: the same recipe read (`upstream.resolution`), flag profile (its
XLA_FLAGS in effect before the backend starts), resolved config, patches and one process per GPU. The
devices are XLA:GPU compile-only devices from the jax-cuda12 plugin and the hardware table's target
description, grouped into partitions as the real cluster reports them (`upstream.maxtext.compile.topology_mesh`).
What cannot be compiled here is substituted and said (`stand_ins.substitutions`): Transformer Engine's kernels where
TE does not import, attention kernels that need cuDNN at compile time. Kernel choices are XLA's defaults:
nothing is autotuned without a GPU.
"""

import contextlib
import importlib.util
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from maxtext_moe.config import flags, hardware
from maxtext_moe.errors import EXIT_COMPILER, RunEnded, UserError
from maxtext_moe.gpu_compile import nccl_ep
from maxtext_moe.gpu_compile.stand_ins import pads_value, staged_attention, substitutions, te_ep_written_out

PLUGIN = "jax_plugins.xla_cuda12"


def plugin_installed() -> bool:
  return importlib.util.find_spec(PLUGIN) is not None


@dataclass(frozen=True)
class Target:
  """The GPUs a recipe is laid out for."""

  gpu: hardware.GpuModel
  name: str
  devices: int
  partitions: int  # NVLink domains the job spans (MaxText's slices)

  @property
  def per_partition(self) -> int:
    return self.devices // self.partitions


def target_of(keys: Any) -> Target:
  """The recipe's GPU model and device count (its layer keys), or one line saying why it has none."""
  gpu = hardware.gpu(keys.plugin.recipe_hardware)
  if gpu is None:
    raise UserError(
      f"{keys.plugin.recipe_hardware} recipes run on this machine with 'maxtext-moe train'; compile takes a GPU "
      "recipe (maxtext-moe recipes lists them)"
    )
  layout = keys.layout  # nodes x GPUs per node, in NVLink domains (`config.nodes.scale`)
  return Target(gpu, str(keys.plugin.recipe_hardware), layout.devices, layout.slices)


def _load_te() -> bool:
  """Whether TE's kernels compile here: in the environment `./setup.sh --gpu-compile-te` made, TE is
  loaded against the driver stub (`gpu_compile.te_libraries`); elsewhere TE is whatever `te.status()` finds."""
  from maxtext_moe.gpu_compile import te_libraries  # pylint: disable=import-outside-toplevel
  from maxtext_moe.upstream.te import calls as te  # pylint: disable=import-outside-toplevel

  if te_libraries.prepared():
    try:
      te_libraries.load()
    except OSError as e:
      raise UserError(
        f"{e}: the Transformer Engine compile environment is incomplete; rerun ./setup.sh --gpu-compile-te"
      ) from e
    te.status.cache_clear()
  return te.status().available


def _compiler_failed(e: Exception, hlo_dir: Path | None) -> None:
  """XLA's own failure (an INTERNAL error of a pass, not the config): one line; its whole text in --hlo DIR."""
  import jax  # pylint: disable=import-outside-toplevel

  if not isinstance(e, jax.errors.JaxRuntimeError):
    raise e
  text = str(e).strip()
  where = "rerun with --hlo DIR to keep XLA's whole message"
  if hlo_dir is not None:
    hlo_dir.mkdir(parents=True, exist_ok=True)
    (hlo_dir / "xla_error.txt").write_text(text + "\n")
    where = f"XLA's whole message: {hlo_dir / 'xla_error.txt'}"
  first = text.splitlines()[0][:300]
  raise RunEnded(f"XLA:GPU could not compile the train step: {first}; {where}", EXIT_COMPILER) from e


def _resolve(
  name: str | None, overrides: list[str], target: Target, extra: list[str], dump_to: Path | None
) -> tuple[Any, Any]:
  """(the recipe read with the compile's overrides, its resolved HyperParameters), the flag environment in
  effect first (with XLA's dump of the train step into `dump_to`)."""
  from maxtext_moe.launch import environment  # pylint: disable=import-outside-toplevel
  from maxtext_moe.upstream import resolution  # pylint: disable=import-outside-toplevel

  # The program does not depend on the weights a fine-tune starts from: compile it without them.
  deviceless = ["skip_jax_distributed_system=true", "finetune=false", *resolution.job_devices(target.devices)]
  deviceless += [f"recipe_num_devices={target.devices}"]
  recipe = resolution.read(name, [*overrides, *extra, *deviceless], keep_process_flags=False)
  if dump_to is not None:
    dump = [f"--xla_dump_to={dump_to}", "--xla_dump_hlo_as_text=true", "--xla_dump_hlo_module_re=jit_train_step"]
    recipe.flags.add_flags(dump)
  # As many CPU devices as GPUs, before the CPU backend starts (resolving starts it): a step whose state
  # MaxText keeps on the host is lowered over them (`upstream.maxtext.compile.lowering_mesh`); XLA:GPU ignores it.
  recipe.flags.add_flags([f"--xla_force_host_platform_device_count={target.devices}"])
  flags.probe(recipe.flags.xla_flags)
  os.environ["JAX_PLATFORMS"] = "cpu"  # the compile-only GPU devices come from the plugin, not a backend
  environment.apply(recipe.flags)
  return recipe, resolution.hyperparameters(recipe.resolve())


@contextlib.contextmanager
def _for_target(
  target: Target, *, te_available: bool, handles: dict[int, dict[str, int]], pad_value: bool = False
) -> Iterator[None]:
  """What the step asks the device while it is traced, answered for the target: cuDNN's attention checks,
  and where TE imports its compute capability and its NCCL EP group (the handle answered, by top-k, in
  `handles`); with `pad_value`, MLA's value head padded for cuDNN's attention under stages."""
  from maxtext_moe.upstream import jax_backend  # pylint: disable=import-outside-toplevel
  from maxtext_moe.upstream.maxtext import attention_stand_in  # pylint: disable=import-outside-toplevel
  from maxtext_moe.upstream.patches import installed  # pylint: disable=import-outside-toplevel
  from maxtext_moe.upstream.te import compile_target as te_target  # pylint: disable=import-outside-toplevel

  major, minor = target.gpu.compute_capability

  def handle_size(config: Any, top_k: int) -> int:
    group = nccl_ep.group_for(
      num_experts=config.num_experts,
      ep_size=config.ep_size,
      tokens=config.max_tokens_per_rank,
      capacity=config.recv_capacity_per_rank,
      nvlink_domain=target.gpu.nvlink_domain,
      sm_count=target.gpu.sm_count,
    )
    size = nccl_ep.handle_mem_size(group, top_k=top_k)
    handles[top_k] = {"ep_size": group.ep_size, "tokens": group.max_tokens_per_rank, "bytes": size,
                      "recv_capacity": group.recv_capacity_per_rank, "nvlink_ranks": group.nvlink_ranks}  # fmt: skip
    return size

  with contextlib.ExitStack() as stack:
    if te_available:
      stack.enter_context(te_target.for_target(major * 10 + minor))
      stack.enter_context(te_target.ep_for_target(handle_size))
    stack.enter_context(jax_backend.cudnn_attention_for_target((major, minor), hardware.CUDNN))
    if pad_value:  # MLA under stages (`stand_ins.STAGED_MLA`)
      stack.enter_context(installed(attention_stand_in.patches()))
    yield


def compile_recipe(
  name: str | None, overrides: list[str], *, hlo_dir: Path | None = None, memory_gib: float | str | None = None
) -> dict[str, Any]:
  """Compiles the recipe's train step for its GPUs; returns the report (`format_report` prints it).
  `memory_gib`: the device memory XLA schedules for (default the usable HBM: JAX hands XLA its allocator's
  limit, and XLA's latency-hiding scheduler fills it, host copies of offloaded state started early), or
  "planned": the planner's figure for the same config."""
  from maxtext_moe.gpu_compile import report as compile_report  # pylint: disable=import-outside-toplevel
  from maxtext_moe.gpu_compile.peak import peak_live_set  # pylint: disable=import-outside-toplevel
  from maxtext_moe.upstream import resolution  # pylint: disable=import-outside-toplevel
  from maxtext_moe.upstream.maxtext import compile as upstream_compile  # pylint: disable=import-outside-toplevel

  if not plugin_installed():
    raise UserError("compile needs XLA:GPU's compiler (the jax-cuda12 plugin): run ./setup.sh --gpu-compile")
  te_available = _load_te()
  first = resolution.read(name, [*overrides, "finetune=false"], keep_process_flags=False)
  target = target_of(first.keys)
  extra, said = substitutions(first, te_available=te_available)
  dump_to = hlo_dir / "xla" if hlo_dir else None
  recipe, cfg = _resolve(name, overrides, target, extra, dump_to)
  said = staged_attention(cfg, said)  # stages without MLA: JAX's cuDNN attention vmaps as it is
  if te_available and (written := te_ep_written_out(cfg, target.devices)):  # `auto` as the container resolves it
    recipe, cfg = _resolve(name, overrides, target, [*extra, *written], dump_to)
  # The planner's figures first (it plans `auto` as the container resolves it): they also refuse, in one
  # line, a layout that does not divide a parameter.
  planned = compile_report.planner_figures(name, [*overrides, *extra], target=target)
  # The device memory XLA compiles for is the allocator's share of it, as JAX passes it on a GPU.
  usable = compile_report.usable_bytes(target.gpu, recipe)
  if memory_gib == "planned":
    schedule_for = planned["device_bytes"]
  else:
    schedule_for = int(memory_gib * 2**30) if memory_gib else usable
  devices = upstream_compile.gpu_topology(
    hardware.target_config(target.gpu, schedules_for=schedule_for), partitions=1,
    hosts_per_partition=target.devices, devices_per_host=1,
  )  # fmt: skip
  mesh = upstream_compile.topology_mesh(cfg, devices, devices_per_partition=target.per_partition)
  # State MaxText keeps on the host stays there in the program, as on the GPUs (`upstream.maxtext.compile`)
  lower_on = upstream_compile.lowering_mesh(mesh) if upstream_compile.holds_state_on_host(cfg) else None
  start, handles = time.monotonic(), {}
  try:
    with _for_target(target, te_available=te_available, handles=handles, pad_value=pads_value(said)):
      compiled = upstream_compile.compile_train_step(cfg, mesh=mesh, lower_on=lower_on)
  except Exception as e:  # pylint: disable=broad-except  # jax.errors.JaxRuntimeError, raised by XLA itself
    _compiler_failed(e, hlo_dir)
  report = compile_report.build(
    cfg, compiled, target=target, recipe=recipe, usable=usable, substitutions=said,
    compile_s=time.monotonic() - start,
  )  # fmt: skip
  report["planner"], report["te_ep_handles"] = planned, list(handles.values())
  report["scheduled_for_bytes"] = schedule_for
  compile_report.compare(report)
  if hlo_dir is not None:
    report["peak"] = peak_live_set(hlo_dir / "xla")
    compile_report.keep(report, compiled.as_text(), hlo_dir)
  return report
