"""A new plugin key must be added here on purpose (STYLE.md: a new knob is always deliberate)."""

import io

from maxtext_moe.cli import build_parser
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
  "moe_fp8_gather",
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


# What `maxtext-moe config --keys` prints as each key's default, as a user writes it in key=value: the list
# keys printed PydanticUndefined (their default_factory), offload's None "unset" (MaxText's own keys decide).
DEFAULTS = {
  "recipe_hardware": "cpu",
  "recipe_num_devices": "-1",
  "nodes": "-1",
  "gpus_per_node": "0",
  "moe_impl": "dropless",
  "moe_dispatch": "auto",
  "moe_gemm_backend": "auto",
  "moe_gemm_quantization": "none",
  "moe_capacity_factor": "0.0",
  "moe_buffers": "bounded",
  "moe_buffer_factor": "1.5",
  "moe_exchange_chunks": "0",
  "moe_fp8_gather": "true",
  "moe_allow_drops": "false",
  "progress": "auto",
  "metrics_jsonl": "metrics.jsonl",
  "loss_plot": "loss.png",
  "offload": "unset",
  "flag_profile": "auto",
  "xla_flags_extra": "[]",
  "env_extra": "[]",
  "model_file": "''",
  "mla_norm_epsilon": "0.0",
  "on_nonfinite_loss": "stop",
  "max_nonfinite_skips": "3",
  "checkpoint_integrity": "sizes",
  "run_lock_wait_s": "0.0",
  "vocab_from_tokenizer": "false",
  "checkpoint_fallback": "true",
  "fault_nan_loss_steps": "[]",
  "moe_load_every": "10",
  "sft_overlength": "truncate",
  "finetune": "false",
}


def test_config_keys_prints_every_default_as_a_value():
  out = io.StringIO()
  ns = build_parser().parse_args(["config", "--keys"])
  assert ns.func(ns, out) == 0
  fields = PluginKeys.model_fields
  assert out.getvalue() == "".join(f"{n} (default {DEFAULTS[n]}): {fields[n].description}\n" for n in SNAPSHOT)
