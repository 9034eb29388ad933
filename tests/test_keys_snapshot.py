"""A new plugin key must be added here on purpose (STYLE.md: a new knob is always deliberate)."""

from maxtext_moe.config.keys import PLUGIN_KEY_NAMES, PluginKeys

SNAPSHOT = (
  "recipe_hardware",
  "recipe_num_devices",
  "nodes",
  "gpus_per_node",
  "moe_impl",
  "moe_dispatch",
  "moe_gemm_backend",
  "moe_gemm_quantization",
  "moe_capacity_factor",
  "moe_buffers",
  "moe_buffer_factor",
  "moe_exchange_chunks",
  "moe_allow_drops",
  "progress",
  "metrics_jsonl",
  "loss_plot",
  "offload",
  "flag_profile",
  "xla_flags_extra",
  "env_extra",
  "model_file",
  "mla_norm_epsilon",
  "on_nonfinite_loss",
  "max_nonfinite_skips",
  "checkpoint_integrity",
  "run_lock_wait_s",
  "vocab_from_tokenizer",
  "checkpoint_fallback",
  "fault_nan_loss_steps",
  "moe_load_every",
  "sft_overlength",
  "finetune",
)


def test_plugin_keys_snapshot():
  assert PLUGIN_KEY_NAMES == SNAPSHOT


def test_every_plugin_key_is_documented():
  undocumented = [n for n, f in PluginKeys.model_fields.items() if not (f.description or "").strip()]
  assert undocumented == []


def test_plugin_keys_do_not_shadow_maxtext_keys(resolution):
  from maxtext.configs.types import MaxTextConfig  # the test may look at MaxText directly

  assert set(PLUGIN_KEY_NAMES).isdisjoint(MaxTextConfig.model_fields)
