"""Expert weights gathered in FP8 (`moe.fp8_gather`) on 8 fake CPU devices: what TE's current scaling makes
of the gathered weight is what it makes of the bf16 gather, code for code and scale for scale; the wire
carries e4m3; the gradient is the bf16 gather's; and the block runs it under moe_gemm_quantization=fp8."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from maxtext_moe.moe import block, fp8_gather


def _mesh() -> Mesh:
  return Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("expert", "fsdp"))


def _te_quantized(w_EDF: jax.Array) -> tuple[jax.Array, jax.Array]:
  """TE's grouped_quantize of a kernel under current scaling, written out: per expert, scale = 448 / amax
  (compute_scale_from_amax, margin 0), codes = e4m3(w x scale)."""
  scale_E = fp8_gather.te_scale(jnp.max(jnp.abs(w_EDF.astype(jnp.float32)), axis=(1, 2)))
  return fp8_gather.quantize(w_EDF, scale_E), scale_E


def _weights(key, shape) -> jax.Array:
  """bf16 weights with what breaks a careless scaling: experts of zeros, of subnormal-small values, and
  spanning many binades."""
  kinds = jnp.array([0.02, 0.0, 1e-6, 3.0] * (shape[0] // 4))
  w = jax.random.normal(key, shape, jnp.float32) * kinds[:, None, None]
  wide = jnp.exp(jax.random.uniform(jax.random.PRNGKey(1), shape, minval=-12, maxval=4))
  w = jnp.where((jnp.arange(shape[0]) % 4 == 3)[:, None, None], w * wide, w)
  return w.astype(jnp.bfloat16)


@pytest.mark.parametrize(
  "spec", [P("expert", "fsdp", None), P("expert", None, "fsdp"), P(("expert", "fsdp"), None, None)]
)
def test_te_recovers_the_same_codes_and_scales_from_the_fp8_gather(spec):
  mesh = _mesh()
  w = _weights(jax.random.PRNGKey(0), (8, 16, 24))

  def both(w_shard):
    bf16 = block._gathered(w_shard, spec, keep="expert")
    fp8 = block._gathered(w_shard, spec, keep="expert", fp8=True)
    return bf16, fp8

  bf16, fp8 = jax.jit(
    jax.shard_map(both, mesh=mesh, in_specs=(spec,), out_specs=(P("expert"), P("expert")), check_vma=False)
  )(w)
  assert fp8.dtype == bf16.dtype == jnp.bfloat16 and fp8.shape == bf16.shape
  codes_bf16, scale_bf16 = _te_quantized(bf16)
  codes_fp8, scale_fp8 = _te_quantized(fp8)
  np.testing.assert_array_equal(np.asarray(scale_fp8), np.asarray(scale_bf16))
  np.testing.assert_array_equal(np.asarray(codes_fp8.astype(jnp.float32)), np.asarray(codes_bf16.astype(jnp.float32)))
  # and it is a quantization: the weights themselves moved (the zeros expert and exact values aside)
  assert not np.array_equal(np.asarray(fp8), np.asarray(bf16))


def test_the_wire_carries_e4m3_and_the_gradient_is_the_bf16_gathers():
  mesh, spec = _mesh(), P("expert", "fsdp", None)
  w = _weights(jax.random.PRNGKey(2), (8, 16, 24))
  probe = jax.random.normal(jax.random.PRNGKey(3), (8, 16, 24), jnp.float32)

  def loss(w, *, fp8):
    def local(w_shard, p_shard):
      whole = block._gathered(w_shard, spec, keep="expert", fp8=fp8)
      return jnp.sum(whole.astype(jnp.float32) * p_shard)[None]

    per = jax.shard_map(
      local, mesh=mesh, in_specs=(spec, P("expert")), out_specs=P(("expert", "fsdp")), check_vma=False
    )
    return jnp.sum(per(w, probe))

  text = jax.jit(lambda w: loss(w, fp8=True)).lower(w).as_text()
  assert "all_gather" in text and "f8E4M3FN" in text.split("all_gather", 1)[1].split("\n", 1)[0]
  g_fp8 = jax.jit(jax.grad(lambda w: loss(w, fp8=True)))(w)
  g_bf16 = jax.jit(jax.grad(lambda w: loss(w, fp8=False)))(w)
  np.testing.assert_array_equal(np.asarray(g_fp8, np.float32), np.asarray(g_bf16, np.float32))


@pytest.mark.parametrize(
  ("overrides", "expected"),
  [
    (["moe_gemm_backend=te", "moe_gemm_quantization=fp8"], True),
    (["moe_gemm_backend=te", "moe_gemm_quantization=fp8", "moe_fp8_gather=false"], False),
    ([], False),
  ],
)
def test_the_block_gathers_fp8_only_under_fp8_grouped_gemms(overrides, expected):
  """The seam's settings for the H100 671B recipe: on with TE's FP8 grouped GEMM (by default), else off."""
  from maxtext_moe.config import recipes
  from maxtext_moe.upstream import resolution
  from maxtext_moe.upstream.maxtext import moe_layer

  cfg = resolution.resolve(recipes.recipe_path("h100x8/deepseek3-671b"), overrides)
  settings = moe_layer.settings_from_config(cfg)
  assert settings.fp8_gather is expected


def test_the_step_time_model_moves_fp8_gathered_expert_weights_at_one_byte():
  """The FP8 recipe's FSDP gathers over its 16 nodes: the expert weights at 1 byte a value with the FP8
  gather, 2 without; their gradients' reduce-scatters in bf16 either way."""
  from maxtext_moe.steptime.recipe import for_recipe

  def fsdp(*overrides):
    transfers = for_recipe("h100x8/deepseek3-671b-fp8", list(overrides)).workload.transfers
    return {t.kind: t.wire_bytes for t in transfers if "x16 over 16 NVLink domains" in t.name}

  fp8, bf16 = fsdp(), fsdp("moe_fp8_gather=false")
  assert fp8["reduce-scatter"] == bf16["reduce-scatter"] > 0
  experts = bf16["all-gather"] - fp8["all-gather"]  # what the FP8 gather saves: half the experts' bytes
  assert 0.4 * bf16["all-gather"] < experts < 0.5 * bf16["all-gather"]  # the experts: most of what is gathered
