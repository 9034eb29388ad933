"""Any DeepseekV3ForCausalLM checkpoint converts with its model read from config.json, and exports with the
config its model really has. Fixtures: tiny random models made from the published config.json of
DeepSeek-V3, Moonlight-16B-A3B and Kimi-K2-Instruct (tests/fixtures/make_hf_configs.py), with
transformers' logits."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from conftest import REPO, run_cli
from maxtext_moe.checkpoint import convert, export, families
from maxtext_moe.checkpoint.safetensors_io import HFCheckpoint
from maxtext_moe.errors import UserError

FIXTURES = REPO / "tests" / "fixtures" / "hf_configs"
TINY = REPO / "tests" / "fixtures" / "hf_deepseek3_tiny"
F32 = ["dtype=float32", "weight_dtype=float32", "matmul_precision=highest", "mtp_num_layers=0"]
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def _logits(out: Path, tokens: np.ndarray) -> np.ndarray:
  """MaxText's logits (our MoE block) for the converted checkpoint OUT, its model from OUT/model.yml."""
  from maxtext_moe.checkpoint.model_spec import from_model_yaml
  from maxtext_moe.upstream.maxtext.model import ONE_DEVICE_OVERRIDES, load_and_forward
  from maxtext_moe.upstream.resolution import resolved

  batch = np.tile(tokens, (4, 1))  # conftest's 8 devices shard the batch: 8 rows, the first 2 compared
  spec = from_model_yaml(out / "model.yml", [*F32, "per_device_batch_size=1", f"max_target_length={tokens.shape[1]}"])
  cfg = resolved(spec.recipe, [*ONE_DEVICE_OVERRIDES, "ici_data_parallelism=-1", *spec.overrides])
  return np.asarray(load_and_forward(cfg, str(out / "items"), batch))[: tokens.shape[0]]


@pytest.mark.parametrize("name", ["deepseek_v3", "moonlight_16b_a3b", "kimi_k2_instruct"])
def test_published_architectures_convert_without_a_model_and_match_transformers(name, tmp_path):
  """YaRN (DeepSeek-V3: factor 40, beta 32/1; Kimi-K2: factor 32, beta 1/1, theta 50000) and plain RoPE
  (Moonlight: theta 50000, eps 1e-5, no q LoRA, one routing group) alike, to 1e-4 in float32."""
  summary = convert.hf_to_maxtext(str(FIXTURES / name), None, str(tmp_path / "out"), dtype="float32")
  ref = np.load(FIXTURES / name / "reference.npz")
  got = _logits(tmp_path / "out", ref["tokens"])
  np.testing.assert_allclose(got, ref["logits"], rtol=0, atol=1e-4)
  assert summary["model"].startswith("the config.json of")
  source = json.loads((FIXTURES / name / "config.json").read_text())
  assert json.loads((tmp_path / "out" / "hf_config.json").read_text()) == source, "kept verbatim for the export"


# Fields an export writes although the source may not have them: transformers' defaults the source relies
# on, written out (rope_interleave), and DeepSeek's own keys that transformers ignores but DeepSeek's
# config.json and vLLM read (scoring_func, topk_method, moe_layer_freq); and the export's dtype.
MAY_DIFFER = {"rope_interleave", "scoring_func", "topk_method", "moe_layer_freq", "torch_dtype", "dtype"}


def _config_diff(a: dict, b: dict) -> dict:
  return {k: (a.get(k), b.get(k)) for k in set(a) | set(b) if a.get(k, "<absent>") != b.get(k, "<absent>")}


def test_yarn_export_keeps_the_whole_config_and_converts_back_to_the_same_logits(tmp_path):
  """The project's own YaRN fixture: the exported config.json equals the source's except for MAY_DIFFER
  (YaRN included: it used to be exported as plain RoPE), and the export, converted back with no --model
  (its own config.json decides the model), gives transformers' reference logits."""
  first = tmp_path / "mt"
  convert.hf_to_maxtext(str(TINY / "bf16"), None, str(first), overrides=["mtp_num_layers=1"])
  export.maxtext_to_hf(str(first), None, str(tmp_path / "hf"))  # the model.yml next to the checkpoint
  source = json.loads((TINY / "bf16" / "config.json").read_text())
  exported = json.loads((tmp_path / "hf" / "config.json").read_text())
  differ = _config_diff(source, exported)
  assert set(differ) <= MAY_DIFFER, differ
  assert exported["rope_parameters"] == source["rope_parameters"]
  convert.hf_to_maxtext(str(tmp_path / "hf"), None, str(tmp_path / "back"), dtype="float32")
  ref = np.load(TINY / "reference.npz")
  np.testing.assert_allclose(_logits(tmp_path / "back", ref["tokens"]), ref["logits_bf16"], rtol=0, atol=1e-4)


def test_legacy_rope_scaling_style_is_kept_on_export(tmp_path):
  """DeepSeek-V3's own config.json writes rope_theta + rope_scaling{type: yarn}; so does its export."""
  name = "kimi_k2_instruct"
  convert.hf_to_maxtext(str(FIXTURES / name), None, str(tmp_path / "mt"))
  export.maxtext_to_hf(str(tmp_path / "mt"), None, str(tmp_path / "hf"))
  source = json.loads((FIXTURES / name / "config.json").read_text())
  exported = json.loads((tmp_path / "hf" / "config.json").read_text())
  assert set(_config_diff(source, exported)) <= MAY_DIFFER
  assert "rope_parameters" not in exported and exported["rope_scaling"]["type"] == "yarn"


def test_a_different_recipe_is_refused_with_every_difference(tmp_path):
  with pytest.raises(UserError) as e:
    convert.hf_to_maxtext(str(FIXTURES / "moonlight_16b_a3b"), "cpu/deepseek3-tiny", str(tmp_path / "out"))
  message = str(e.value)
  for part in (
    "rms_norm_eps=1e-05 vs normalization_layer_epsilon=1e-06 (set normalization_layer_epsilon=1e-05)",
    "q_lora_rank=None vs q_lora_rank=32 (set q_lora_rank=0)",
    "n_group=1 vs n_routing_groups=4 (set n_routing_groups=1)",
    "routed_scaling_factor=2.446 vs routed_scaling_factor=2.5",
    "rope_theta=50000.0 vs rope_max_timescale=10000 (set rope_max_timescale=50000)",
    "rope_parameters.factor=None vs rope_factor=40 (set rope_factor=1)",
    "vocab_size=256 vs vocab_size=32000",
  ):
    assert part in message
  assert "\n" not in message and not (tmp_path / "out").exists()


def _write_with(tmp_path: Path, **changes) -> Path:
  d = tmp_path / "hf"
  shutil.copytree(FIXTURES / "moonlight_16b_a3b", d)
  config = json.loads((d / "config.json").read_text()) | changes
  (d / "config.json").write_text(json.dumps(config))
  return d


def test_fields_maxtext_cannot_represent_are_all_named(tmp_path):
  d = _write_with(
    tmp_path,
    hidden_act="gelu",
    norm_topk_prob=False,
    scoring_func="softmax",
    rope_scaling={"type": "linear", "factor": 2.0},
  )
  with pytest.raises(UserError) as e:
    convert.hf_to_maxtext(str(d), None, str(tmp_path / "out"))
  message = str(e.value)
  for part in ("hidden_act=gelu", "norm_topk_prob=False", "scoring_func=softmax", "rope_parameters.rope_type=linear"):
    assert part in message
  assert message.startswith("config.json has fields MaxText cannot represent:") and "\n" not in message
  assert not (tmp_path / "out").exists()


def test_dtype_rules_in_both_directions(tmp_path):
  """An all-F32 source to bf16: matrices and norms bf16, the correction bias float32, and the record says
  so; exported: the same rule."""
  from maxtext_moe.checkpoint.orbax_io import LeafReader

  d = tmp_path / "f32"
  shutil.copytree(FIXTURES / "kimi_k2_instruct", d)
  src = HFCheckpoint(d)
  tensors = {n: np.asarray(src.raw(n), np.float32) for n in src.tensors}
  save_file(tensors, str(d / "model.safetensors"))
  summary = convert.hf_to_maxtext(str(d), None, str(tmp_path / "mt"))
  assert summary["dtypes"] == {"matrices and norms": "bfloat16", "e_score_correction_bias": "float32"}
  reader = LeafReader(tmp_path / "mt" / "items")
  _, plans = convert.model_tree(convert.model_spec.from_model_yaml(tmp_path / "mt" / "model.yml", []))
  for plan in plans:
    want = "float32" if plan.hf_template.endswith("e_score_correction_bias") else "bfloat16"
    assert str(reader.read(("params", *plan.leaf.path)).dtype) == want, plan.leaf.path
  export.maxtext_to_hf(str(tmp_path / "mt"), None, str(tmp_path / "hf"))
  out = HFCheckpoint(tmp_path / "hf")
  dtypes = {("F32" if n.endswith("e_score_correction_bias") else "BF16") == out.tensors[n].dtype for n in out.tensors}
  assert dtypes == {True}
  assert any(n.endswith("input_layernorm.weight") for n in out.tensors), "norms are checked too"


def test_model_yaml_is_a_model_file_for_any_recipe(tmp_path, resolution):
  convert.hf_to_maxtext(str(FIXTURES / "kimi_k2_instruct"), None, str(tmp_path / "out"))
  model_yml = tmp_path / "out" / "model.yml"
  cfg = resolution.resolve(REPO / "configs/recipes/h200x8/deepseek3-proxy-16b.yml", [f"model_file={model_yml}"])
  assert (cfg.num_experts, cfg.routed_scaling_factor, cfg.rope_factor, cfg.beta_fast) == (16, 2.827, 32, 1)
  assert (cfg.ici_expert_parallelism, cfg.ici_fsdp_parallelism) == (2, 4), "the layout stays the recipe's"
  bad = tmp_path / "bad.yml"
  bad.write_text(model_yml.read_text() + "learning_rate: 0.1\n")
  with pytest.raises(UserError, match="sets learning_rate, which are not model keys"):
    resolution.resolve(REPO / "configs/recipes/cpu/deepseek3-tiny.yml", [f"model_file={bad}"])


@pytest.mark.ci
def test_cli_converts_without_model_and_prints_a_readable_size(tmp_path):
  r = run_cli(
    ["convert", "hf-to-maxtext", "--hf", str(FIXTURES / "moonlight_16b_a3b"), "--out", str(tmp_path / "o")],
    cwd=tmp_path,
  )
  assert r.returncode == 0, r.stderr[-2000:]
  lines = r.stdout.splitlines()
  assert lines[0].startswith("maxtext-moe: wrote ") and " kB in " in lines[0] and "0.00 GB" not in r.stdout
  assert f"model_file={tmp_path / 'o' / 'model.yml'}" in lines[-1]


def test_every_model_key_is_one_a_model_file_may_set():
  import yaml

  from maxtext_moe.config.model_file import MODEL_KEYS

  for fixture in ("deepseek_v3", "qwen3_30b_a3b", "mixtral_8x7b"):
    raw = json.loads((FIXTURES / fixture / "config.json").read_text())
    keys, family = families.model_keys(raw), families.for_config_json(raw)
    assert set(keys) <= set(MODEL_KEYS), fixture
    shared = yaml.safe_load((REPO / "configs" / "models" / f"{family.model_name}.yml").read_text())
    assert family.structure.items() <= shared.items() and not set(shared) & set(MODEL_KEYS), fixture
