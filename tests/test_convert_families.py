"""Qwen3-MoE and Mixtral both ways, and DeepSeek-V3 as transformers saves it (no MTP tensors), against
transformers' own models. Fixtures: tiny random models made by transformers from the published config.json
files, shrunk in width and depth only (tests/fixtures/make_hf_moe_families.py), with their logits."""

import json
import shutil

import jax
import ml_dtypes
import numpy as np
import pytest
from test_convert import _cross_entropy
from test_convert_any import _config_diff, _logits

from conftest import REPO, run_cli
from maxtext_moe.checkpoint import convert, export
from maxtext_moe.checkpoint.safetensors_io import HFCheckpoint
from maxtext_moe.errors import UserError

FIXTURES = REPO / "tests" / "fixtures" / "hf_configs"
FAMILIES = ["qwen3_30b_a3b", "mixtral_8x7b"]
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


@pytest.mark.parametrize("name", [*FAMILIES, "deepseek_v3_saved"])
def test_converted_without_a_model_gives_transformers_logits(name, tmp_path):
  """To 1e-4 in float32, the model read from config.json alone (Qwen3: q/k norms, head_dim not hidden /
  heads, softmax top-k renormalised; Mixtral: the softmax scale folded into the query kernel)."""
  summary = convert.hf_to_maxtext(str(FIXTURES / name), None, str(tmp_path / "out"), dtype="float32")
  ref = np.load(FIXTURES / name / "reference.npz")
  got = _logits(tmp_path / "out", ref["tokens"])
  np.testing.assert_allclose(got, ref["logits"], rtol=0, atol=1e-4)
  assert summary["ignored_hf_tensors"] == []
  source = json.loads((FIXTURES / name / "config.json").read_text())
  assert json.loads((tmp_path / "out" / "hf_config.json").read_text()) == source, "kept verbatim for the export"


def test_transformers_saved_deepseek_converts_without_mtp_and_says_so(tmp_path):
  """save_pretrained drops the MTP tensors but keeps num_nextn_predict_layers: 1. Converted with no
  override, with a note; asked for the MTP layer by a recipe, one line naming the cause and the fix."""
  name = "deepseek_v3_saved"
  summary = convert.hf_to_maxtext(str(FIXTURES / name), None, str(tmp_path / "out"))
  assert summary["notes"] == [
    "config.json says num_nextn_predict_layers=1 but the checkpoint holds 0 MTP layer(s) (transformers' "
    "save_pretrained drops them): converted without them (mtp_num_layers=0)"
  ]
  assert "mtp_num_layers: 0" in (tmp_path / "out" / "model.yml").read_text()
  with pytest.raises(UserError) as e:
    convert.hf_to_maxtext(
      str(FIXTURES / name), str(tmp_path / "out" / "model.yml"), str(tmp_path / "o2"), overrides=["mtp_num_layers=1"]
    )
  assert "holds 0 MTP layer(s)" in str(e.value) and "save_pretrained drops them" in str(e.value)
  assert "pass mtp_num_layers=0" in str(e.value) and not (tmp_path / "o2").exists()


@pytest.mark.extended
def test_transformers_saved_deepseek_exports_a_config_of_what_it_holds(tmp_path):
  """The export's config.json is the source's but for num_nextn_predict_layers (0: what the checkpoint
  holds, so transformers and vLLM look for no MTP weights), and converted back it gives the logits."""
  name = "deepseek_v3_saved"
  convert.hf_to_maxtext(str(FIXTURES / name), None, str(tmp_path / "mt"))
  export.maxtext_to_hf(str(tmp_path / "mt"), None, str(tmp_path / "hf"))
  source = json.loads((FIXTURES / name / "config.json").read_text())
  exported = json.loads((tmp_path / "hf" / "config.json").read_text())
  differ = _config_diff(source, exported)
  assert differ.pop("num_nextn_predict_layers") == (1, 0)
  assert set(differ) <= {"rope_interleave", "scoring_func", "topk_method", "moe_layer_freq", "dtype"}, differ
  convert.hf_to_maxtext(str(tmp_path / "hf"), None, str(tmp_path / "back"), dtype="float32")
  ref = np.load(FIXTURES / name / "reference.npz")
  np.testing.assert_allclose(_logits(tmp_path / "back", ref["tokens"]), ref["logits"], rtol=0, atol=1e-4)


def _bf16_steps(a: np.ndarray, b: np.ndarray) -> int:
  """The largest distance between a and b in bf16 representable steps."""
  ia = a.view(np.int16).astype(np.int32)
  ib = b.view(np.int16).astype(np.int32)
  return int(np.abs(ia - ib).max())


@pytest.mark.parametrize("name", [pytest.param("qwen3_30b_a3b", marks=pytest.mark.extended), "mixtral_8x7b"])
def test_round_trip_and_the_whole_config(name, tmp_path):
  """HF bf16 -> MaxText -> HF. Through a float32 checkpoint every tensor comes back bit for bit; through a
  bf16 one too, except Mixtral's q_proj, which MaxText holds scaled by 1/sqrt(head_dim) (one rounding: at
  most one bf16 step). The exported config.json equals the source's, every field."""
  src = HFCheckpoint(FIXTURES / name)
  for dtype in ("float32", "bfloat16"):
    mt, hf = tmp_path / f"mt-{dtype}", tmp_path / f"hf-{dtype}"
    convert.hf_to_maxtext(str(FIXTURES / name), None, str(mt), dtype=dtype)
    export.maxtext_to_hf(str(mt), None, str(hf), max_shard_gb=0.0002)
    back = HFCheckpoint(hf)
    assert set(back.tensors) == set(src.tensors)
    assert len({i.shard for i in back.tensors.values()}) > 1, "the size limit must split the output into shards"
    scaled = [n for n in src.tensors if name == "mixtral_8x7b" and n.endswith("q_proj.weight")]
    for n in src.tensors:
      a, b = src.raw(n), back.raw(n)
      assert a.dtype == b.dtype == ml_dtypes.bfloat16 and a.shape == b.shape, n
      if dtype == "bfloat16" and n in scaled:
        assert _bf16_steps(a, b) <= 1, n
      else:
        assert a.tobytes() == b.tobytes(), (dtype, n)
    exported = json.loads((hf / "config.json").read_text())
    # every field, but `dtype`: transformers 5's name for the torch_dtype (4's) the source has, written too
    assert _config_diff(json.loads((FIXTURES / name / "config.json").read_text()), exported) == {
      "dtype": (None, "bfloat16")
    }


@pytest.mark.parametrize(
  ("name", "change", "named"),
  [
    ("qwen3_30b_a3b", {"norm_topk_prob": False}, "norm_topk_prob=False"),
    ("qwen3_30b_a3b", {"mlp_only_layers": [1]}, "mlp_only_layers=[1]"),
    (
      "qwen3_30b_a3b",
      {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}},
      "rope_type=yarn",
    ),
    ("mixtral_8x7b", {"sliding_window": 4096}, "sliding_window=4096"),
    ("mixtral_8x7b", {"hidden_act": "gelu"}, "hidden_act=gelu"),
  ],
)
def test_what_maxtext_cannot_represent_is_named(name, change, named, tmp_path):
  d = tmp_path / "hf"
  shutil.copytree(FIXTURES / name, d)
  (d / "config.json").write_text(json.dumps(json.loads((d / "config.json").read_text()) | change))
  with pytest.raises(UserError) as e:
    convert.hf_to_maxtext(str(d), None, str(tmp_path / "out"))
  assert named in str(e.value) and str(e.value).startswith("config.json has fields MaxText cannot represent")
  assert not (tmp_path / "out").exists()


def test_an_unsupported_architecture_is_one_line_listing_the_supported(tmp_path):
  d = tmp_path / "llama"
  shutil.copytree(FIXTURES / "mixtral_8x7b", d)
  config = json.loads((d / "config.json").read_text()) | {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
  (d / "config.json").write_text(json.dumps(config))
  r = run_cli(["convert", "hf-to-maxtext", "--hf", str(d), "--out", str(tmp_path / "o")], cwd=tmp_path)
  assert r.returncode == 2, r.stderr[-2000:]
  assert r.stderr.strip() == (
    "maxtext-moe: error: config.json is a ['LlamaForCausalLM'] model; the converter reads "
    "DeepseekV3ForCausalLM, Qwen3MoeForCausalLM, MixtralForCausalLM"
  )
  assert not (tmp_path / "o").exists()


def test_a_recipe_of_the_other_family_is_refused_with_the_differences(tmp_path):
  with pytest.raises(UserError) as e:
    convert.hf_to_maxtext(str(FIXTURES / "qwen3_30b_a3b"), "h100x8/mixtral-8x7b", str(tmp_path / "out"))
  assert "a Qwen3MoeForCausalLM checkpoint needs decoder_block=qwen3_moe, not mixtral" in str(e.value)
  assert "num_experts=16 vs num_experts=8" in str(e.value)


_SHIPPED = [
  (
    "h100x8/mixtral-8x7b",
    "mixtral_8x7b",
    [],
    "model.norm.weight has shape [64] but model h100x8/mixtral-8x7b expects [4096]",
  ),
  (
    "h100x8/deepseek3-671b-finetune",
    "deepseek_v3",
    ["mtp_num_layers=0", "override_model_config=true"],
    "model.layers.3.mlp.gate.e_score_correction_bias has shape [16] but model h100x8/deepseek3-671b-finetune "
    "expects [256]",
  ),
]


@pytest.mark.parametrize(("recipe", "published", "overrides", "differs"), _SHIPPED)
def test_a_shipped_recipe_is_the_model_of_its_published_config(recipe, published, overrides, differs, tmp_path):
  """--model RECIPE against the model's real config.json (the tiny fixture's tensors beside it): the
  comparison finds nothing and a tensor is the first difference. A fine-tune recipe describes the model
  without its weights (it asked for load_parameters_path, the output convert writes); Mixtral's
  max_position_embeddings is config.json's 32768 (it was MaxText's base.yml's, DeepSeek's 163840)."""
  d = tmp_path / "hf"
  shutil.copytree(FIXTURES / published, d)
  shutil.copy(FIXTURES / "published" / f"{published}.json", d / "config.json")
  with pytest.raises(UserError) as e:
    convert.hf_to_maxtext(str(d), recipe, str(tmp_path / "out"), overrides=overrides)
  assert str(e.value) == f"tensor {differs}: the checkpoint is a different model"
  assert not (tmp_path / "out").exists()


def test_the_mtp_fix_named_for_a_recipe_is_one_its_model_file_takes(tmp_path):
  """The fine-tune recipe's model file sets mtp_num_layers: 1, so the fix must say override_model_config
  (mtp_num_layers=0 alone is MaxText's refusal); the fixture is saved by transformers, without MTP."""
  d = tmp_path / "hf"
  shutil.copytree(FIXTURES / "deepseek_v3_saved", d)
  shutil.copy(FIXTURES / "published" / "deepseek_v3.json", d / "config.json")
  with pytest.raises(UserError) as e:
    convert.hf_to_maxtext(str(d), "h100x8/deepseek3-671b-finetune", str(tmp_path / "out"))
  assert str(e.value) == (
    f"h100x8/deepseek3-671b-finetune has mtp_num_layers=1 but {d} holds 0 MTP layer(s) (config.json has "
    "num_nextn_predict_layers, the tensors are absent: transformers' save_pretrained drops them); pass "
    "mtp_num_layers=0 override_model_config=true to convert without them"
  )
  assert not (tmp_path / "out").exists()


@pytest.mark.extended
@pytest.mark.parametrize("name", FAMILIES)
def test_finetune_starts_at_the_converted_models_loss(name, tmp_path, resolution):
  """convert (no --model), two steps of the CPU fine-tuning recipe with model_file=OUT/model.yml (the
  layout the recipe's, the model the checkpoint's): the first loss is the converted model's own on
  MaxText's synthetic batch, far from a fresh model's; then the export finds the model by itself."""
  ckpt = convert.hf_to_maxtext(str(FIXTURES / name), None, str(tmp_path / "ckpt"), dtype="float32")
  common = ["dataset_type=synthetic", "steps=2", "per_device_batch_size=2", "max_target_length=24"]
  common += [f"base_output_directory={tmp_path / 'runs'}", "progress=silent", f"model_file={ckpt['model_file']}"]
  for recipe, run, extra in [
    ("cpu/deepseek3-tiny-finetune", "ft", [f"load_parameters_path={ckpt['load_parameters_path']}"]),
    ("cpu/deepseek3-tiny", "scratch", []),
  ]:
    proc = run_cli(["train", recipe, *common, f"run_name={run}", *extra], cwd=tmp_path, devices=1)
    assert proc.returncode == 0, proc.stderr[-3000:]
  first = {
    r: json.loads((tmp_path / "runs" / r / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    for r in ("ft", "scratch")
  }
  key = jax.random.key(0, impl="unsafe_rbg")  # MaxText's synthetic batch, as in test_convert.py
  tokens = np.asarray(jax.random.randint(key, (2, 25), 0, 256, dtype=np.int32))
  reference = _cross_entropy(_logits(tmp_path / "ckpt", tokens[:, :-1]), tokens[:, 1:])
  assert first["ft"] == pytest.approx(reference, abs=1e-5)
  assert abs(first["scratch"] - reference) > 1.0
  step = sorted((tmp_path / "runs" / "ft" / "checkpoints").iterdir())[-1]
  proc = run_cli(
    ["convert", "maxtext-to-hf", "--ckpt", str(step), "--model", ckpt["model_file"], "--out", str(tmp_path / "hf")],
    cwd=tmp_path,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert (
    json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"]
    == json.loads((FIXTURES / name / "config.json").read_text())["architectures"]
  )
