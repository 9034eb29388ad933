"""One recipe read and resolved for its job, once per command (`planning`): what its memory plan
(`memory_plan.py`), the fixes tried, the step-time model and the launchers' checks share; and the
estimate of a resolved config on it (`estimate_of`)."""

import dataclasses
import functools
from typing import Any

from maxtext_moe.config import hardware
from maxtext_moe.errors import UserError
from maxtext_moe.moe.layout import check_resolved_dispatch, dispatch_for
from maxtext_moe.planner.estimate import GIB, Estimate, estimate


@dataclasses.dataclass(frozen=True)
class Planning:
  """One recipe read and resolved for its job, once per command: what its memory plan, its fixes, the
  step-time model and the launchers' checks share (the recipe, devices, memory limits and parameter tree)."""

  path: Any
  base_overrides: list[str]
  num_devices: int
  hbm_gib: float | None
  host_gib: float | None
  leaves: list
  platform: Any  # moe.settings.Platform
  loads_weights: bool = False  # the recipe starts from a checkpoint (a fine-tune): `offload.takes`
  network_gbs: float | None = None  # the scale-out network per GPU the step-time model takes (None: the table's)


def planning(
  recipe: str,
  overrides: list[str],
  gpus: int | None,
  gpu_mem_gib: float | None,
  *,
  network_gbs: float | None = None,
  job: Any = None,
) -> tuple[Planning, Any]:
  """(the `Planning` of `recipe` + overrides on its job, or on `gpus` GPUs; its resolved config): MaxText's
  resolution of the job, and of one device for the parameter tree (`_leaves`, cached per recipe);
  `network_gbs`: the fabric's GB/s per GPU, one way, for the step-time model (`plan --network-gbs`); `job`:
  the job's config where the command has resolved it already (`train --check`: then only the tree's)."""
  from maxtext_moe.config import flags  # pylint: disable=import-outside-toplevel
  from maxtext_moe.config.recipes import recipe_path  # pylint: disable=import-outside-toplevel
  from maxtext_moe.upstream import resolution  # pylint: disable=import-outside-toplevel

  path = recipe_path(recipe)
  keys = resolution.layer_keys(path, overrides)
  loads = bool(keys.plugin.finetune or keys.maxtext["load_parameters_path"] or keys.maxtext["load_full_state_path"])
  # A fine-tuning recipe's weights do not change its memory: plan it without them.
  base_overrides = ["finetune=false", *overrides, *(_gpus_as_nodes(path, overrides, gpus) if gpus else [])]
  cfg = job if job is not None else resolved(path, base_overrides)
  n = int(cfg.recipe_num_devices)
  if n <= 0:
    import jax  # pylint: disable=import-outside-toplevel

    n = jax.device_count()
  spec = hardware.gpu(cfg.recipe_hardware)
  mem_fraction = float(flags.for_config(cfg).env.get("XLA_PYTHON_CLIENT_MEM_FRACTION", 0.75 if spec else 1.0))
  hbm = gpu_mem_gib if gpu_mem_gib is not None else (spec.hbm_gib * mem_fraction if spec else None)
  leaves = _leaves(str(path), tuple(base_overrides))
  host = spec.host_gb * 1e9 / GIB if spec else None
  return Planning(path, base_overrides, n, hbm, host, leaves, _target(cfg), loads, network_gbs), cfg


def resolved(path: Any, overrides: list[str]) -> Any:
  """MaxText's resolution of a recipe for its own devices. MaxText checks a pipeline's microbatches against
  per_device_batch_size x the devices it counts (`micro_batch_size_to_train_on`, configs/types.py), which
  are this machine's unless `internal_compile_num_devices` names them (as `compile` does): a plan names
  the job's, so a layout is judged for the cluster it is planned for, not the laptop planning it."""
  from maxtext_moe.upstream import resolution  # pylint: disable=import-outside-toplevel

  keys = resolution.layer_keys(path, overrides)
  n = keys.layout.devices
  job = resolution.job_devices(n) if n > 0 else []
  return resolution.hyperparameters(resolution.resolve(path, [*overrides, *job], keys=keys))


def _gpus_as_nodes(path: Any, overrides: list[str], gpus: int) -> list[str]:
  """`plan --gpus N` as the override it means: N / GPUs-per-node nodes (on CPU, N devices)."""
  from maxtext_moe.upstream import resolution  # pylint: disable=import-outside-toplevel

  per_node = resolution.layer_keys(path, overrides).layout.gpus_per_node
  if per_node is None:
    return [f"recipe_num_devices={gpus}"]
  if gpus % per_node:
    raise UserError(f"--gpus {gpus} is not a whole number of {per_node}-GPU nodes; pass --nodes N instead")
  return [f"nodes={gpus // per_node}"]


@functools.lru_cache(maxsize=8)
def _leaves(path: str, overrides: tuple[str, ...]) -> list:
  """The parameter tree's leaves: their shapes do not depend on the layout, so it is traced once, on one
  device, per recipe and overrides (`plan --time` and the layout search ask again)."""
  from maxtext_moe.upstream import resolution  # pylint: disable=import-outside-toplevel
  from maxtext_moe.upstream.maxtext import model as upstream_model  # pylint: disable=import-outside-toplevel

  one_device = resolution.resolved(path, [*overrides, *upstream_model.ONE_DEVICE_OVERRIDES])
  return upstream_model.param_leaves(one_device)


def _target(cfg: Any) -> Any:
  """The platform a recipe is planned for: a GPU recipe runs in our container (TE imports) with one process
  per GPU (our launchers), so `auto` there means te / te_ep, whatever this machine has."""
  from maxtext_moe.moe.settings import Platform  # pylint: disable=import-outside-toplevel

  if str(cfg.hardware) == "cpu":
    return Platform("cpu")
  return Platform("gpu", te_gemm=True, te_ep=True)


def dispatch_kind(ctx: Planning, cfg: Any) -> str:
  """What `moe_dispatch` resolves to for `cfg` on the platform it is planned for, refused (UserError) where
  the run's own checks would refuse it at launch (`auto` turned te_ep with a capacity factor below 1, say)."""
  kind = dispatch_for(cfg, num_devices=ctx.num_devices, platform=ctx.platform)
  try:
    check_resolved_dispatch(cfg, kind, num_devices=ctx.num_devices)
  except ValueError as e:
    raise UserError(f"{e} (moe_dispatch={cfg.moe_dispatch} resolves to {kind.value} here)") from e
  return kind.value


def estimate_of(ctx: Planning, cfg: Any, extra: list[str]) -> tuple[Estimate, str]:
  from maxtext_moe.upstream.maxtext.compile import train_tflops_per_device  # pylint: disable=import-outside-toplevel

  kind = dispatch_kind(ctx, cfg)
  total, _, _ = train_tflops_per_device(cfg)
  est = estimate(
    cfg,
    ctx.leaves,
    num_devices=ctx.num_devices,
    dispatch=kind,
    hbm_gib=ctx.hbm_gib,
    host_gib=ctx.host_gib,
    tflops=total,
  )
  est.overrides = extra
  return est, kind
