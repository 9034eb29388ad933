"""`maxtext-moe compile RECIPE`: the recipe's train step compiled by XLA:GPU for its own GPUs and full device
count, on any machine (no GPU needed), and what the compiled program does per step.

The step is built as `train` builds it: the same recipe read (`upstream.recipe`), flag profile (its
XLA_FLAGS in effect before the backend starts), resolved config, patches and one process per GPU. The
devices are XLA:GPU compile-only devices from the jax-cuda12 plugin and the hardware table's target
description, grouped into partitions as the real cluster reports them (`upstream.compile.topology_mesh`).
What cannot be compiled here is substituted and said (`substitutions`): Transformer Engine's kernels where
TE does not import, attention kernels that need cuDNN at compile time. Kernel choices are XLA's defaults:
nothing is autotuned without a GPU.
"""

import contextlib
import importlib.util
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from maxtext_moe.config import flags, hardware
from maxtext_moe.errors import EXIT_COMPILER, RunEnded, UserError

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


def substitutions(recipe: Any, *, te_available: bool) -> tuple[list[str], list[str]]:
  """(overrides, plain words) for what this machine cannot compile as the recipe's container would run it.
  With TE (`./setup.sh --gpu-compile-te`) its grouped GEMM is compiled as itself, and `auto` is written
  out as the `te` the container picks (the compiling process's own platform is the CPU); TE's NCCL EP never
  compiles here (`upstream.te_compile`)."""
  extra, said = [], []
  keys = recipe.keys
  gemm, dispatch = str(keys.plugin.moe_gemm_backend), str(keys.plugin.moe_dispatch)
  quantized = str(keys.plugin.moe_gemm_quantization)
  if keys.maxtext["te_moe_block"]:  # MaxText's TE block, not ours (substituted below)
    gemm = dispatch = "maxtext"
  if te_available and gemm == "auto":
    extra.append("moe_gemm_backend=te")
  if not te_available and gemm in ("auto", "te"):
    extra.append("moe_gemm_backend=tokamax")
    said.append(
      f"moe_gemm_backend={gemm}: the container runs Transformer Engine's grouped GEMM (te), which does not import "
      "here; compiled with tokamax (Mosaic GPU), what auto picks on a GPU without TE (./setup.sh --gpu-compile-te "
      "compiles TE's own)"
    )
    if quantized != "none":
      extra.append("moe_gemm_quantization=none")
      said.append(f"moe_gemm_quantization={quantized} is TE's grouped GEMM: tokamax's is compiled in bf16")
  if dispatch in ("auto", "te_ep") and keys.expert_parallelism > 1:
    ep_extra, ep_said = _te_ep_substitution(recipe, dispatch, gemm, te_available=te_available)
    extra, said = extra + ep_extra, said + ep_said
  if keys.plugin.offload in ("optimizer", "optimizer_params", "all"):
    said.append(
      f"offload={keys.plugin.offload}: XLA:GPU's compile-only devices have no host memory space, so JAX 0.12 drops "
      "every pinned_host placement of the state (a NamedSharding's memory_kind becomes None) and the offloaded "
      "state is counted on the device here; `fits` subtracts the planner's offloaded state (activations the "
      "remat policy offloads do move: host_transfers)"
    )
  extra_te, said_te = _te_substitutions(keys.maxtext, te_available=te_available)
  extra, said = extra + extra_te, said + said_te
  if str(keys.maxtext["attention"]) == "cudnn_flash_te":
    extra.append("attention=cudnn_flash_jax")
    said.append(
      "attention=cudnn_flash_te is TE's cuDNN flash attention, which asks the driver for its backend and builds "
      "cuDNN graphs while the step is traced: compiled with cudnn_flash_jax, the same cuDNN fused attention "
      "through XLA's own custom call (its workspace, which cuDNN sizes on a device, is not counted)"
    )
  return extra, said


def _te_ep_substitution(recipe: Any, dispatch: str, gemm: str, *, te_available: bool) -> tuple[list[str], list[str]]:
  """TE's NCCL EP, which never compiles here, as all_to_all: at its worst-case buffers, as te_ep's dropless
  receive buffer is, so the experts' outputs a remat policy saves are in the program (the bounded rounds
  recompute them whatever it says); a moe_buffers the user names is kept."""
  extra, said = ["moe_dispatch=all_to_all"], []
  quantized = str(recipe.keys.plugin.moe_gemm_quantization)
  why = (
    "which needs NCCL communicators (ep_bootstrap) that a process without GPUs cannot create, and TE asks "
    "them for its handle size while the step is traced"
    if te_available
    else "which needs TE and NCCL communicators"
  )
  named = any(o.startswith("moe_buffers=") for o in getattr(recipe, "user_overrides", ()))
  if not named:
    extra.append("moe_buffers=worst_case")
  said.append(
    f"moe_dispatch={dispatch}: the container runs TE's NCCL EP (te_ep), {why}; compiled with all_to_all "
    + ("(its buffers as moe_buffers says)" if named else "at its worst-case buffers, as te_ep's receive buffer is")
  )
  if te_available and quantized == "mxfp8" and gemm in ("auto", "te"):
    extra.append("moe_gemm_quantization=fp8")
    said.append(
      "moe_gemm_quantization=mxfp8 needs te_ep's 128-row aligned groups: TE's grouped GEMM is compiled in fp8 "
      "(per-tensor scales) instead"
    )
  return extra, said


def _te_substitutions(maxtext: dict[str, Any], *, te_available: bool) -> tuple[list[str], list[str]]:
  """MaxText's own TE paths (its TE MoE block, TE's FP8 dense GEMMs): they need TE to trace, and its block's
  expert parallelism TE's NCCL EP, which never compiles here."""
  extra, said = [], []
  quantization = str(maxtext["quantization"] or "")
  if maxtext["te_moe_block"]:
    # Not MaxText's own sparse_matmul: at DeepSeek-V3's batch 6 x 4,096 its ragged all-to-all path needed
    # 1,049 GiB of temporaries per GB300, nothing like TE's fused block; ours is the portable dropless one.
    gemm = "te" if te_available else "tokamax"
    extra += ["te_moe_block=false", "prefuse_moe_weights=false", "moe_impl=dropless"]
    extra += [f"moe_gemm_backend={gemm}", "moe_dispatch=all_to_all"]
    # TE's moe() keeps residuals of its own, which the remat policy recomputes (the planner's model of it):
    # our block's expert outputs are recomputed to match (under the bounded rounds they always are).
    extra += ["moe_mlpwi_0=remat", "moe_mlpwi_1=remat", "moe_mlpwo=remat"]
    why = "whose expert parallelism is TE's NCCL EP" if te_available else "which does not import here"
    said.append(
      f"te_moe_block=true runs Transformer Engine's fused moe(), {why}: compiled with our dropless block "
      f"instead ({gemm} grouped GEMM, all_to_all dispatch, unfused weights, its expert outputs recomputed as "
      "TE's residuals are)"
    )
  if quantization.startswith("te_") and quantization != "te_no_quant" and not te_available:
    # Flax's FP8 dot (MaxText's `fp8`): XLA:GPU's own FP8 GEMMs (cuBLASLt), the same operands in FP8.
    extra.append("quantization=fp8")
    said.append(
      f"quantization={quantization} is Transformer Engine's dense GEMM, which does not import here: compiled "
      "with MaxText's fp8 (Flax's FP8 dot, cuBLASLt's FP8 GEMMs in XLA:GPU)"
      + (", per-tensor scales for MXFP8's blocks" if quantization == "te_mxfp8" else "")
    )
  elif quantization.startswith("te_") and not te_available:
    extra.append("quantization=")
    said.append(f"quantization={quantization} is Transformer Engine's bf16 dense: compiled with MaxText's own")
  return extra, said


def _load_te() -> bool:
  """Whether TE's kernels compile here: in the environment `./setup.sh --gpu-compile-te` made, TE is
  loaded against the driver stub (`upstream.te_compile`); elsewhere TE is whatever `te.status()` finds."""
  from maxtext_moe.upstream import te, te_compile  # pylint: disable=import-outside-toplevel

  if te_compile.prepared():
    try:
      te_compile.load()
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
  from maxtext_moe.upstream import config as upstream_config  # pylint: disable=import-outside-toplevel
  from maxtext_moe.upstream import recipe as recipes  # pylint: disable=import-outside-toplevel

  deviceless = ["skip_jax_distributed_system=true", "internal_compile=true"]
  deviceless += [f"internal_compile_num_devices={target.devices}", f"recipe_num_devices={target.devices}"]
  recipe = recipes.read(name, [*overrides, *extra, *deviceless], keep_process_flags=False)
  if dump_to is not None:
    dump = [f"--xla_dump_to={dump_to}", "--xla_dump_hlo_as_text=true", "--xla_dump_hlo_module_re=jit_train_step"]
    recipe.flags.add_flags(dump)
  flags.probe(recipe.flags.xla_flags)
  os.environ["JAX_PLATFORMS"] = "cpu"  # the compile-only GPU devices come from the plugin, not a backend
  environment.apply(recipe.flags)
  return recipe, upstream_config.hyperparameters(recipe.resolve())


def compile_recipe(name: str | None, overrides: list[str], *, hlo_dir: Path | None = None) -> dict[str, Any]:
  """Compiles the recipe's train step for its GPUs; returns the report (`format_report` prints it)."""
  from maxtext_moe.tools import compile_report  # pylint: disable=import-outside-toplevel
  from maxtext_moe.tools.peak import peak_live_set  # pylint: disable=import-outside-toplevel
  from maxtext_moe.upstream import compile as upstream_compile  # pylint: disable=import-outside-toplevel
  from maxtext_moe.upstream import jax_backend, te  # pylint: disable=import-outside-toplevel
  from maxtext_moe.upstream import recipe as recipes  # pylint: disable=import-outside-toplevel

  if not plugin_installed():
    raise UserError("compile needs XLA:GPU's compiler (the jax-cuda12 plugin): run ./setup.sh --gpu-compile")
  te_available = _load_te()
  first = recipes.read(name, overrides, keep_process_flags=False)
  target = target_of(first.keys)
  extra, said = substitutions(first, te_available=te_available)
  recipe, cfg = _resolve(name, overrides, target, extra, hlo_dir / "xla" if hlo_dir else None)
  # The planner's figures first: they also refuse, in one line, a layout that does not divide a parameter.
  planned = compile_report.planner_figures(name, [*overrides, *extra], target=target)
  # The device memory XLA compiles for is the allocator's share of it, as JAX passes it on a GPU.
  usable = compile_report.usable_bytes(target.gpu, recipe)
  devices = upstream_compile.gpu_topology(
    hardware.target_config(target.gpu, memory_bytes=usable),
    partitions=1,
    hosts_per_partition=target.devices,
    devices_per_host=1,
  )
  mesh = upstream_compile.topology_mesh(cfg, devices, devices_per_partition=target.per_partition)
  start = time.monotonic()
  major, minor = target.gpu.compute_capability
  try:
    with contextlib.ExitStack() as tracing_for_target:
      if te_available:
        tracing_for_target.enter_context(te.for_target(major * 10 + minor))
      tracing_for_target.enter_context(jax_backend.cudnn_attention_for_target((major, minor), hardware.CUDNN))
      compiled = upstream_compile.compile_train_step(cfg, mesh=mesh)
  except Exception as e:  # pylint: disable=broad-except  # jax.errors.JaxRuntimeError, raised by XLA itself
    _compiler_failed(e, hlo_dir)
  seconds = time.monotonic() - start
  report = compile_report.build(
    cfg, compiled, target=target, recipe=recipe, usable=usable, substitutions=said, compile_s=seconds
  )
  report["planner"] = planned
  compile_report.compare(report)
  if hlo_dir is not None:
    report["peak"] = peak_live_set(hlo_dir / "xla")
    compile_report.keep(report, compiled.as_text(), hlo_dir)
  return report
