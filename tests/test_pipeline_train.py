"""Pipeline stages against the same model trained without them, from the same weights (a checkpoint written
without stages, laid out into the stages at load): the loss of every step, and every weight and routing
bias of the last checkpoint. A 5-layer tiny model (1 dense + 4 MoE layers) trains 3 steps with a global
batch of 8 sequences, on 4 fake CPU devices (8 with expert parallelism inside the stages). Then the
resumes: a pipelined run resumes its own full state; a run resumed with another layout is refused."""

import ast
import json
from pathlib import Path

import numpy as np
import pytest

from conftest import run_cli
from maxtext_moe.checkpoint import export
from maxtext_moe.checkpoint.orbax_io import LeafReader
from maxtext_moe.checkpoint.safetensors_io import HFCheckpoint
from maxtext_moe.upstream import stage_load

pytestmark = pytest.mark.ci  # about 8 minutes of training runs on 2 cores: run by .ci/run

RECIPE = "cpu/deepseek3-tiny"
MODEL = [
  "override_model_config=true",
  "base_num_decoder_layers=5",
  "dataset_type=synthetic",
  "max_target_length=32",
  "progress=silent",
]
STAGES = {  # case: (overrides, devices, per-device batch)
  "2_stages_2_outside": (["ici_pipeline_parallelism=2", "pipeline_parallel_layers=2"], 4, 2),
  "2_stages_2_layers_each": (["ici_pipeline_parallelism=2", "num_layers_per_pipeline_stage=2"], 4, 2),
  "2_stages_2_layers_each_scanned": (
    ["ici_pipeline_parallelism=2", "num_layers_per_pipeline_stage=2", "scan_layers_per_stage=true"],
    4,
    2,
  ),
  "4_stages": (["ici_pipeline_parallelism=4", "pipeline_parallel_layers=4"], 4, 2),
  "2_stages_ep2": (
    ["ici_pipeline_parallelism=2", "pipeline_parallel_layers=2", "ici_expert_parallelism=2"],
    8,
    1,
  ),
}


def _train(runs: Path, name: str, extra: list[str], *, devices: int = 4, batch: int = 2, steps: int = 3):
  args = ["train", *MODEL, f"base_output_directory={runs}", f"run_name={name}", f"steps={steps}"]
  args += [f"per_device_batch_size={batch}", "checkpoint_period=1", *extra]
  return run_cli(args, cwd=runs.parent, devices=devices, timeout=900)


def _losses(run: Path) -> list[float]:
  return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def _names(items: Path) -> list[tuple[str, ...]]:
  meta = json.loads((items / "_METADATA").read_text())["tree_metadata"]
  return sorted(t for t in map(ast.literal_eval, meta) if t[0] in ("params", "nnx_aux") and "rngs" not in t)


# Plain SGD for the weights' comparison: Adam divides each update by the gradient's own size, so an element
# whose gradient is float noise away from zero moves by a noise-decided fraction of the learning rate
# (with AdamW, a few elements in 10^4 differ by up to 2e-5 after 3 steps while the losses agree to 1e-7).
SGD = ["opt_type=sgd", "learning_rate=0.1"]


@pytest.fixture(scope="module")
def start(tmp_path_factory):
  """Weights without stages (a run's step-0 checkpoint), and the run without stages trained from them."""
  runs = tmp_path_factory.mktemp("pipeline") / "runs"
  proc = _train(runs, "start", [], steps=1)
  assert proc.returncode == 0, proc.stderr[-3000:]
  items = runs / "start" / "checkpoints" / "0" / "items"
  proc = _train(runs, "flat", [*SGD, f"load_parameters_path={items}"])
  assert proc.returncode == 0, proc.stderr[-3000:]
  return runs, items


def _placement(under: tuple[str, ...], extra: list[str], flat: LeafReader, head: tuple[str, ...]):
  """Where a pipelined run's leaf `head + under` comes from in the run without stages: (its name there,
  the `stage_load.Placement`), or None for a leaf outside the MoE layers (the same name)."""
  keys = dict(k.split("=") for k in extra)
  stages, pipelined = int(keys["ici_pipeline_parallelism"]), int(keys.get("pipeline_parallel_layers", 4))
  per_stage = int(keys.get("num_layers_per_pipeline_stage", 1))
  st = stage_load.Stages(stages, pipelined // (stages * per_stage), per_stage, outside=4 - pipelined, scan_axis=1)
  where = stage_load.placement(under, st, is_param=head[0] == "params", ndim=0)
  if where is None:
    return None
  source = (*head, stage_load.STACK, *where.source)
  return source, stage_load.placement(under, st, is_param=head[0] == "params", ndim=len(flat.shape(source)))


@pytest.mark.parametrize("case", sorted(STAGES))
def test_pipeline_trains_as_without_stages(start, case):
  runs, items = start
  extra, devices, batch = STAGES[case]
  proc = _train(runs, case, [*extra, *SGD, f"load_parameters_path={items}"], devices=devices, batch=batch)
  assert proc.returncode == 0, proc.stderr[-3000:]
  np.testing.assert_allclose(_losses(runs / case), _losses(runs / "flat"), rtol=2e-6)

  flat, piped = LeafReader(runs / "flat/checkpoints/2/items"), LeafReader(runs / case / "checkpoints/2/items")
  names = _names(piped.dir)
  moved = 0
  for name in names:
    found = _placement(name[3:], extra, flat, name[:3]) if name[2] == "decoder" else None
    if found is None:
      np.testing.assert_allclose(piped.read(name), flat.read(name), rtol=1e-5, atol=1e-7, err_msg=str(name))
      continue
    source, where = found
    store = flat.store(source)
    want = stage_load.read(store, where, tuple(slice(None) for _ in where.shape(tuple(store.shape))))
    np.testing.assert_allclose(piped.read(name), want, rtol=1e-5, atol=1e-7, err_msg=str(name))
    moved += 1
  assert moved >= 10, names

  # Hugging Face out: the pipelined run's checkpoint exports (its MoE layers laid back into one stack) as
  # the run without stages' does, every tensor.
  for run in ("flat", case):
    out = runs / f"hf_{run}"
    export.maxtext_to_hf(
      str(runs / run / "checkpoints/2"), RECIPE, str(out), overrides=MODEL[:2], dtype="float32", force=True
    )
  a, b = HFCheckpoint(runs / "hf_flat"), HFCheckpoint(runs / f"hf_{case}")
  assert sorted(b.tensors) == sorted(a.tensors)
  for n in a.tensors:
    np.testing.assert_allclose(np.asarray(b.raw(n)), np.asarray(a.raw(n)), rtol=1e-5, atol=1e-7, err_msg=n)


def test_pipeline_resume_keeps_its_layout(start):
  """A pipelined run resumes its own full state (its 4th loss is the run without stages' 4th); resuming
  with another layout is one line, exit 2, naming the fix."""
  runs, items = start
  extra, devices, batch = STAGES["2_stages_2_outside"]
  extra = [*extra, "learning_rate_schedule_steps=5"]  # the same schedule for 3 steps then 4, and for 4 at once
  name = "resumed"
  proc = _train(runs, name, [*extra, f"load_parameters_path={items}"], devices=devices, batch=batch)
  assert proc.returncode == 0, proc.stderr[-3000:]
  proc = _train(runs, name, extra, devices=devices, batch=batch, steps=4)
  assert proc.returncode == 0, proc.stderr[-3000:]
  proc = _train(runs, "flat4", [f"load_parameters_path={items}", "learning_rate_schedule_steps=5"], steps=4)
  assert proc.returncode == 0, proc.stderr[-3000:]
  np.testing.assert_allclose(_losses(runs / name), _losses(runs / "flat4"), rtol=2e-6)

  before = sorted(p.name for p in (runs / name).rglob("*"))
  proc = _train(runs, name, [], steps=5)
  assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0, proc.stderr[-3000:]
  assert (
    "has checkpoints written with ici_pipeline_parallelism=2" in proc.stderr and "resume with those keys" in proc.stderr
  )
  assert sorted(p.name for p in (runs / name).rglob("*")) == before
  proc = _train(runs, "flat4", extra, steps=5)
  assert proc.returncode == 2 and "written without pipeline stages" in proc.stderr, proc.stderr[-3000:]
  assert f"load_parameters_path={runs / 'flat4' / 'checkpoints' / '3' / 'items'}" in proc.stderr
