"""What Qwen3-MoE and Mixtral share: Llama-style grouped-query attention with rotate-half RoPE, RMSNorm
before attention and before the MoE block, every layer MoE, one stack `decoder/layers`, untied embeddings.

MaxText side (maxtext 0.2.5, `upstream.maxtext.model.param_leaves` of the qwen3_moe and mixtral decoders): the
query kernel is [embed, q_heads, head_dim] and the output kernel [q_heads, head_dim, embed], per layer;
Hugging Face stores [q_heads * head_dim, embed] and [embed, q_heads * head_dim].
"""

from typing import Any

from maxtext_moe.checkpoint.families.base import (
  Family,
  Field,
  Table,
  check_required,
  plain_rope,
  transformers_config,
  value_of,
)
from maxtext_moe.errors import UserError

GLOBAL: Table = {
  ("token_embedder", "embedding"): ("model.embed_tokens.weight", False, 0),
  ("decoder", "decoder_norm", "scale"): ("model.norm.weight", False, 0),
  ("decoder", "logits_dense", "kernel"): ("lm_head.weight", True, 1),
}
ATTENTION: Table = {
  ("pre_self_attention_layer_norm", "scale"): ("input_layernorm.weight", False, 0),
  ("post_self_attention_layer_norm", "scale"): ("post_attention_layernorm.weight", False, 0),
  ("self_attention", "query", "kernel"): ("self_attn.q_proj.weight", True, 1),
  ("self_attention", "key", "kernel"): ("self_attn.k_proj.weight", True, 1),
  ("self_attention", "value", "kernel"): ("self_attn.v_proj.weight", True, 1),
  ("self_attention", "out", "kernel"): ("self_attn.o_proj.weight", True, 2),
}
# (MaxText key, config.json field) every GQA family has.
SIZES = (
  ("base_emb_dim", "hidden_size"),
  ("base_num_decoder_layers", "num_hidden_layers"),
  ("base_num_query_heads", "num_attention_heads"),
  ("base_num_kv_heads", "num_key_value_heads"),
  ("vocab_size", "vocab_size"),
  ("normalization_layer_epsilon", "rms_norm_eps"),
  ("num_experts_per_tok", "num_experts_per_tok"),
  ("max_position_embeddings", "max_position_embeddings"),
)


def one_stack(cfg: Any) -> dict[tuple[str, ...], int]:
  return {("decoder", "layers"): 0}


def head_dim(cfg: Any) -> int:
  """transformers' rule for both families: config.head_dim, else hidden_size / heads."""
  return int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)


def fields(raw: dict, family: Family, *, required: dict[str, Any], extra: list[tuple[str, str]]) -> list[Field]:
  """config.json read by the family's transformers class: model_name, the shared sizes, head_dim, `extra`
  (MaxText key, config.json field) and plain RoPE; or one UserError naming every field MaxText cannot
  represent."""
  cfg = transformers_config(raw, family)
  problems: list[str] = []
  check_required(raw, cfg, required, family, problems)
  if raw.get("quantization_config"):
    problems.append("quantization_config (the converter reads BF16 and F32 checkpoints of this family)")
  out = [Field("model_name", family.model_name, "architectures", raw.get("architectures"))]
  out += [Field(ours, getattr(cfg, hf), hf, getattr(cfg, hf)) for ours, hf in (*SIZES, *extra)]
  out.append(Field("head_dim", head_dim(cfg), "head_dim", getattr(cfg, "head_dim", None)))
  out += plain_rope(cfg, family, problems)
  if problems:
    raise UserError(f"config.json has fields MaxText cannot represent: {'; '.join(problems)}")
  return out


def to_hf(cfg: Any, out: dict, sizes: tuple[tuple[str, str], ...]) -> dict:
  """The architecture fields both families write from a resolved config (sizes without `base_` read
  straight from it)."""
  out |= {hf: value_of(getattr(cfg, ours)) for ours, hf in sizes if not ours.startswith("base_")}
  out |= {
    "hidden_size": int(cfg.emb_dim),
    "num_hidden_layers": int(cfg.num_decoder_layers),
    "num_attention_heads": int(cfg.num_query_heads),
    "num_key_value_heads": int(cfg.num_kv_heads),
  }
  if "head_dim" in out or int(cfg.head_dim) * int(cfg.num_query_heads) != int(cfg.emb_dim):
    out["head_dim"] = int(cfg.head_dim)  # else transformers' own rule (hidden / heads) gives it
  return out
