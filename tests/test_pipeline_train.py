"""Pipeline stages against the same model trained without them, from the same weights (a checkpoint written
without stages, laid out into the stages at load): the loss of every step, and every weight and routing
bias of the last checkpoint, and the Hugging Face export. A 5-layer tiny DeepSeek model (1 dense + 4 MoE
layers) trains 3 steps with a global batch of 8 sequences, on 4 fake CPU devices (8 with expert parallelism
inside the stages); so do a 4-layer tiny Qwen3-MoE and Mixtral (every layer MoE, the layers outside the
pipeline after it). The circular cases run 2 repeats of 2 stages. Then the resumes: a pipelined run resumes
its own full state; a run resumed with another layout is refused."""

import ast
import json
from pathlib import Path

import numpy as np
import pytest

from conftest import run_cli
from maxtext_moe.checkpoint import export
from maxtext_moe.checkpoint.orbax_io import LeafReader
from maxtext_moe.checkpoint.safetensors_io import HFCheckpoint
from maxtext_moe.upstream.pipeline import flat_load as stage_load

pytestmark = pytest.mark.ci  # about 15 minutes of training runs on 2 cores: run by .ci/run

RECIPE = "cpu/deepseek3-tiny"
RUN = ["dataset_type=synthetic", "max_target_length=32", "progress=silent"]
MODEL = ["override_model_config=true", "base_num_decoder_layers=5"]
# Qwen3-MoE and Mixtral by the model files converted checkpoints use, shrunk: 4 layers of 16 experts, top-4.
SMALL = ["override_model_config=true", "base_emb_dim=64", "base_num_query_heads=4", "base_num_kv_heads=2"]
SMALL += ["head_dim=16", "base_moe_mlp_dim=32", "base_num_decoder_layers=4"]
SMALL += ["num_experts=16", "num_experts_per_tok=4", "vocab_size=32000"]
MODELS = {  # model: (overrides, the pipeline's stack)
  "deepseek": (MODEL, stage_load.DEEPSEEK),
  "qwen3": (["model_name=qwen3-moe-from-hf", *SMALL, "base_mlp_dim=96"], stage_load.GENERIC),
  # MaxText: a Mixtral decoder's base_mlp_dim is its experts' (every layer is MoE)
  "mixtral": (["model_name=mixtral-from-hf", *SMALL, "base_mlp_dim=32"], stage_load.GENERIC),
}
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
  # a circular pipeline: 4 layers over 2 stages of 1 layer, 2 repeats; with 4 microbatches MaxText keeps the
  # last stage's outputs in its circular storage until the first stage takes them
  "circular_2_stages_2_repeats": (["ici_pipeline_parallelism=2"], 4, 2),
  "circular_4_microbatches": (["ici_pipeline_parallelism=2", "num_pipeline_microbatches=4"], 4, 2),
}
QWEN3 = ["2_stages_2_layers_each", "2_stages_2_outside", "circular_2_stages_2_repeats"]


def _train(runs: Path, name: str, extra: list[str], *, devices: int = 4, batch: int = 2, steps: int = 3, model=MODEL):
  args = ["train", *model, *RUN, f"base_output_directory={runs}", f"run_name={name}", f"steps={steps}"]
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
def runs(tmp_path_factory):
  return tmp_path_factory.mktemp("pipeline") / "runs"


_STARTED: dict[str, Path] = {}


def _start(runs: Path, model: str) -> Path:
  """Weights without stages (a run's step-0 checkpoint), and the run without stages trained from them
  (`flat_<model>`), once per model."""
  if model not in _STARTED:
    overrides = MODELS[model][0]
    proc = _train(runs, f"start_{model}", [], steps=1, model=overrides)
    assert proc.returncode == 0, proc.stderr[-3000:]
    items = runs / f"start_{model}" / "checkpoints" / "0" / "items"
    proc = _train(runs, f"flat_{model}", [*SGD, f"load_parameters_path={items}"], model=overrides)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _STARTED[model] = items
  return _STARTED[model]


@pytest.fixture(scope="module")
def start(runs):
  return runs, _start(runs, "deepseek")


def _placement(under: tuple[str, ...], extra: list[str], flat: LeafReader, head: tuple[str, ...], model: str):
  """Where a pipelined run's leaf `head + under` comes from in the run without stages: (its name there,
  the `stage_load.Placement`), or None for a leaf outside the pipeline's stack (the same name)."""
  keys = dict(k.split("=") for k in extra)
  stages, pipelined = int(keys["ici_pipeline_parallelism"]), int(keys.get("pipeline_parallel_layers", 4))
  per_stage = int(keys.get("num_layers_per_pipeline_stage", 1))
  stack = MODELS[model][1]
  st = stage_load.Stages(stages, pipelined // (stages * per_stage), per_stage, 4 - pipelined, 1, stack)
  where = stage_load.placement(under, st, is_param=head[0] == "params", ndim=0)
  if where is None:
    return None
  source = (*head, stack.name, *where.source)
  return source, stage_load.placement(under, st, is_param=head[0] == "params", ndim=len(flat.shape(source)))


def _trains_as_without_stages(runs: Path, model: str, case: str) -> None:
  items = _start(runs, model)
  extra, devices, batch = STAGES[case]
  name = f"{model}_{case}"
  overrides = MODELS[model][0]
  proc = _train(
    runs, name, [*extra, *SGD, f"load_parameters_path={items}"], devices=devices, batch=batch, model=overrides
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  np.testing.assert_allclose(_losses(runs / name), _losses(runs / f"flat_{model}"), rtol=2e-6)

  flat, piped = LeafReader(runs / f"flat_{model}/checkpoints/2/items"), LeafReader(runs / name / "checkpoints/2/items")
  names = _names(piped.dir)
  moved = 0
  for leaf in names:
    found = _placement(leaf[3:], extra, flat, leaf[:3], model) if leaf[2] == "decoder" else None
    if found is None:
      np.testing.assert_allclose(piped.read(leaf), flat.read(leaf), rtol=1e-5, atol=1e-7, err_msg=str(leaf))
      continue
    source, where = found
    store = flat.store(source)
    want = stage_load.read(store, where, tuple(slice(None) for _ in where.shape(tuple(store.shape))))
    np.testing.assert_allclose(piped.read(leaf), want, rtol=1e-5, atol=1e-7, err_msg=str(leaf))
    moved += 1
  assert moved >= 10, names

  # Hugging Face out: the pipelined run's checkpoint exports (the pipeline's layers and those outside it laid
  # back into one stack) as the run without stages' does, every tensor.
  for run in (f"flat_{model}", name):
    out = runs / f"hf_{run}"
    export.maxtext_to_hf(
      str(runs / run / "checkpoints/2"), RECIPE, str(out), overrides=overrides, dtype="float32", force=True
    )
  a, b = HFCheckpoint(runs / f"hf_flat_{model}"), HFCheckpoint(runs / f"hf_{name}")
  assert sorted(b.tensors) == sorted(a.tensors)
  for n in a.tensors:
    np.testing.assert_allclose(np.asarray(b.raw(n)), np.asarray(a.raw(n)), rtol=1e-5, atol=1e-7, err_msg=n)


@pytest.mark.parametrize("case", sorted(STAGES))
def test_pipeline_trains_as_without_stages(runs, case):
  _trains_as_without_stages(runs, "deepseek", case)


@pytest.mark.parametrize("case", QWEN3)
def test_qwen3_pipeline_trains_as_without_stages(runs, case):
  """Qwen3-MoE: no routing bias, every layer MoE; with pipeline_parallel_layers=2 its last 2 layers run
  after the pipeline (`decoder/layers_outside_pipeline`)."""
  _trains_as_without_stages(runs, "qwen3", case)


def test_mixtral_pipeline_circular_trains_as_without_stages(runs):
  _trains_as_without_stages(runs, "mixtral", "circular_2_stages_2_repeats")


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
