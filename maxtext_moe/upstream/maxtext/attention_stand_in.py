"""MaxText's `cudnn_flash_jax` attention with MLA's value head padded to the query's: the stand-in `compile`
uses for TE's cuDNN attention under pipeline stages (`gpu_compile.stand_ins.STAGED_MLA`).

JAX's cuDNN attention cannot be vmapped when the value's head dimension differs from the query's and the key's
(its batching rule reshapes the value by the key's shape), and MaxText's pipeline vmaps each stage's layers;
DeepSeek's MLA has queries and keys of 192 and values of 128. Padded with zeros to 192, the value vmaps, and
the output's first 128 columns are exactly the unpadded attention's (each output column is the softmax
weights times that column of the value; the zero columns give zeros, sliced off). So the program keeps cuDNN's
flash attention (no L x L scores) in every layer, at 1.5x the value's and the output's bytes inside the call.
Before this the stand-in was `dot_product`, whose scores made a staged DeepSeek-V3 program 112 GiB per GPU
larger than any real run holds.
"""

from typing import Any

import jax.numpy as jnp
from maxtext.layers import attention_op

from maxtext_moe.upstream.patches import Patch, original


def value_padded_cudnn_attention(
  self, query, key, value, decoder_segment_ids, model_mode=attention_op.MODEL_MODE_TRAIN
):
  """`AttentionOp.cudnn_jax_flash_attention` with the value's head padded to the query's, the output sliced
  back; unchanged where the two heads are equal."""
  attend: Any = original(attention_op.AttentionOp, "cudnn_jax_flash_attention")
  pad = query.shape[-1] - value.shape[-1]
  if pad <= 0:
    return attend(self, query, key, value, decoder_segment_ids, model_mode)
  value = jnp.pad(value, [(0, 0)] * (value.ndim - 1) + [(0, pad)])
  out, lse = attend(self, query, key, value, decoder_segment_ids, model_mode)
  return out[..., : out.shape[-1] - pad], lse


def patches() -> list[Patch]:
  return [Patch(attention_op.AttentionOp, "cudnn_jax_flash_attention", value_padded_cudnn_attention)]
