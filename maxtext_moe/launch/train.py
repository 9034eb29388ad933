"""`maxtext-moe train`: resolve a recipe once, put its environment into effect, run MaxText's trainer, report.

The order matters: the flag environment comes from the YAML layers alone (no JAX backend yet) and is
applied to this process; only then does MaxText resolve the config (its validation starts the backend,
which reads XLA_FLAGS), once; the trainer is handed that object.
"""

import datetime
import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from maxtext_moe.config import checks, flags, recipes
from maxtext_moe.errors import UserError


def _check_overrides(overrides: list[str]) -> None:
  for item in overrides:
    key, sep, _ = item.partition("=")
    if not sep or not key:
      raise UserError(f"expected key=value, got '{item}'")


def derived_overrides(keys: Any) -> list[str]:
  """key=value pairs the launcher adds: the output directory made absolute (it is taken from the current
  directory), and a run name to the second when none is set (MaxText's own is to the minute, so two runs
  started in the same minute would silently share checkpoints)."""
  extra = []
  out = keys.base_output_directory
  if out and not os.path.isabs(out) and "://" not in out:
    extra.append(f"base_output_directory={Path(out).resolve()}")
  if not keys.run_name_set:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    extra.append(f"run_name={keys.model_name}-{keys.plugin.recipe_hardware}-{stamp}")
  return extra


@dataclass(frozen=True)
class Launch:
  """A recipe and overrides, read from the YAML layers but not yet resolved by MaxText."""

  path: Path
  overrides: list[str]  # the user's, then the derived ones
  keys: Any  # upstream.config.LayerKeys

  def resolve(self) -> Any:
    """The one MaxText resolution of this launch. It starts the JAX backend first, unless dump_hlo is on:
    MaxText's validation fills an unset XLA_FLAGS with HLO-dump flags (`validate_and_set_hlo_dump_defaults`,
    31 MB in /tmp/xla_dump per compile of the tiny model) before it starts the backend itself. Its write
    to XLA_FLAGS is undone, so child processes do not inherit it either."""
    import jax  # pylint: disable=import-outside-toplevel

    from maxtext_moe.upstream import config as upstream_config  # pylint: disable=import-outside-toplevel

    if self.keys.dump_hlo:
      return upstream_config.resolve(self.path, self.overrides, keys=self.keys)
    saved = os.environ.get("XLA_FLAGS")
    jax.devices()
    try:
      return upstream_config.resolve(self.path, self.overrides, keys=self.keys)
    finally:
      if saved is None:
        os.environ.pop("XLA_FLAGS", None)
      else:
        os.environ["XLA_FLAGS"] = saved


def read_launch(recipe: str | None, overrides: list[str]) -> Launch:
  """Finds the recipe and reads the keys needed before resolving (no JAX backend is started)."""
  from maxtext_moe.upstream import config as upstream_config  # pylint: disable=import-outside-toplevel

  _check_overrides(overrides)
  path = recipes.recipe_path(recipe or recipes.DEFAULT_RECIPE)
  keys = upstream_config.layer_keys(path, overrides)
  return Launch(path, [*overrides, *derived_overrides(keys)], keys)


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
  if platform == "cpu" and str(cfg.offload) in ("activations", "all"):
    print(
      f"maxtext-moe: note: offload={cfg.offload} leaves activations in memory on CPU (JAX lowers host transfers "
      "inside a step only for GPU and TPU); the optimizer and parameter parts do apply",
      file=sys.stderr,
    )
  if platform == "cpu" and str(cfg.moe_dispatch) == "ragged_all_to_all":
    raise UserError(
      "moe_dispatch=ragged_all_to_all needs a GPU or TPU (XLA:CPU has no ragged-all-to-all); "
      "use moe_dispatch=all_to_all or auto on CPU"
    )


def check_moe_path(cfg: Any) -> None:
  """The GPU fast path's requirements (TE, one GPU per process, the layout TE EP serves, FP8 support),
  checked once the backend is up and before anything is compiled: one line each, with the fix."""
  from maxtext_moe.moe import settings  # pylint: disable=import-outside-toplevel
  from maxtext_moe.upstream import moe_layer, te  # pylint: disable=import-outside-toplevel

  if str(cfg.moe_impl) == "maxtext" and getattr(cfg, "te_moe_block", False) and not te.status().available:
    raise UserError(f"te_moe_block=true needs Transformer Engine, which does not import here: {te.status().reason}")
  if str(cfg.moe_impl) != "dropless" or cfg.num_experts <= 1:
    return
  dispatch, gemm = moe_layer.resolved_kinds(cfg)
  try:
    if dispatch == settings.DispatchKind.TE_EP:
      reasons = te.ep_unready_reasons()
      if reasons:
        raise UserError(
          f"moe_dispatch=te_ep cannot run here: {'; '.join(reasons)} (maxtext-moe doctor says more); "
          "launch one process per GPU, or use moe_dispatch=auto"
        )
      settings.check_te_ep_layout(moe_layer.mesh_axis_sizes(cfg), num_experts=cfg.num_experts)
    if gemm == settings.GemmBackend.TE and (jax_platform() != "gpu" or not te.status().available):
      raise UserError(
        f"moe_gemm_backend=te needs Transformer Engine on a GPU ({te.status().reason or 'not a GPU'}); "
        "use moe_gemm_backend=auto"
      )
    settings.check_quantization(cfg.moe_gemm_quantization, gemm, dispatch)
    if str(cfg.moe_gemm_quantization) != "none":
      supported, why = te.scaling_mode_supported(str(cfg.moe_gemm_quantization))
      if not supported:
        raise UserError(f"moe_gemm_quantization={cfg.moe_gemm_quantization} is not supported on this GPU: {why}")
  except ValueError as e:
    raise UserError(str(e)) from e


def jax_platform() -> str:
  import jax  # pylint: disable=import-outside-toplevel

  return jax.default_backend()


def _keep_model_file(cfg: Any, run_dir: Path) -> None:
  """A run on a converted model keeps its model.yml (and source config.json), so that its checkpoints
  export with `convert maxtext-to-hf --ckpt RUN/checkpoints/STEP` alone."""
  from maxtext_moe.checkpoint.model_spec import MODEL_YAML, SOURCE_CONFIG  # pylint: disable=import-outside-toplevel

  if cfg.model_file:
    source = Path(cfg.model_file)
    shutil.copyfile(source, run_dir / MODEL_YAML)
    if (source.parent / SOURCE_CONFIG).is_file():
      shutil.copyfile(source.parent / SOURCE_CONFIG, run_dir / SOURCE_CONFIG)


def train(
  recipe: str | None, overrides: list[str], *, verbose: bool = False, out: IO[str] = sys.stdout
) -> dict[str, Any]:
  """Runs one training job and returns its summary; progress and summary go to `out`. Raises UserError for
  bad input."""
  import jax
  from absl import logging as absl_logging

  from maxtext_moe.launch import environment
  from maxtext_moe.launch.recorder import RunRecorder
  from maxtext_moe.upstream.trainer import run_trainer

  if not verbose:
    absl_logging.set_verbosity(absl_logging.WARNING)
  launch = read_launch(recipe, overrides)
  run_flags = flags.for_config(launch.keys.plugin)
  flags.probe(run_flags.xla_flags)
  applied = environment.apply(run_flags)
  cfg = launch.resolve()
  check_visible_devices(cfg, visible=jax.device_count())
  check_platform(cfg, platform=jax.default_backend())
  check_moe_path(cfg)
  run_dir = Path(cfg.base_output_directory) / cfg.run_name
  run_dir.mkdir(parents=True, exist_ok=True)
  (run_dir / "flags.json").write_text(json.dumps({"profile": str(cfg.flag_profile), "env": applied}, indent=2) + "\n")
  _keep_model_file(cfg, run_dir)
  recorder = RunRecorder(
    run_dir=run_dir,
    total_steps=cfg.steps,
    num_devices=jax.device_count(),
    metrics_name=cfg.metrics_jsonl,
    plot_name=cfg.loss_plot,
    progress=str(cfg.progress),
    stream=out,
  )
  print(
    f"maxtext-moe: training {cfg.model_name} from {launch.path.name} on {jax.device_count()} "
    f"{jax.default_backend()} device(s); run directory {run_dir}",
    file=out,
    flush=True,
  )
  try:
    run_trainer(cfg, recorder)
  except RuntimeError as e:
    if "checkpoint already exists" in str(e):
      raise UserError(
        f"run '{cfg.run_name}' already completed {cfg.steps} steps (checkpoints in {run_dir / 'checkpoints'}); "
        f"pass steps=N with N > {cfg.steps} to train further, or a new run_name"
      ) from e
    raise
  return recorder.finish()
