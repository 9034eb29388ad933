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

from maxtext_moe.config import flags, recipes
from maxtext_moe.errors import RunEnded, UserError
from maxtext_moe.launch import sft_data
from maxtext_moe.launch.preflight import (
  absolute_checkpoint_paths,
  check_inputs,
  check_moe_path,
  check_platform,
  check_visible_devices,
)


def _check_overrides(overrides: list[str]) -> None:
  for item in overrides:
    key, sep, _ = item.partition("=")
    if not sep or not key:
      raise UserError(f"expected key=value, got '{item}'")


def derived_overrides(keys: Any, now: datetime.datetime | None = None) -> list[str]:
  """key=value pairs the launcher adds: the output directory made absolute (it is taken from the current
  directory), and a run name to the second when none is set (MaxText's own is to the minute, so two runs
  started in the same minute would silently share checkpoints)."""
  extra = []
  out = keys.base_output_directory
  if out and not os.path.isabs(out) and "://" not in out:
    extra.append(f"base_output_directory={Path(out).resolve()}")
  if not keys.run_name_set:
    stamp = (now or datetime.datetime.now()).strftime("%Y%m%d-%H%M%S")
    extra.append(f"run_name={keys.model_name}-{keys.plugin.recipe_hardware}-{stamp}")
  return extra


@dataclass(frozen=True)
class Launch:
  """A recipe and overrides, read from the YAML layers but not yet resolved by MaxText."""

  path: Path
  overrides: list[str]  # the user's, then the derived ones
  keys: Any  # upstream.config.LayerKeys
  user_overrides: tuple[str, ...] = ()

  def shared_by_all_processes(self) -> "Launch":
    """In a multi-process job every process must write to one run directory: all take process 0's clock
    for the derived run name (their own may be a second apart)."""
    if self.keys.run_name_set:
      return self
    import numpy as np  # pylint: disable=import-outside-toplevel
    from jax.experimental import multihost_utils  # pylint: disable=import-outside-toplevel

    now = datetime.datetime.now()
    day, second = (int(now.strftime(f)) for f in ("%Y%m%d", "%H%M%S"))
    day, second = (int(v) for v in multihost_utils.broadcast_one_to_all(np.array([day, second], np.int32)))
    shared = datetime.datetime.strptime(f"{day:08d}{second:06d}", "%Y%m%d%H%M%S")
    return Launch(
      self.path, [*self.user_overrides, *derived_overrides(self.keys, shared)], self.keys, self.user_overrides
    )

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
  return Launch(path, [*overrides, *derived_overrides(keys)], keys, tuple(overrides))


def _keep_model_file(cfg: Any, run_dir: Path) -> None:
  """A run on a converted model keeps its model.yml (and source config.json), so that its checkpoints
  export with `convert maxtext-to-hf --ckpt RUN/checkpoints/STEP` alone."""
  from maxtext_moe.checkpoint.model_spec import MODEL_YAML, SOURCE_CONFIG  # pylint: disable=import-outside-toplevel

  if cfg.model_file:
    source = Path(cfg.model_file)
    shutil.copyfile(source, run_dir / MODEL_YAML)
    if (source.parent / SOURCE_CONFIG).is_file():
      shutil.copyfile(source.parent / SOURCE_CONFIG, run_dir / SOURCE_CONFIG)


@dataclass(frozen=True)
class Distributed:
  """`train`'s multi-process flags (all None: detect from the environment)."""

  coordinator: str | None = None
  num_processes: int | None = None
  process_id: int | None = None
  local_rank: int | None = None
  init_timeout_s: int = 300


def join_job(launch: Launch, dist: Distributed) -> tuple[Launch, Any]:
  """Joins the multi-process job this process belongs to, if any (before the backend starts)."""
  from maxtext_moe.launch import cluster as cluster_lib  # pylint: disable=import-outside-toplevel

  found = cluster_lib.detect(
    dict(os.environ),
    coordinator=dist.coordinator,
    num_processes=dist.num_processes,
    process_id=dist.process_id,
    local_rank=dist.local_rank,
  )
  if found is None:
    return launch, None
  cpu = str(launch.keys.plugin.recipe_hardware) == "cpu"
  cluster_lib.start(found, cpu=cpu, timeout_s=dist.init_timeout_s, env=dict(os.environ))
  cluster_lib.hello(found)
  if not cpu:
    cluster_lib.check_distinct_gpus()
  return launch.shared_by_all_processes(), found


def _start_run(cfg: Any, launch: Launch, applied: dict[str, str], job: Any, out: IO[str]) -> Any:
  """The run directory, what process 0 keeps in it (flags.json, the model file), the recorder, and the
  start line."""
  import jax  # pylint: disable=import-outside-toplevel

  from maxtext_moe.launch.recorder import RunRecorder  # pylint: disable=import-outside-toplevel

  lead = jax.process_index() == 0
  run_dir = Path(cfg.base_output_directory) / cfg.run_name
  run_dir.mkdir(parents=True, exist_ok=True)
  if lead:
    (run_dir / "flags.json").write_text(json.dumps({"profile": str(cfg.flag_profile), "env": applied}, indent=2) + "\n")
    _keep_model_file(cfg, run_dir)
    where = f" in {job.num_processes} processes" if job else ""
    print(
      f"maxtext-moe: training {cfg.model_name} from {launch.path.name} on {jax.device_count()} "
      f"{jax.default_backend()} device(s){where}; run directory {run_dir}",
      file=out,
      flush=True,
    )
  return RunRecorder(
    run_dir=run_dir,
    total_steps=cfg.steps,
    num_devices=jax.device_count(),
    metrics_name=cfg.metrics_jsonl,
    plot_name=cfg.loss_plot,
    progress=str(cfg.progress),
    stream=out,
    writer=lead,
    skip_nonfinite=str(cfg.on_nonfinite_loss) == "skip",
    max_nonfinite_skips=int(cfg.max_nonfinite_skips),
    load_every=int(cfg.moe_load_every),
  )


def train(
  recipe: str | None,
  overrides: list[str],
  *,
  verbose: bool = False,
  out: IO[str] = sys.stdout,
  dist: Distributed = Distributed(),
) -> dict[str, Any]:
  """Runs one training job (this process's part of it) and returns its summary; progress and summary go
  to `out` from process 0. Raises UserError for bad input."""
  import jax
  from absl import logging as absl_logging

  from maxtext_moe.launch import environment

  if not verbose:
    absl_logging.set_verbosity(absl_logging.WARNING)
  launch = read_launch(recipe, overrides)
  run_flags = flags.for_config(launch.keys.plugin)
  run_flags.add_flags(launch.keys.dump_hlo_flags)
  flags.probe(run_flags.xla_flags)
  applied = environment.apply(run_flags)
  launch, job = join_job(launch, dist)
  cfg = launch.resolve()
  check_visible_devices(cfg, visible=jax.device_count(), processes=jax.process_count())
  check_platform(cfg, platform=jax.default_backend())
  check_moe_path(cfg)
  check_inputs(cfg)
  cfg = sft_data.prepare(absolute_checkpoint_paths(cfg), lead=jax.process_index() == 0)
  recorder = _start_run(cfg, launch, applied, job, out)
  return _run(cfg, launch, recipe, recorder, distributed=job is not None)


def _run(cfg: Any, launch: Launch, recipe: str | None, recorder: Any, *, distributed: bool) -> dict[str, Any]:
  """Runs the trainer with recovery installed and turns each early end into its one line (RunEnded)."""
  from maxtext_moe.launch import interrupts, outcome  # pylint: disable=import-outside-toplevel
  from maxtext_moe.launch.recorder import NonFiniteLoss  # pylint: disable=import-outside-toplevel
  from maxtext_moe.moe.stats import CapacityOverflow, DroplessViolation  # pylint: disable=import-outside-toplevel
  from maxtext_moe.upstream import recovery  # pylint: disable=import-outside-toplevel
  from maxtext_moe.upstream.trainer import run_trainer  # pylint: disable=import-outside-toplevel

  def announce(line: str) -> None:
    if recorder.writer:
      print(line, file=recorder.stream, flush=True)

  rec = recovery.Recovery(
    fallback=bool(cfg.checkpoint_fallback), skip_nonfinite=str(cfg.on_nonfinite_loss) == "skip", announce=announce
  )
  checkpoints = recorder.run_dir / "checkpoints"
  for name in recovery.remove_incomplete_saves(checkpoints):
    announce(f"maxtext-moe: removed {name}, a checkpoint save that was interrupted before it completed")
  command = outcome.resume_command(recipe, launch.user_overrides, cfg.run_name)
  with interrupts.graceful_stop(rec, distributed=distributed) as received:
    try:
      run_trainer(cfg, recorder, rec)
    except NonFiniteLoss as e:
      recorder.finish(stopped=True)
      raise outcome.nonfinite(e, checkpoints, command, lead=recorder.writer) from None
    except (CapacityOverflow, DroplessViolation) as e:
      recorder.finish(stopped=True)
      raise RunEnded(str(e), 1) from None
    except RuntimeError as e:
      if "checkpoint already exists" in str(e):
        raise UserError(
          f"run '{cfg.run_name}' already completed {cfg.steps} steps (checkpoints in {checkpoints}); "
          f"pass steps=N with N > {cfg.steps} to train further, or a new run_name"
        ) from e
      raise
  summary = recorder.finish(stopped=rec.stopped_at is not None)
  if rec.stopped_at is not None:
    raise outcome.stopped(received[0] if received else "SIGTERM", rec.stopped_at, checkpoints, command)
  return summary
