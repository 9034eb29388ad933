"""The epsilon of MLA's low-rank norms, settable apart from the layer norms' (`mla_norm_epsilon`).

transformers' DeepseekV3 (as DeepSeek's reference code) builds `q_a_layernorm` and `kv_a_layernorm` with
a fixed eps of 1e-6, whatever `rms_norm_eps` says; MaxText's MLA gives its `q_norm` and `kv_norm` the
config's `normalization_layer_epsilon`. For a checkpoint with rms_norm_eps 1e-5 (Moonlight) that moved
the tiny Moonlight fixture's logits by 2e-4 from transformers'. This patch sets the two norms' epsilon
after MaxText builds them, when `mla_norm_epsilon` > 0 (converted models set 1e-6).
"""

from maxtext.layers import attention_mla

from maxtext_moe.upstream.patches import Patch, original


def _init_projections(self, inputs_q_shape, inputs_kv_shape):
  original(attention_mla.MLA, "_init_projections")(self, inputs_q_shape, inputs_kv_shape)
  epsilon = float(getattr(self.config, "mla_norm_epsilon", 0.0) or 0.0)
  if epsilon > 0:
    for name in ("q_norm", "kv_norm"):
      norm = getattr(self, name, None)
      if norm is not None:
        norm.epsilon = epsilon


def patches() -> list[Patch]:
  return [Patch(attention_mla.MLA, "_init_projections", _init_projections)]
