"""A checkpoint checked against its model from its metadata alone (checkpoint/model_check.py): what MaxText's
restore refuses (a tensor of another shape, one missing) is one line before anything runs, what it tolerates
(a leaf the model does not ask for, another dtype, the routing bias where a run keeps it) passes.

The checkpoints are written here from the tiny model's own parameter tree (zeros, which Orbax does not even
store), in the converter's layout: params/params/..., params/MoEBiasVar/..."""

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import run_cli
from maxtext_moe.checkpoint import model_check
from maxtext_moe.checkpoint.orbax_io import save_tree
from maxtext_moe.config import recipes
from maxtext_moe.errors import UserError

TINY = recipes.recipe_path("cpu/deepseek3-tiny")
EIGHT = ["num_experts=8", "override_model_config=true"]  # the same family with half the experts
SHARED_WO = ("params", "decoder", "moe_layers", "DeepSeekMoeBlock_0", "shared_experts", "wo", "kernel")
BIAS = ("MoEBiasVar", "decoder", "moe_layers", "DeepSeekMoeBlock_0", "MoeBlock_0", "gate", "bias")
# Pipeline stages of the tiny model on conftest's 8 devices: its 3 MoE layers as 1 outside + 2 stages.
STAGES = ["ici_pipeline_parallelism=2", "ici_fsdp_parallelism=4", "pipeline_parallel_layers=2"]
QWEN = ["model_name=qwen3-moe-from-hf", "override_model_config=true", "base_num_decoder_layers=4", "base_emb_dim=64"]
QWEN += ["base_num_query_heads=4", "base_num_kv_heads=2", "head_dim=16", "base_moe_mlp_dim=32", "num_experts=16"]
QWEN += ["num_experts_per_tok=4"]


def _leaves(resolution, overrides: list[str]) -> list:
  from maxtext_moe.upstream.maxtext.model import ONE_DEVICE_OVERRIDES, param_leaves

  return param_leaves(resolution.resolved(TINY, [*overrides, *ONE_DEVICE_OVERRIDES]))


def _write(out: Path, leaves: list, *, dtype=np.float32, drop=(), extra=None, aux=()) -> str:
  """A checkpoint of `leaves` (zeros) at out/items, without those in `drop`, the non-Params in `aux` where a
  run's own checkpoint keeps them (nnx_aux/model), and `extra` {path: array} beside them."""
  tree: dict = {}
  named = {(("nnx_aux", "model", *p[1:]) if p in aux else ("params", *p)): np.zeros(s, dtype) for p, s, _ in leaves}
  for path, value in {**{k: v for k, v in named.items() if k[1:] not in drop}, **(extra or {})}.items():
    node = tree
    for key in path[:-1]:
      node = node.setdefault(key, {})
    node[path[-1]] = value
  save_tree(out, tree)
  return str(out / "items")


@pytest.fixture(scope="module")
def tiny(resolution, tmp_path_factory):
  """The tiny model's tree, and checkpoints of it: its own, one of 8 experts, one without a tensor."""
  root = tmp_path_factory.mktemp("model_check")
  leaves = _leaves(resolution, [])
  eight = _leaves(resolution, EIGHT)
  return SimpleNamespace(
    leaves=leaves,
    tree=model_check.ModelTree("deepseek3-tiny", leaves),
    own=_write(root / "own", leaves, dtype=np.float16),
    eight=_write(root / "eight", eight),
    no_wo=_write(root / "no_wo", leaves, drop={SHARED_WO}),
    no_bias=_write(root / "no_bias", leaves, drop={BIAS}),
    run_kept=_write(root / "run_kept", leaves, aux={BIAS}, extra={("params", "params", "unused", "w"): np.ones(3)}),
    root=root,
  )


def _cfg(path: str, **keys) -> SimpleNamespace:
  """What the check reads of a resolved config, as the tiny recipe resolves it."""
  base = dict(load_parameters_path=path, load_full_state_path="", scan_layers=True, emb_dim=64, param_scan_axis=1)
  return SimpleNamespace(**(base | {"model_name": "deepseek3-tiny", "model_file": ""} | keys))


def _refusal(cfg, tree) -> str:
  with pytest.raises(UserError) as e:
    model_check.check(cfg, tree)
  return str(e.value)


EIGHT_LINE = (
  "does not hold this model's parameters: params.decoder.moe_layers.DeepSeekMoeBlock_0.MoeBlock_0.gate.kernel "
  "is [64, 3, 8] in the checkpoint, [64, 3, 16] in deepseek3-tiny; 4 more tensors differ (load a checkpoint of "
  "deepseek3-tiny, or set the model keys it was written with)"
)
NO_WO = (
  "does not hold this model's parameters: params.decoder.moe_layers.DeepSeekMoeBlock_0.shared_experts.wo.kernel "
  "([32, 3, 64] in deepseek3-tiny) is not in the checkpoint ("
)


def test_its_own_checkpoint_passes_in_another_dtype_and_as_a_run_keeps_it(tiny):
  """MaxText's restore casts dtypes (float16 here, float32 in the model), ignores a leaf the model does not
  ask for, and our load reads the routing bias from a run's nnx_aux."""
  model_check.check(_cfg(tiny.own), tiny.tree)
  model_check.check(_cfg(tiny.run_kept), tiny.tree)
  model_check.check(_cfg(str(Path(tiny.own).parent)), tiny.tree)  # the step directory, as MaxText takes it too


def test_another_expert_count_is_one_line_naming_the_first_tensor_and_both_shapes(tiny):
  assert _refusal(_cfg(tiny.eight), tiny.tree) == f"{tiny.eight} {EIGHT_LINE}"
  full = _cfg("", load_full_state_path=tiny.eight)
  assert _refusal(full, tiny.tree) == f"{tiny.eight} {EIGHT_LINE}"


def test_a_missing_tensor_is_named(tiny):
  assert _refusal(_cfg(tiny.no_wo), tiny.tree) == (
    f"{tiny.no_wo} {NO_WO}load a checkpoint of deepseek3-tiny, or set the model keys it was written with)"
  )
  assert _refusal(_cfg(tiny.no_bias), tiny.tree) == (
    f"{tiny.no_bias} does not hold this model's parameters: MoEBiasVar.decoder.moe_layers.DeepSeekMoeBlock_0."
    "MoeBlock_0.gate.bias ([3, 16] in deepseek3-tiny) is not in the checkpoint (load a checkpoint of "
    "deepseek3-tiny, or set the model keys it was written with)"
  )
  model_check.check(_cfg("", load_full_state_path=tiny.no_bias), tiny.tree)  # a full state's bias starts fresh


def test_the_layer_axis_keeps_its_own_message(tiny):
  assert _refusal(_cfg(tiny.own, param_scan_axis=0), tiny.tree) == (
    f"{tiny.own} stores its stacked layer weights with the layer axis at 1 (a converted checkpoint, or a run at "
    "MaxText's default, has 1), and this config reads them at param_scan_axis=0 (offload=optimizer_params sets "
    "it: MaxText offloads parameters only so): use offload=optimizer"
  )


def test_a_remote_or_absent_checkpoint_is_left_to_the_restore(tiny):
  for path in ("gs://bucket/ck/items", "s3://bucket/ck/items", "", str(tiny.root / "nothing")):
    model_check.check(_cfg(path), tiny.tree)
  from maxtext_moe.cluster import fit

  assert fit.check("cpu/deepseek3-tiny", ["load_parameters_path=gs://bucket/ck/items", *EIGHT]).plan.base.fits


def test_the_checkpoints_model_is_named_in_the_fix(tiny, tmp_path):
  """A conversion's OUT/model.yml (a run's RUN/model.yml) beside the checkpoint is the model it holds."""
  ck = _write(tmp_path / "ck", tiny.leaves, drop={SHARED_WO})
  theirs = tmp_path / "ck" / "model.yml"
  theirs.write_text("model_name: deepseek3-from-hf\n")
  assert _refusal(_cfg(ck), tiny.tree) == (
    f"{ck} {NO_WO}its model is {theirs}: pass model_file={theirs}, or load a checkpoint of deepseek3-tiny)"
  )
  assert _refusal(_cfg(ck, model_file=str(theirs)), tiny.tree) == (
    f"{ck} {NO_WO}the overrides change the model of model_file={theirs}: drop those that change its shapes)"
  )


def test_a_pipelined_model_is_compared_as_the_stack_it_loads_from(tiny, resolution, tmp_path):
  """Our load lays a checkpoint without stages into the pipeline's stages: the staged tree is compared as that
  stack. One written with stages loads only into the same stages: a one-device tree cannot tell, an
  unstaged model cannot load it."""
  from maxtext_moe.launch.preflight import model_leaves

  cfg = resolution.resolve(TINY, STAGES)
  staged = model_check.ModelTree.as_run(cfg, model_leaves(cfg))
  assert staged.stages is not None and any("pipeline_module" in p for p, _, _ in staged.leaves)
  model_check.check(_cfg(tiny.own), staged)
  assert _refusal(_cfg(tiny.eight), staged) == f"{tiny.eight} {EIGHT_LINE}"
  written = _write(tmp_path / "staged", staged.leaves)
  model_check.check(_cfg(written), staged)
  model_check.check(_cfg(written), model_check.ModelTree("deepseek3-tiny", tiny.leaves, staged=True))
  assert _refusal(_cfg(written), tiny.tree) == (
    f"{written} does not hold this model's parameters: params.decoder.moe_layers.DeepSeekMoeBlock_0.MoeBlock_0."
    "gate.kernel ([64, 3, 16] in deepseek3-tiny) is not in the checkpoint; 16 more tensors differ (it was written "
    "with pipeline stages and loads only into the same stages: train with its run's keys)"
  )


@pytest.mark.parametrize(
  "layout",
  [
    STAGES,
    [*QWEN, "ici_pipeline_parallelism=2", "ici_fsdp_parallelism=4"],  # circular: 2 stages x 2 repeats
    [*QWEN, *STAGES[:2], "num_layers_per_pipeline_stage=2", "scan_layers_per_stage=true"],  # a stage scans 2
  ],
  ids=["deepseek", "qwen3-circular", "qwen3-scanned-stage"],
)
def test_a_pipelined_model_is_judged_as_its_tree_without_stages(layout, resolution, tmp_path):
  """What the pipelined model's check says of a checkpoint is what its tree on one device (no stages) gets."""
  from maxtext_moe.launch.preflight import model_leaves

  cfg = resolution.resolve(TINY, layout)
  staged = model_check.ModelTree.as_run(cfg, model_leaves(cfg))
  flat = model_check.ModelTree(str(cfg.model_name), _leaves(resolution, layout))
  assert staged.stages is not None
  own = _write(tmp_path / "own", flat.leaves)
  model_check.check(_cfg(own), staged)
  other = _write(tmp_path / "other", _leaves(resolution, [*layout, *EIGHT]))
  assert _refusal(_cfg(other), staged) == _refusal(_cfg(other), flat)


@pytest.mark.ci  # kept out of the README suite's 10 minutes; CI runs the ci tier
def test_train_and_plan_check_refuse_it_with_exit_2_and_write_nothing(tiny, tmp_path):
  """What a launcher runs before the job takes its GPUs: `train --check` (and the real start) and `plan
  --check` (the first step of scripts/slurm/train.sbatch, and `k8s` through cluster/fit.py)."""
  before = sorted(p.name for p in tiny.root.rglob("*"))
  keys = [f"load_parameters_path={tiny.eight}", f"base_output_directory={tmp_path}/runs"]
  for command in (["train", "cpu/deepseek3-tiny-finetune", *keys], ["plan", "cpu/deepseek3-tiny-finetune", *keys]):
    proc = run_cli([*command, "--check"], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [f"maxtext-moe: error: {tiny.eight} {EIGHT_LINE}"], command
    assert proc.stdout == ""
  assert list(tmp_path.iterdir()) == []
  assert sorted(p.name for p in tiny.root.rglob("*")) == before
