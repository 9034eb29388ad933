"""MixtralForCausalLM (Mixtral-8x7B, Mixtral-8x22B) <-> MaxText's mixtral decoder.

Computation, as transformers 5.24 and MaxText 0.2.5 have it: GQA with rotate-half RoPE, every layer MoE
(`block_sparse_moe`: experts w1 = gate, w3 = up, w2 = down) with softmax routing over all experts, top-k
and the top-k weights renormalised (MaxText: softmax over the top-k logits, the same numbers).

MaxText's mixtral attention applies no 1/sqrt(head_dim) softmax scale: it is folded into the query
kernel, as MaxText's own converter does (checkpoint_conversion/utils/param_mapping.py, Mixtral's query
hook). So the query kernel is HF's q_proj x 1/sqrt(head_dim), computed in float32 and rounded once to the
output dtype; the export divides it back. In a bfloat16 checkpoint that rounding is the one change a round
trip makes (at most one bf16 step in q_proj); in a float32 one the round trip is bit-exact.

Refused: sliding-window attention (Mixtral-8x7B-v0.1 has none), RoPE scaling.
"""

import math
from typing import Any

from maxtext_moe.checkpoint.families import gqa
from maxtext_moe.checkpoint.families.base import Family, Field, write_plain_rope

FROM_HF = "mixtral-from-hf"
STRUCTURE = {
  "decoder_block": "mixtral",
  "mlp_activations": ["silu", "linear"],
  "logits_via_embedding": False,
}
REQUIRED = {"hidden_act": "silu", "tie_word_embeddings": False, "sliding_window": None}
EXTRA = [
  ("num_experts", "num_local_experts"),
  ("base_mlp_dim", "intermediate_size"),
  ("base_moe_mlp_dim", "intermediate_size"),
]
LAYER = {
  **gqa.ATTENTION,
  ("MoeBlock_0", "gate", "kernel"): ("block_sparse_moe.gate.weight", True, 1),
  ("MoeBlock_0", "wi_0"): ("block_sparse_moe.experts.{e}.w1.weight", True, 1),
  ("MoeBlock_0", "wi_1"): ("block_sparse_moe.experts.{e}.w3.weight", True, 1),
  ("MoeBlock_0", "wo"): ("block_sparse_moe.experts.{e}.w2.weight", True, 1),
}


def _fields(raw: dict) -> list[Field]:
  return gqa.fields(raw, FAMILY, required=REQUIRED, extra=EXTRA)


def _to_hf(cfg: Any, out: dict, source: dict | None) -> dict:
  gqa.to_hf(cfg, out, (*gqa.SIZES, ("num_experts", "num_local_experts")))
  out["intermediate_size"] = int(cfg.moe_mlp_dim)
  out |= REQUIRED
  write_plain_rope(out, cfg, source)
  return out


def _query_scale(cfg: Any) -> float:
  return 1.0 / math.sqrt(int(cfg.head_dim))


FAMILY = Family(
  architecture="MixtralForCausalLM",
  model_type="mixtral",
  config_class="MixtralConfig",
  model_name=FROM_HF,
  decoder_block="mixtral",
  structure=STRUCTURE,
  fields=_fields,
  to_hf=_to_hf,
  global_table=gqa.GLOBAL,
  layer_table=LAYER,
  stacks=gqa.one_stack,
  scales={("self_attention", "query", "kernel"): _query_scale},
)
