"""`maxtext-moe train`: resolve a recipe, prepare what it needs, run MaxText's trainer, report."""

import datetime
import json
import os
import re
from pathlib import Path
from typing import Any

from maxtext_moe.config import checks, offload, recipes
from maxtext_moe.errors import UserError
from maxtext_moe.launch import flags


def derived_overrides(cfg: Any) -> list[str]:
  """key=value pairs the launcher adds after a first resolution: absolute output dir, run name."""
  extra = []
  if not os.path.isabs(cfg.base_output_directory) and "://" not in cfg.base_output_directory:
    extra.append(f"base_output_directory={Path(cfg.base_output_directory).resolve()}")
  if _run_name_is_derived(cfg):
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    extra.append(f"run_name={cfg.model_name}-{cfg.recipe_hardware}-{stamp}")
  return extra


def _run_name_is_derived(cfg: Any) -> bool:
  """True when MaxText made up the run name (`<model>_<YYYY-mm-dd-HH-MM>`): minute resolution, so two runs
  started in the same minute would silently share checkpoints. The launcher then picks one to the second."""
  pattern = rf"{re.escape(str(cfg.model_name))}_\d{{4}}-\d\d-\d\d-\d\d-\d\d"
  return not cfg.run_name or ("run_name" not in cfg.model_fields_set and re.fullmatch(pattern, cfg.run_name))


def check_visible_devices(cfg: Any, *, visible: int) -> None:
  """The recipe's device count and parallelism product must match what this process sees."""
  want = cfg.recipe_num_devices
  if want > 0 and want != visible:
    hint = (
      f"; on CPU set XLA_FLAGS=--xla_force_host_platform_device_count={want}"
      if cfg.hardware == "cpu"
      else "; run it on the hardware it names or override recipe_num_devices and the parallelism"
    )
    raise UserError(f"recipe lays out {want} devices but {visible} are visible{hint}")
  try:
    checks.check_layout_fits_devices(cfg, num_devices=visible)
  except ValueError as e:
    raise UserError(str(e)) from e


def check_platform(cfg: Any, *, platform: str) -> None:
  """Settings that need an XLA backend feature this platform lacks."""
  if cfg.offload is not None:
    import jax  # pylint: disable=import-outside-toplevel

    try:
      jax.devices()[0].memory("pinned_host")
    except Exception:  # pylint: disable=broad-except  # jax raises several types for a missing memory kind
      raise UserError(
        f"offload={cfg.offload} needs pinned host memory, which {platform} devices here lack; set offload=none"
      ) from None
  if platform == "cpu" and str(cfg.moe_dispatch) == "ragged_all_to_all":
    raise UserError(
      "moe_dispatch=ragged_all_to_all needs a GPU or TPU (XLA:CPU has no ragged-all-to-all); "
      "use moe_dispatch=all_to_all or auto on CPU"
    )


def _check_overrides(overrides: list[str]) -> None:
  for item in overrides:
    key, sep, _ = item.partition("=")
    if not sep or not key:
      raise UserError(f"expected key=value, got '{item}'")


def prepare(recipe: str | None, overrides: list[str]) -> tuple[Path, list[str], Any]:
  """Resolves and validates the recipe plus overrides; returns (config path, full overrides, config)."""
  from maxtext_moe import maxtext_adapter

  _check_overrides(overrides)
  path = recipes.recipe_path(recipe or recipes.DEFAULT_RECIPE)
  cfg = maxtext_adapter.resolve(path, overrides)
  full = [*offload.preset_overrides(cfg.offload), *overrides, *derived_overrides(cfg)]
  if full != overrides:
    cfg = maxtext_adapter.resolve(path, full)
  return path, full, cfg


def train(recipe: str | None, overrides: list[str], *, verbose: bool = False) -> dict[str, Any]:
  """Runs one training job and returns its summary. Raises UserError for bad input."""
  import jax
  from absl import logging as absl_logging

  from maxtext_moe import maxtext_adapter
  from maxtext_moe.launch.recorder import RunRecorder

  if not verbose:
    absl_logging.set_verbosity(absl_logging.WARNING)
  path, full, cfg = prepare(recipe, overrides)
  run_flags = flags.for_config(cfg)
  flags.probe(run_flags.xla_flags)
  argv = ["train", *([recipe] if recipe else []), *overrides, *(["--verbose"] if verbose else [])]
  flags.ensure_applied(run_flags, argv)  # re-executes when XLA_FLAGS/env must change (read at backend start)
  check_visible_devices(cfg, visible=jax.device_count())
  check_platform(cfg, platform=jax.default_backend())
  run_dir = Path(cfg.base_output_directory) / cfg.run_name
  run_dir.mkdir(parents=True, exist_ok=True)
  applied = {k: os.environ.get(k) for k in run_flags.full_env()}  # what this process really runs with
  (run_dir / "flags.json").write_text(json.dumps({"profile": str(cfg.flag_profile), "env": applied}, indent=2) + "\n")
  recorder = RunRecorder(
    run_dir=run_dir,
    total_steps=cfg.steps,
    num_devices=jax.device_count(),
    metrics_name=cfg.metrics_jsonl,
    plot_name=cfg.loss_plot,
    progress=str(cfg.progress),
  )
  print(
    f"maxtext-moe: training {cfg.model_name} from {path.name} on {jax.device_count()} {jax.default_backend()} "
    f"device(s); run directory {run_dir}",
    flush=True,
  )
  try:
    maxtext_adapter.run_trainer(path, full, on_start=recorder.start)
  except RuntimeError as e:
    if "checkpoint already exists" in str(e):
      raise UserError(
        f"run '{cfg.run_name}' already completed {cfg.steps} steps (checkpoints in {run_dir / 'checkpoints'}); "
        f"pass steps=N with N > {cfg.steps} to train further, or a new run_name"
      ) from e
    raise
  return recorder.finish()
