"""The step-time model's `Workload` of a resolved MaxText config: what one GPU computes and moves per step.

- FLOPs: MaxText's own count (`calculate_tflops_training_per_device`), split into the routed experts'
  grouped GEMMs, the other GEMMs and attention by MaxText's helpers, plus the forward the remat policy
  recomputes (`full`: the whole forward again; `custom`: each tensor set to `remat`).
- Number formats: the dense GEMMs' from MaxText's `quantization` (our block refuses it, so bf16 there),
  the grouped GEMMs' from `te_gmm_quantization` (MaxText's TE block) or `moe_gemm_quantization` (ours).
- Memory-bound ops, per token and layer in the forward (the backward twice that), in activation elements:
  2 norms (read + write D each), 2 residual adds (3 D each), q/k/v/out around RoPE and the attention
  kernel (2 H (2 qk + v)), and for an MoE layer the router (2 E), the permutation and its inverse
  (4 K' D, K' the rows the exchange delivers per token), the gated activation (3 K F) and the shared
  experts' (3 S F); a dense layer's MLP activation 3 F_dense. A count of what the kernels must read and
  write, with nothing fused away beyond that. An FP8 GEMM's input is quantized first (current scaling:
  an amax pass, a read and a one-byte write; MXFP8: a read and row- and column-wise writes).
- FSDP: every parameter leaf is gathered before its use in the forward and again in the backward, over
  the mesh axes that shard it except the experts' axis on its expert dimension and the tensor axes, and
  its gradient reduce-scattered over the same group, both in the compute dtype (as XLA:GPU's compiled
  programs do), then all-reduced over `data`.
- The expert exchange: dispatch and combine per MoE layer in the forward, their transposes in the
  backward, and again in the recomputed forward under `full`; rows per GPU: te_ep and MaxText's TE block
  send a token once per destination rank (`step_time.unique_ranks`), all_to_all its padded receive
  buffer (`moe.settings.received_rows`).
- Host offload: what the remat policy offloads (the planner's `_saved_per_layer`), out in the forward and
  back in the backward, and offloaded optimizer state and parameters, in for the update and back out,
  over the host link.
- Host syncs: our bounded rounds' conditional per MoE layer and pass (`docs/gpu-path.md`), none for te_ep.
"""

import math
from typing import Any

from maxtext_moe.config.layout import mesh_sides
from maxtext_moe.moe.settings import DispatchKind, received_rows, runs_in_rounds
from maxtext_moe.planner.estimate import (
  _moe_rows,
  _saved_per_layer,
  _state_bytes,
  dtype_bytes,
  maxtext_te_block,
  mesh_axes_of,
)
from maxtext_moe.planner.step_time import Transfer, Workload, unique_ranks

KEPT_AXES = ("tensor", "tensor_transpose", "tensor_sequence", "autoregressive", "stage")
_MOE_NAMES = ("moe_mlpwi_0", "moe_mlpwi_1", "moe_mlpwo")
_REMAT_NAMES = (
  "query_proj",
  "key_proj",
  "value_proj",
  "query_wa_proj",
  "kv_wa_proj",
  "out_proj",
  "context",
  "mlpwi_0",
  "mlpwi_1",
  "mlpwo",
  "moe_mlpwi_0",
  "moe_mlpwi_1",
  "moe_mlpwo",
)


def _value(x: Any) -> str:
  """A config value as YAML spells it (MaxText's str-mixin enums print their class name)."""
  return str(getattr(x, "value", x) or "")


def _format(name: Any) -> str:
  name = _value(name).lower()
  if "mxfp8" in name:
    return "mxfp8"
  if "fp8" in name:
    return "fp8"
  return "bf16"


def formats(cfg: Any) -> dict[str, str]:
  te_block = maxtext_te_block(cfg)
  grouped = _format(cfg.te_gmm_quantization) if te_block else _format(cfg.moe_gemm_quantization)
  return {"dense": _format(cfg.quantization), "grouped": grouped, "attention": "bf16"}


def _per_token_forward_flops(cfg: Any) -> dict[str, float]:
  """Forward FLOPs per token of one MoE layer's named tensors (the names of MaxText's custom remat)."""
  emb, heads = int(cfg.emb_dim), int(cfg.num_query_heads)
  k, ffn = int(cfg.num_experts_per_tok), int(cfg.moe_mlp_dim)
  shared = int(cfg.shared_experts or 0)
  seq = int(cfg.max_target_length)
  if str(cfg.attention_type) == "mla":
    nope, rope, v = int(cfg.qk_nope_head_dim), int(cfg.qk_rope_head_dim), int(cfg.v_head_dim)
    q_lora, kv_lora = int(cfg.q_lora_rank), int(cfg.kv_lora_rank)
    out = {
      "query_wa_proj": 2 * emb * q_lora if q_lora else 0,
      "query_proj": 2 * (q_lora or emb) * heads * (nope + rope),
      "kv_wa_proj": 2 * emb * (kv_lora + rope),
      "key_proj": 2 * kv_lora * heads * nope,
      "value_proj": 2 * kv_lora * heads * v,
      "out_proj": 2 * heads * v * emb,
      "context": 2 * seq * heads * (nope + rope + v) / 2,  # causal
    }
  else:
    hd, kv = int(cfg.head_dim), int(cfg.num_kv_heads)
    out = {
      "query_proj": 2 * emb * heads * hd,
      "key_proj": 2 * emb * kv * hd,
      "value_proj": 2 * emb * kv * hd,
      "out_proj": 2 * heads * hd * emb,
      "context": 4 * seq * heads * hd / 2,
    }
  out |= {"moe_mlpwi_0": 2 * emb * ffn * k, "moe_mlpwi_1": 2 * emb * ffn * k, "moe_mlpwo": 2 * ffn * emb * k}
  out |= {"mlpwi_0": 2 * emb * ffn * shared, "mlpwi_1": 2 * emb * ffn * shared, "mlpwo": 2 * ffn * emb * shared}
  return out


def recompute_tflops(cfg: Any, tokens: int, layers: int, moe_layers: int) -> tuple[dict[str, float], str]:
  """({class: TFLOPs the custom remat policy recomputes per step}, how it was counted); `full` is counted
  by the caller (the whole forward again)."""
  policy = str(cfg.remat_policy)
  if policy == "full":
    return {}, "remat_policy full: the whole forward again"
  if policy != "custom":
    return {}, f"remat_policy {policy}: recompute not modelled (counted as none)"
  per_token = _per_token_forward_flops(cfg)
  names = [n for n in _REMAT_NAMES if _value(getattr(cfg, n, "device")) == "remat"]
  out = {"dense": 0.0, "grouped": 0.0, "attention": 0.0}
  for n in names:
    cls = "grouped" if n.startswith("moe_") else "attention" if n == "context" else "dense"
    out[cls] += per_token.get(n, 0) * tokens * (moe_layers if n.startswith(("moe_", "mlp")) else layers) / 1e12
  return out, "remat_policy custom: recomputes " + (", ".join(names) or "nothing")


QUANT_BYTES = {"fp8": 5, "mxfp8": 4, "bf16": 0}  # per element quantized: amax read + read + write; MX: read + 2 writes


def memory_bytes_per_token(cfg: Any, rows_per_token: float, fmts: dict[str, str]) -> tuple[float, float]:
  """(MoE layer, dense layer) forward bytes per token read and written by memory-bound ops (the module
  docstring), plus the quantization of every FP8/MXFP8 GEMM's input (`QUANT_BYTES` per element)."""
  emb, heads = int(cfg.emb_dim), int(cfg.num_query_heads)
  act_b = dtype_bytes(cfg.dtype)
  if str(cfg.attention_type) == "mla":
    qk, v = int(cfg.qk_nope_head_dim) + int(cfg.qk_rope_head_dim), int(cfg.v_head_dim)
    gemm_inputs = 2 * emb + int(cfg.q_lora_rank) + int(cfg.kv_lora_rank) + heads * v
  else:
    qk = v = int(cfg.head_dim)
    gemm_inputs = emb + heads * v
  common = 4 * emb + 6 * emb + 2 * heads * (2 * qk + v)
  k, ffn, shared = int(cfg.num_experts_per_tok), int(cfg.moe_mlp_dim), int(cfg.shared_experts or 0)
  moe = common + 2 * int(cfg.num_experts) + 4 * rows_per_token * emb + 3 * k * ffn + 3 * shared * ffn
  dense_q, grouped_q = QUANT_BYTES[fmts.get("dense", "bf16")], QUANT_BYTES[fmts.get("grouped", "bf16")]
  moe_quant = dense_q * (gemm_inputs + shared * (emb + ffn)) + grouped_q * k * (emb + ffn)
  dense_quant = dense_q * (gemm_inputs + emb + int(cfg.mlp_dim))
  return moe * act_b + moe_quant, (common + 3 * int(cfg.mlp_dim)) * act_b + dense_quant


def _gather_groups(cfg: Any, leaves: list, rules: list, sides: dict[str, tuple[int, int]]) -> list[tuple]:
  """(gathered bytes per GPU, group size, NVLink domains spanned, shard bytes per GPU) per leaf gathered."""
  # XLA:GPU gathers the weights after their cast to the compute dtype (seen in the gb300x1024 compile:
  # float32 weights, bfloat16 all-gathers), and reduce-scatters their gradients in it too.
  w_b = min(dtype_bytes(cfg.weight_dtype), dtype_bytes(cfg.dtype))
  out = []
  for path, shape, names in leaves:
    if path[0] != "params":
      continue
    gathered = kept = 1
    domains = 1
    total = math.prod(shape)
    for name, axes in zip(names, mesh_axes_of(names, rules), strict=True):
      for axis in axes:
        ici, dcn = sides.get(axis, (1, 1))
        if axis in KEPT_AXES or (axis == "expert" and name and "exp" in str(name)):
          kept *= ici * dcn
        else:
          gathered *= ici * dcn
          domains *= dcn
    if gathered > 1:
      out.append((total * w_b / kept, gathered, domains, total * w_b / kept / gathered))
  return out


def workload(cfg: Any, leaves: list, *, num_devices: int, dispatch: str, label: str) -> Workload:
  """The `Workload` of one GPU of `cfg`'s training step on `num_devices` GPUs."""
  from maxtext_moe.upstream.compile import (  # pylint: disable=import-outside-toplevel
    expert_tflops_per_device,
    train_tflops_per_device,
  )

  total, weights, attention = train_tflops_per_device(cfg)
  routed, shared = expert_tflops_per_device(cfg)
  tokens = int(float(cfg.per_device_batch_size) * int(cfg.max_target_length)) * int(cfg.gradient_accumulation_steps)
  layers = int(cfg.num_decoder_layers) + int(getattr(cfg, "mtp_num_layers", 0) or 0)
  moe_layers = layers - (int(cfg.first_num_dense_layers) if _value(cfg.decoder_block) == "deepseek" else 0)
  if int(cfg.num_experts) <= 1:
    moe_layers = 0
  recompute, recompute_note = recompute_tflops(cfg, tokens, layers, moe_layers)
  full = str(cfg.remat_policy) == "full"
  te_block = maxtext_te_block(cfg)
  # The experts' forward runs again in the backward when the policy keeps none of its own outputs: always
  # for MaxText's TE block (TE's fused moe() keeps residuals of its own, which a policy recomputes), and
  # for ours when a custom policy rematerializes every one of its tensors.
  moe_rerun = not full and (te_block or all(_value(getattr(cfg, n, "remat")) == "remat" for n in _MOE_NAMES))
  moe_rerun = moe_rerun and str(cfg.remat_policy) == "custom" and moe_layers > 0
  if moe_rerun:
    recompute["grouped"] = routed / 3
    recompute_note += "; the experts' forward (and its exchange)"
  scale = 4 / 3 if full else 1  # the forward is a third of the training FLOPs
  model = {"dense": weights - routed, "grouped": routed, "attention": attention}
  flops = {cls: (tf * scale + recompute.get(cls, 0.0)) * 1e12 for cls, tf in model.items()}

  sides = mesh_sides(cfg, num_devices)
  transfers: list[Transfer] = []
  rules = [(n, tuple(a) if isinstance(a, list) else a) for n, a in cfg.logical_axis_rules]
  groups = _gather_groups(cfg, leaves, rules, sides)
  g_b = 1.0  # gradients reduce-scattered in the compute dtype, as the weights were gathered
  by_group: dict[tuple[int, int], list[float]] = {}
  for gathered, group, domains, _ in groups:
    row = by_group.setdefault((group, domains), [0.0, 0.0])
    row[0] += gathered
    row[1] += 1
  for (group, domains), (nbytes, n) in sorted(by_group.items()):
    where = f"x{group}" + (f" over {domains} NVLink domains" if domains > 1 else "")
    transfers.append(
      Transfer(f"FSDP weight all-gathers {where}", "all-gather", 2 * nbytes, group, domains, True, 2 * n)
    )
    transfers.append(
      Transfer(f"gradient reduce-scatters {where}", "reduce-scatter", nbytes * g_b, group, domains, True, n)
    )
  data_ici, data_dcn = sides.get("data", (1, 1))
  if data_ici * data_dcn > 1:
    shard = sum(s for *_, s in groups) * g_b or sum(math.prod(sh) for p, sh, _ in leaves if p[0] == "params") * 4
    transfers.append(
      Transfer(
        f"gradient all-reduce x{data_ici * data_dcn} (data)", "all-reduce", shard, data_ici * data_dcn, data_dcn, True
      )
    )

  ep_ici, ep_dcn = sides.get("expert", (1, 1))
  ep = ep_ici * ep_dcn
  kind = DispatchKind.TE_EP if te_block else DispatchKind(dispatch)
  k, experts = int(cfg.num_experts_per_tok), int(cfg.num_experts)
  rows_per_token = float(k)
  host_syncs = 0.0
  if moe_layers and ep > 1:
    if kind == DispatchKind.TE_EP:
      rows = tokens * unique_ranks(experts, k, ep)
    else:
      kw = {"num_ranks": ep, "capacity_factor": float(cfg.moe_capacity_factor), "buffers": cfg.moe_buffers}
      kw |= {"buffer_factor": float(cfg.moe_buffer_factor), "num_experts": experts}
      rows = received_rows(kind, tokens, k, **kw)
      if runs_in_rounds(kind, cfg.moe_buffers):
        host_syncs = moe_layers * (3 if full or moe_rerun else 2)
    passes = 6 if full or moe_rerun else 4  # dispatch + combine, forward, backward (and a recomputed forward)
    act_b = dtype_bytes(cfg.dtype)
    transfers.append(
      Transfer(
        f"expert dispatch/combine ({kind.value}) x{ep}",
        "all-to-all",
        rows * int(cfg.emb_dim) * act_b * passes * moe_layers,
        ep,
        ep_dcn,
        False,
        passes * moe_layers,
      )
    )
    rows_per_token = rows / tokens
  act_b = dtype_bytes(cfg.dtype)
  buffer_rows, _ = _moe_rows(cfg, tokens, ep, kind.value) if moe_layers else (0, 0)
  _, host_per_layer = _saved_per_layer(cfg, tokens, act_b, buffer_rows)
  if host_per_layer:
    transfers.append(
      Transfer("host offload copies", "host", 2 * host_per_layer * moe_layers, 1, 1, True, 2 * moe_layers)
    )
  params_b, opt_b, _, _ = _state_bytes(cfg, leaves, rules, {a: i * d for a, (i, d) in sides.items()})
  state_on_host = (opt_b + params_b if cfg.optimizer_memory_host_offload else 0) + (
    params_b if cfg.parameter_memory_host_offload else 0
  )
  if state_on_host:  # brought in for the update and written back, once per step
    transfers.append(Transfer("optimizer/parameter offload copies", "host", 2 * state_on_host, 1, 1, True, 2))
  moe_bytes, dense_bytes = memory_bytes_per_token(cfg, rows_per_token, formats(cfg))
  passes = 4 if full else 3  # forward, backward (2x), the recomputed forward
  memory = passes * tokens * (moe_bytes * moe_layers + dense_bytes * (layers - moe_layers))
  return Workload(
    label=label,
    tokens=tokens,
    model_tflops=total,
    flops=flops,
    formats=formats(cfg),
    memory_bytes=memory,
    transfers=transfers,
    hideable_flops=shared * (4 / 3 if full else 1) * 1e12,
    host_syncs=host_syncs,
    sources={
      "FLOPs": f"MaxText's count ({total:,.0f} TFLOP) + recompute ({recompute_note}: "
      f"{sum(flops.values()) / 1e12 - total:,.0f} TFLOP)",
      "collectives": "analytic, from the parameter tree's shardings and the MoE settings",
    },
  )


def with_compiled(w: Workload, report: dict[str, Any], sides: dict[str, tuple[int, int]] | None = None) -> Workload:
  """`w` with its FSDP/gradient collectives and host syncs replaced by those of `compile`'s report of the
  XLA:GPU program (`compile --json`, or `compile.json` from `--hlo DIR`). The expert exchange stays
  analytic: without TE the compile runs all_to_all (or its bounded rounds) where the container runs TE's
  NCCL EP."""
  kept = [t for t in w.transfers if t.kind in ("all-to-all", "host", "p2p")]
  devices = int(report["devices"])
  partitions = max(int(report.get("partitions", 1)), 1)
  per_domain = max(devices // partitions, 1)
  for key, row in sorted(report["collectives"].items()):
    if row["kind"] in ("all-to-all", "ragged-all-to-all", "collective-permute") or "(in a branch)" in key:
      continue
    group = int(row["group_size"])
    named = [a for a in row.get("axes", ()) if sides and a in sides]
    if named and len(named) == len(row.get("axes", ())):  # the mesh axes it spans: their DCN degrees
      domains = math.prod(sides[a][1] for a in named)
    else:  # groups by device id: consecutive devices fill a domain first
      domains = max(1, -(-group // per_domain)) if group > per_domain else 1
    nbytes = float(row["bytes"]) * (group if row["kind"] == "reduce-scatter" else 1)  # the report counts results
    kept.append(Transfer(f"XLA:GPU {key}", row["kind"], nbytes, group, domains, True, float(row["count"])))
  sources = dict(w.sources)
  sources["collectives"] = (
    "XLA:GPU's compiled program (all-gathers, reduce-scatters, all-reduces, host syncs); the expert exchange analytic"
  )
  return Workload(
    **{f: getattr(w, f) for f in ("label", "tokens", "model_tflops", "flops", "formats", "memory_bytes")},
    transfers=kept,
    hideable_flops=w.hideable_flops,
    host_syncs=float(report.get("host_syncs_per_step", w.host_syncs)),
    pipeline=w.pipeline,
    sources=sources,
  )


def predict_config(ctx: Any, cfg: Any, label: str, compiled: dict | None = None) -> Any:
  """The `Prediction` of a resolved GPU config (`ctx`: the planner's `memory_plan._context` of its recipe)."""
  from maxtext_moe.config.hardware import gpu as gpu_model  # pylint: disable=import-outside-toplevel
  from maxtext_moe.errors import UserError  # pylint: disable=import-outside-toplevel
  from maxtext_moe.moe.settings import resolve_dispatch  # pylint: disable=import-outside-toplevel
  from maxtext_moe.planner.step_time import predict  # pylint: disable=import-outside-toplevel

  model = gpu_model(cfg.recipe_hardware)
  if model is None:
    raise UserError("plan --time models a GPU step; this recipe runs on CPU (pick a GPU recipe: 'maxtext-moe recipes')")
  ep = mesh_sides(cfg, ctx.num_devices).get("expert", (1, 1))
  kind = resolve_dispatch(
    cfg.moe_dispatch, ep=ep[0] * ep[1], platform=ctx.platform, capacity_factor=float(cfg.moe_capacity_factor)
  ).value
  w = workload(cfg, ctx.leaves, num_devices=ctx.num_devices, dispatch=kind, label=label)
  if compiled is not None:
    if int(compiled.get("devices", -1)) != ctx.num_devices or compiled.get("gpu") != str(cfg.recipe_hardware):
      raise UserError(
        f"the compile report is for {compiled.get('devices')} x {compiled.get('gpu')}, the plan for "
        f"{ctx.num_devices} x {cfg.recipe_hardware}: compile the same recipe and overrides"
      )
    w = with_compiled(w, compiled, mesh_sides(cfg, ctx.num_devices))
  return predict(w, model)


def for_recipe(recipe: str, overrides: list[str], *, gpus: int | None = None, compiled: dict | None = None) -> Any:
  """The step-time `Prediction` of `recipe` + overrides on its GPUs (from `compile`'s report when given)."""
  from maxtext_moe.planner import divisibility  # pylint: disable=import-outside-toplevel
  from maxtext_moe.planner.memory_plan import _context  # pylint: disable=import-outside-toplevel

  ctx, cfg = _context(recipe, overrides, gpus, None)
  divisibility.check(cfg, ctx.leaves, ctx.num_devices)  # a layout that cannot be built has no step time
  return predict_config(ctx, cfg, f"{recipe} on {ctx.num_devices} GPUs", compiled)
