"""`maxtext-moe train`: read a recipe, put its environment into effect, join the job, resolve once, run
MaxText's trainer, report.

The order matters, and each step goes down the layers: the recipe, the model file, the overrides and the
flag profile are read in one place (`upstream.resolution.read`, no JAX backend yet); the flag environment is
applied to this process; only then does MaxText resolve the config (its validation starts the backend,
which reads XLA_FLAGS), once; the trainer (`upstream.maxtext.trainer`) is handed that object.
"""

import json
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from maxtext_moe import integrity, locks
from maxtext_moe.config import checkpointing, flags
from maxtext_moe.config.nodes import global_batch
from maxtext_moe.errors import RunEnded, UserError
from maxtext_moe.launch import off_devices
from maxtext_moe.launch.preflight import (
  absolute_checkpoint_paths,
  check_checkpoint_matches,
  check_inputs,
  check_layout_divides,
  check_microbatches_split,
  check_moe_path,
  check_nvlink_domains,
  check_platform,
  check_visible_devices,
  model_leaves,
)


def _keep_model_file(cfg: Any, run_dir: Path) -> None:
  """A run on a converted model keeps its model.yml (and source config.json), so that its checkpoints
  export with `convert maxtext-to-hf --ckpt RUN/checkpoints/STEP` alone."""
  from maxtext_moe.checkpoint.model_spec import MODEL_YAML, SOURCE_CONFIG  # pylint: disable=import-outside-toplevel

  if cfg.model_file:
    source = Path(cfg.model_file)
    shutil.copyfile(source, run_dir / MODEL_YAML)
    if (source.parent / SOURCE_CONFIG).is_file():
      shutil.copyfile(source.parent / SOURCE_CONFIG, run_dir / SOURCE_CONFIG)


RUN_LOCK = ".maxtext-moe.lock"


@dataclass(frozen=True)
class Distributed:
  """`train`'s multi-process flags (all None: detect from the environment)."""

  coordinator: str | None = None
  num_processes: int | None = None
  process_id: int | None = None
  local_rank: int | None = None
  init_timeout_s: int = 300


def join_job(recipe: Any, dist: Distributed) -> tuple[Any, Any]:
  """Joins the multi-process job this process belongs to, if any (before the backend starts); the recipe
  with process 0's run name."""
  from maxtext_moe.cluster import placement as cluster_lib  # pylint: disable=import-outside-toplevel

  found = cluster_lib.detect(
    dict(os.environ),
    coordinator=dist.coordinator,
    num_processes=dist.num_processes,
    process_id=dist.process_id,
    local_rank=dist.local_rank,
  )
  if found is None:
    return recipe, None
  cpu = str(recipe.keys.plugin.recipe_hardware) == "cpu"
  cluster_lib.start(found, cpu=cpu, timeout_s=dist.init_timeout_s, env=dict(os.environ))
  cluster_lib.hello(found)
  if not cpu:
    cluster_lib.check_distinct_gpus()
  return recipe.shared_by_all_processes(), found


JOB_FILE = "job.json"  # the shape of the job that last trained this run: devices, nodes, global batch


def _compare_job(run_dir: Path, cfg: Any, *, devices: int, batch: int) -> None:
  """Says aloud when a run resumes on another device count than it last trained on (its global batch
  changes with it, and the learning-rate schedule counts steps, not tokens), then records this job's."""
  before_path = run_dir / JOB_FILE
  try:
    before = json.loads(before_path.read_text()) if before_path.is_file() else None
  except (OSError, ValueError):
    before = None
  saved = run_dir / "checkpoints"
  if before and saved.is_dir() and any(saved.iterdir()) and int(before.get("devices", devices)) != devices:
    was, now = int(before["devices"]), devices
    keep = float(before.get("global_batch", batch)) / now
    print(
      f"maxtext-moe: warning: run {cfg.run_name} last trained on {was} devices (global batch "
      f"{before.get('global_batch')} sequences) and resumes on {now} (global batch {batch}); the learning-rate "
      f"schedule counts steps, not tokens. To keep the batch: per_device_batch_size={keep:g}, or resume on "
      f"{was} devices",
      file=sys.stderr,
      flush=True,
    )
  job = {"devices": devices, "nodes": int(cfg.nodes), "global_batch": batch}
  job["per_device_batch_size"] = float(cfg.per_device_batch_size)
  job["pipeline"] = pipeline_layout(cfg)
  before_path.write_text(json.dumps(job) + "\n")


def pipeline_layout(cfg: Any) -> dict[str, int] | None:
  """What of MaxText's pipeline stages shapes a checkpoint's tree (None without stages)."""
  if not getattr(cfg, "using_pipeline_parallelism", False):
    return None
  keys = ("ici_pipeline_parallelism", "dcn_pipeline_parallelism", "num_pipeline_repeats")
  return {k: int(getattr(cfg, k)) for k in (*keys, "num_layers_per_pipeline_stage", "pipeline_parallel_layers")}


def _layout_words(layout: dict[str, int] | None) -> str:
  return "without pipeline stages" if layout is None else "with " + " ".join(f"{k}={v}" for k, v in layout.items())


def check_resume_layout(cfg: Any) -> None:
  """A run resumes its full state (optimizer included) only into the tree its checkpoints have: with the
  same pipeline stages. A run without stages starts a new run from its weights instead
  (load_parameters_path, which lays them out into the stages)."""
  run_dir = Path(cfg.base_output_directory) / cfg.run_name
  saved = run_dir / "checkpoints"
  steps = sorted(int(p.name) for p in saved.iterdir() if p.name.isdigit()) if saved.is_dir() else []
  if not steps:
    return
  try:
    before = json.loads((run_dir / JOB_FILE).read_text()).get("pipeline")
  except (OSError, ValueError, AttributeError):
    before = None  # written before stages ran MoE models: none
  now = pipeline_layout(cfg)
  if before == now:
    return
  fix = (
    f"start a new run_name with load_parameters_path={saved / str(steps[-1]) / 'items'} (its weights, laid out "
    "into the stages; the optimizer state starts fresh)"
    if before is None
    else "resume with those keys"
  )
  raise UserError(
    f"run {cfg.run_name} has checkpoints written {_layout_words(before)}, and this run is {_layout_words(now)}: "
    f"a resume keeps the checkpoint's layout; {fix}"
  )


def _start_run(cfg: Any, recipe: Any, applied: dict[str, str], job: Any, out: IO[str]) -> Any:
  """The run directory, what process 0 keeps in it (flags.json, the model file), the recorder, and the
  start line."""
  import jax  # pylint: disable=import-outside-toplevel

  from maxtext_moe.runlog.recorder import RunRecorder  # pylint: disable=import-outside-toplevel

  lead = jax.process_index() == 0
  run_dir = Path(cfg.base_output_directory) / cfg.run_name
  if lead:  # one writer per run directory, before anything of the run is written or removed
    locks.acquire(run_dir / RUN_LOCK, what=f"run directory {run_dir}", wait_s=float(cfg.run_lock_wait_s))
  run_dir.mkdir(parents=True, exist_ok=True)
  batch = global_batch(cfg.per_device_batch_size, jax.device_count(), cfg.gradient_accumulation_steps)
  if lead:
    (run_dir / "flags.json").write_text(json.dumps({"profile": str(cfg.flag_profile), "env": applied}, indent=2) + "\n")
    _keep_model_file(cfg, run_dir)
    _compare_job(run_dir, cfg, devices=jax.device_count(), batch=batch)
    where = f" in {job.num_processes} processes" if job else ""
    nodes = f" on {cfg.nodes} nodes" if int(cfg.nodes) > 1 else ""
    print(
      f"maxtext-moe: training {cfg.model_name} from {recipe.path.name} on {jax.device_count()} "
      f"{jax.default_backend()} device(s){where}{nodes}; global batch {batch:,} x {cfg.max_target_length:,} = "
      f"{batch * int(cfg.max_target_length):,} tokens per step; run directory {run_dir}",
      file=out,
      flush=True,
    )
    print(f"maxtext-moe: {checkpointing.at_risk(cfg)}", file=out, flush=True)
  return RunRecorder(
    run_dir=run_dir,
    total_steps=cfg.steps,
    num_devices=jax.device_count(),
    metrics_name=cfg.metrics_jsonl,
    plot_name=cfg.loss_plot,
    progress=str(cfg.progress),
    stream=out,
    writer=lead,
    load_every=int(cfg.moe_load_every),
  )


def train(
  name: str | None,
  overrides: list[str],
  *,
  verbose: bool = False,
  out: IO[str] = sys.stdout,
  dist: Distributed = Distributed(),
  check_only: bool = False,
) -> dict[str, Any]:
  """Runs one training job (this process's part of it) and returns its summary; progress and summary go
  to `out` from process 0. Raises UserError for bad input. `check_only`: resolve and run every check
  before training, write nothing, and return what was checked."""
  import jax
  from absl import logging as absl_logging

  from maxtext_moe.launch import data_stop, environment
  from maxtext_moe.pretrain import text
  from maxtext_moe.sft import prepare as sft
  from maxtext_moe.upstream import resolution
  from maxtext_moe.upstream.maxtext import trainer

  if not verbose:
    absl_logging.set_verbosity(absl_logging.WARNING)
  recipe = resolution.read(name, overrides)
  flags.probe(recipe.flags.xla_flags)
  applied = environment.apply(recipe.flags)
  recipe, job = join_job(recipe, dist)
  away = check_only and recipe.away_from_its_gpus()  # a check on a login node: the job's devices and batch
  cfg = (recipe.as_its_job() if away else recipe).resolve()
  if away:
    return off_devices.check(cfg, name or str(recipe.path), recipe, overrides, check_resume_layout)
  check_visible_devices(cfg, visible=jax.device_count(), processes=jax.process_count())
  check_platform(cfg, platform=jax.default_backend())
  if jax.default_backend() == "gpu":
    check_nvlink_domains(cfg, jax.devices())
  check_moe_path(cfg)
  check_inputs(cfg)
  trainer.validate(cfg)  # MaxText's own assertions (steps > 0, ...), as one line before anything is written
  leaves = model_leaves(cfg)  # traces the model: needs a batch (above)
  check_layout_divides(cfg, leaves, num_devices=jax.device_count())
  check_microbatches_split(cfg, num_devices=jax.device_count())
  check_checkpoint_matches(cfg, leaves)  # before MaxText's restore, which would find it after the devices
  if check_only:
    return {"recipe": recipe.path.stem, "devices": jax.device_count(), "processes": jax.process_count()}
  check_resume_layout(cfg)
  cfg = sft.prepare(absolute_checkpoint_paths(cfg), lead=jax.process_index() == 0)
  cfg = text.prepare(cfg)  # your own corpus: rows checked, JSONL staged as Parquet, the vocabulary checked
  end = data_stop.for_run(cfg)  # the check each row passes as the run reads it
  recorder = _start_run(cfg, recipe, applied, job, out)
  return _run(cfg, recipe, recorder, end, distributed=job is not None)


def _run(cfg: Any, recipe: Any, recorder: Any, end: Any, *, distributed: bool) -> dict[str, Any]:
  """Runs the trainer with recovery installed and turns each early end into its one line (RunEnded)."""
  from maxtext_moe.launch import data_stop, interrupts, outcome  # pylint: disable=import-outside-toplevel
  from maxtext_moe.moe.stats import CapacityOverflow, DroplessViolation  # pylint: disable=import-outside-toplevel
  from maxtext_moe.upstream.maxtext import recovery  # pylint: disable=import-outside-toplevel
  from maxtext_moe.upstream.maxtext.trainer import run_trainer  # pylint: disable=import-outside-toplevel

  def announce(line: str) -> None:
    if recorder.writer:
      print(line, file=recorder.stream, flush=True)

  guard = recovery.NonFiniteGuard(skip=str(cfg.on_nonfinite_loss) == "skip", max_skips=int(cfg.max_nonfinite_skips))
  rec = recovery.Recovery(
    fallback=bool(cfg.checkpoint_fallback), nonfinite=guard, integrity=str(cfg.checkpoint_integrity), announce=announce
  )
  checkpoints = recorder.run_dir / "checkpoints"
  for name in recovery.remove_incomplete_saves(checkpoints):
    announce(f"maxtext-moe: removed {name}, a checkpoint save that was interrupted before it completed")
  command = outcome.resume_command(recipe.name, recipe.user_overrides, cfg.run_name)
  outcome.quiet_about_full_disks()
  with interrupts.graceful_stop(rec, distributed=distributed) as received:
    try:
      run_trainer(cfg, recorder, rec, end)
    except recovery.NonFiniteLoss as e:
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
      raise outcome.unexpected(e, recorder, checkpoints, command) from None
    except Exception as e:  # pylint: disable=broad-except  # a full disk becomes one line; the rest re-raised
      raise outcome.unexpected(e, recorder, checkpoints, command) from None
  if recorder.writer and str(cfg.checkpoint_integrity) != "off":  # the last save completed with the loop
    integrity.record_completed(checkpoints, checksums=str(cfg.checkpoint_integrity) == "checksums")
  summary = recorder.finish(stopped=rec.stopped_at is not None, ended=data_stop.summary_words(end, cfg, checkpoints))
  if rec.stopped_at is not None:
    raise outcome.stopped(received[0] if received else "SIGTERM", rec.stopped_at, checkpoints, command)
  if (ended := data_stop.last_line(end, int(cfg.steps), checkpoints, command)) is not None:
    raise ended
  return summary
