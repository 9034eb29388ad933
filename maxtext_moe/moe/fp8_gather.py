"""Expert weights gathered in FP8 for Transformer Engine's FP8 grouped GEMM: the FSDP gathers in 1 byte a
value instead of 2, the GEMM's inputs unchanged.

With `moe_gemm_quantization: fp8` TE quantizes each expert's kernel itself (`grouped_dense` ->
`grouped_quantize`, current scaling: one scale per expert, 448 / amax of its bf16 values, TE's
`compute_scale_from_amax` with no margin, 1 where amax is 0 or not finite) after the block has gathered the
kernel in bf16. Here the block quantizes each shard with that same scale (each expert's amax over its
shards: a max-reduction of a few floats per expert), gathers the e4m3 codes and the scales, and hands TE
the codes dequantized to bf16. TE's quantization of that tensor finds the same amax (448 / scale is the
amax, a bf16 value) and so the same scale, and recovers the same codes: a code times 1 / scale rounded to
bf16 is off by at most 2^-9 of itself, well inside half of e4m3's spacing (2^-4 of a normal value; 2^-10
absolute below it), so the cast back to e4m3 rounds to the code again. TE's GEMM then computes exactly
what it computes from the bf16 gather. tests/test_fp8_gather.py checks this against the same scaling
written out in JAX.

The gradient is the bf16 gather's: the cotangent reduce-scattered over the same axes (a straight-through
estimate, as TE's own FP8 GEMM treats its quantization). Megatron-Core gathers FP8 parameters for the same
reason (`--fp8-param-gather`); there the FP8 copy is kept, here it is made per gather from the bf16 shard.

Shape legend: E experts (local), D in dim, F out dim.
"""

import functools

import jax
import jax.numpy as jnp

from maxtext_moe.moe.collectives import all_gather_dims

E4M3 = jnp.float8_e4m3fn
FP8_MAX = float(jnp.finfo(E4M3).max)  # 448


def te_scale(amax_E: jax.Array) -> jax.Array:
  """TE's current-scaling factor per expert: 448 / amax, 1 where amax is 0 or not finite."""
  amax_E = amax_E.astype(jnp.float32)
  return jnp.where((amax_E > 0) & jnp.isfinite(amax_E), FP8_MAX / amax_E, 1.0)


def quantize(w_EDF: jax.Array, scale_E: jax.Array) -> jax.Array:
  """e4m3 codes of `w_EDF` at its experts' scales, as TE casts them (the product in float32)."""
  return (w_EDF.astype(jnp.float32) * scale_E[:, None, None]).astype(E4M3)


def dequantize(q_EDF: jax.Array, scale_E: jax.Array, dtype) -> jax.Array:
  return (q_EDF.astype(jnp.float32) / scale_E[:, None, None]).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def gathered(w_EDF: jax.Array, gathers: tuple[tuple[int, tuple[str, ...]], ...]) -> jax.Array:
  """The whole weight from its shard (inside shard_map), each (dim, mesh axes) of `gathers` all-gathered in
  turn, moved as e4m3 codes with TE's scale per expert; returned in `w_EDF`'s dtype."""
  return _forward(w_EDF, gathers)


def _forward(w_EDF, gathers):
  amax_E = jnp.max(jnp.abs(w_EDF.astype(jnp.float32)), axis=(1, 2))
  for dim, axes in gathers:  # an expert's amax over the shards that split its values
    if dim != 0:
      amax_E = jax.lax.pmax(amax_E, axes)
  scale_E = te_scale(amax_E)
  q_EDF = all_gather_dims(quantize(w_EDF, scale_E), gathers)
  scale_E = all_gather_dims(scale_E, tuple(g for g in gathers if g[0] == 0))  # experts split over more axes
  return dequantize(q_EDF, scale_E, w_EDF.dtype)


def _fwd(w_EDF, gathers):
  return _forward(w_EDF, gathers), w_EDF


def _bwd(gathers, w_EDF, g_EDF):
  _, vjp = jax.vjp(lambda w: all_gather_dims(w, gathers), w_EDF)
  return vjp(g_EDF.astype(w_EDF.dtype))


gathered.defvjp(_fwd, _bwd)
