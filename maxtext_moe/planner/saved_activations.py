"""What the remat policy keeps for the backward, per device: the saved-activations term of the memory
model (`estimate.py`), from the resolved config. Under `full` each layer keeps its input; under `custom`
each tensor MaxText names that a layer's backward needs, where the config puts it (device or host)."""

from typing import Any

from maxtext_moe.moe.layout import layer_counts, value_of


def _named_activations(cfg: Any, tokens: int, rows: int, *, dense: bool) -> dict[str, int]:
  """Elements per layer of each tensor MaxText names for its custom remat policy that the layer's backward
  needs (so a policy can keep it): the layer input, attention's projections (MLA's low-rank ones too) and
  output, the MLP's gated inputs (a dense layer's MLP, or a MoE layer's shared experts) and, in a MoE layer,
  our block's grouped-GEMM outputs. Not `mlpwo`: the MLP's output only joins the residual stream, whose sum
  is the next layer's input, so no backward keeps it (XLA:GPU's programs hold two [T, D] tensors per layer
  with `decoder_layer_input`, `out_proj` and `mlpwo` all on the device)."""
  emb, heads, kv_heads = int(cfg.emb_dim), int(cfg.num_query_heads), int(cfg.num_kv_heads)
  mla = value_of(cfg.attention_type) == "mla"
  if mla:
    qk = int(cfg.qk_nope_head_dim) + int(cfg.qk_rope_head_dim)
    v, kv_heads = int(cfg.v_head_dim), heads
  else:
    qk = v = int(cfg.head_dim)
  hidden = int(cfg.mlp_dim) if dense else int(getattr(cfg, "shared_experts", 0) or 0) * int(cfg.moe_mlp_dim)
  sizes = {
    "decoder_layer_input": tokens * emb,
    "out_proj": tokens * emb,
    "context": tokens * heads * v,
    "query_proj": tokens * heads * qk,
    "key_proj": tokens * kv_heads * qk,
    "value_proj": tokens * kv_heads * v,
    "mlpwi_0": tokens * hidden,
    "mlpwi_1": tokens * hidden,
  }
  if value_of(getattr(cfg, "context", "remat")) == "remat":
    sizes["attention_out"] = tokens * heads * v  # the attention op's output under its other name
  if mla:
    q_lora, kv_lora = int(cfg.q_lora_rank), int(cfg.kv_lora_rank)
    if q_lora > 0:
      sizes |= {"query_wa_proj": tokens * q_lora, "mla_q": tokens * q_lora}
    sizes |= {"kv_wa_proj": tokens * (kv_lora + int(cfg.qk_rope_head_dim)), "mla_kv": tokens * kv_lora}
  elif bool(getattr(cfg, "fused_qkv", False)):
    sizes["qkv_proj"] = tokens * (heads + 2 * kv_heads) * qk
  if not dense:
    ffn = int(cfg.moe_mlp_dim)
    sizes |= {"moe_mlpwi_0": rows * ffn, "moe_mlpwi_1": rows * ffn, "moe_mlpwo": rows * emb}
  return sizes


def per_layer(
  cfg: Any, tokens: int, d_bytes: int, rows: int, *, recomputed: bool, dense: bool = False
) -> tuple[int, int]:
  """(device, host) bytes the remat policy keeps per layer (MoE, or `dense`) for the backward: under
  `custom`, each named tensor (`_named_activations`) where the config puts it. The experts' outputs are
  `recomputed` under TE's fused block and under the bounded rounds (`estimate.experts_recomputed`),
  whatever the policy names."""
  if value_of(cfg.remat_policy) != "custom":  # full, and policies not modelled: the layer input, which all keep
    return tokens * int(cfg.emb_dim) * d_bytes, 0
  sizes = _named_activations(cfg, tokens, rows, dense=dense)
  if recomputed:
    sizes = {k: v for k, v in sizes.items() if not k.startswith("moe_")}
  device = host = 0
  for name, elems in sizes.items():
    where = value_of(getattr(cfg, name, "remat"))  # MaxText's RematLocation
    if name == "decoder_layer_input" and where == "remat":
      where = "device"  # the scan carry is kept regardless
    if where == "device":
      device += elems * d_bytes
    elif where == "offload":
      host += elems * d_bytes
  return device, host


def attention_saved(cfg: Any) -> bool:
  """Whether the remat policy keeps attention's projections and output for its backward (counted in the
  saved activations), so that a layer's backward does not hold them again (Mixtral's and Qwen3's custom
  recipes: their programs hold none at the experts' backward)."""
  if value_of(cfg.remat_policy) != "custom":
    return False
  names = ("query_proj", "key_proj", "value_proj", "context")
  return all(value_of(getattr(cfg, n, "remat")) in ("device", "offload") for n in names)


def gated_pair_kept(cfg: Any) -> bool:
  """Whether the remat policy keeps the experts' gated pair (`moe_mlpwi_0/1`) on the device or the host."""
  kept = ("device", "offload")
  return value_of(cfg.remat_policy) == "custom" and value_of(getattr(cfg, "moe_mlpwi_0", "remat")) in kept


def total(
  cfg: Any, tokens: int, d_bytes: int, rows: int, *, recomputed: bool, layers: tuple[int, int] | None = None
) -> tuple[int, int]:
  """(device, host) bytes over every layer (or the (dense, MoE) `layers` given: those outside pipeline
  stages): the dense layers and the MoE ones (each MTP layer one) apart. A scan of one layer keeps its
  offloaded tensors on the device: XLA:GPU removes the offload of a loop of a single trip (the suite's
  compiled proxy, one dense layer, moves only its MoE layers' tensors)."""
  dense_layers, moe_layers = layer_counts(cfg) if layers is None else layers
  device = host = 0
  for layers, dense in ((moe_layers, False), (dense_layers, True)):
    on_device, offloaded = per_layer(cfg, tokens, d_bytes, rows, recomputed=recomputed, dense=dense)
    if layers == 1 and bool(getattr(cfg, "scan_layers", True)):
      on_device, offloaded = on_device + offloaded, 0
    device, host = device + on_device * layers, host + offloaded * layers
  return device, host
