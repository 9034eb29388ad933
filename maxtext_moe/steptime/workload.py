"""The step-time model's `Workload` of a resolved MaxText config: what one GPU computes and moves per step.

- FLOPs: MaxText's own count (`calculate_tflops_training_per_device`), split into the routed experts'
  grouped GEMMs, the other GEMMs and attention by MaxText's helpers, plus the forward the remat policy
  recomputes (`full`: the whole forward again; `custom`: each tensor set to `remat`; vocab tiling: the head).
- Number formats: the dense GEMMs' from MaxText's `quantization` (the unembedding, and the router under our
  block, stay bf16: with FP8 dense GEMMs their own class, `head`), the grouped GEMMs' from
  `te_gmm_quantization` (MaxText's TE block) or `moe_gemm_quantization` (ours).
- Memory-bound ops, per token and layer in the forward (the backward twice that), in activation elements:
  2 norms (read + write D each), 2 residual adds (3 D each), q/k/v/out around RoPE and the attention
  kernel (2 H (2 qk + v)), and for an MoE layer the router (2 E), the permutation and its inverse
  (4 K' D, K' the rows the exchange delivers per token), the gated activation (3 K F) and the shared
  experts' (3 S F); a dense layer's MLP activation 3 F_dense. A count of what the kernels must read and
  write, with nothing fused away beyond that. An FP8 GEMM's input is quantized first (current scaling:
  an amax pass, a read and a one-byte write; MXFP8: a read and row- and column-wise writes).
- FSDP (`fsdp.py`): every parameter leaf is gathered before its use in the forward and again in the
  backward, over the mesh axes that shard it except the experts' axis on its expert dimension and the
  tensor axes, and its gradient reduce-scattered over the same group, both in the compute dtype (as
  XLA:GPU's compiled programs do), then all-reduced over `data`.
- Pipeline stages (`stage_costs.py`): GEMMs at a microbatch's rows, weights gathered per iteration, sends, bubble.
- The expert exchange: dispatch and combine per MoE layer in the forward, their transposes in the
  backward, and again in the recomputed forward under `full`; rows per GPU: te_ep and MaxText's TE block
  send a token once per destination rank (`model.unique_ranks`), all_to_all its padded receive
  buffer (`moe.buffers.received_rows`).
- Host offload: what the remat policy offloads (the planner's `saved_activations`), out in the forward and
  back in the backward, and offloaded optimizer state and parameters, in for the update and back out,
  over the host link.
- Host syncs: our bounded rounds' conditional per MoE layer and pass (`docs/gpu-path.md`), none for te_ep.
- Tensor parallelism (`_tensor`; MaxText's `tensor` and `tensor_sequence` axes, `planner/shards.py`): the
  batch stays whole over the group, each activation split; around attention and every dense MLP, the
  layer's input gathered ([group tokens, D]) and its output reduce-scattered, in each forward and the
  backward, waited for (XLA:GPU's default schedule runs no collective matmul); our MoE block takes the
  group's tokens split instead (an all-to-all in and one out). The dense GEMMs run at the group's rows
  and 1/tp of their width.
"""

import dataclasses
import math
from typing import Any

from maxtext_moe.config.quantization import number_format
from maxtext_moe.moe.buffers import received_rows
from maxtext_moe.moe.layout import layer_counts, mesh_sides
from maxtext_moe.moe.levels import expected_nodes
from maxtext_moe.moe.settings import DispatchKind
from maxtext_moe.planner import saved_activations
from maxtext_moe.planner.estimate import _state_bytes, batch_tokens
from maxtext_moe.planner.layer_phase import (
  _moe_rows,
  dtype_bytes,
  ep_buffers,
  experts_recomputed,
  maxtext_te_block,
  our_block,
)
from maxtext_moe.planner.shards import TENSOR_AXES, tensor_ways
from maxtext_moe.planner.stages import Stages, outside_layer_counts, saved_bytes
from maxtext_moe.steptime import fsdp, launch, stage_costs
from maxtext_moe.steptime.constants import exchange_beside
from maxtext_moe.steptime.counts import head_rerun_tflops, memory_bytes_per_token, recompute_tflops, value_of
from maxtext_moe.steptime.imbalance import UNMEASURED, Imbalance
from maxtext_moe.steptime.model import Transfer, Workload, unique_ranks

_MOE_NAMES = ("moe_mlpwi_0", "moe_mlpwi_1", "moe_mlpwo")


def formats(cfg: Any) -> dict[str, str]:
  te_block = maxtext_te_block(cfg)
  grouped = number_format(cfg.te_gmm_quantization if te_block else cfg.moe_gemm_quantization)
  return {"dense": number_format(cfg.quantization), "grouped": grouped, "attention": "bf16", "head": "bf16"}


@dataclasses.dataclass(frozen=True)
class _Step:
  """What the parts of one GPU's step share."""

  rows: int  # tokens per GPU and micro-batch
  microbatches: int  # gradient_accumulation_steps
  layers: int
  moe_layers: int
  full: bool  # remat_policy full: the whole forward again
  moe_rerun: bool  # the experts' forward (and its exchange) again in the backward
  sides: dict[str, tuple[int, int]]
  rules: list
  pipe: Stages | None = None  # pipeline stages (`stage_costs.py`)
  micro_rows: int = 0  # with them, tokens per GPU in one of the pipeline's microbatches
  runs: tuple[int, int] = (0, 0)  # (dense, MoE) layer runs per micro-batch: a stage's once per iteration

  @property
  def tokens(self) -> int:
    """Tokens per GPU and step."""
    return self.rows * self.microbatches

  @property
  def passes(self) -> int:
    """Passes over the layers: forward, backward (2x), and the recomputed forward under full remat."""
    return 4 if self.full else 3


def _step(cfg: Any, num_devices: int, dispatch: str) -> _Step:
  rows = int(float(cfg.per_device_batch_size) * int(cfg.max_target_length))
  dense_layers, moe_layers = layer_counts(cfg)
  layers = dense_layers + moe_layers
  full = str(cfg.remat_policy) == "full"
  # The experts' forward runs again in the backward when the policy keeps none of its own outputs: always
  # where they are recomputed whatever it names (`experts_recomputed`), and when a custom policy
  # rematerializes every one of its tensors.
  none_kept = all(value_of(getattr(cfg, n, "remat")) == "remat" for n in _MOE_NAMES)
  none_kept = none_kept or experts_recomputed(cfg, dispatch)
  rerun = str(cfg.remat_policy) == "custom" and moe_layers > 0 and none_kept
  rules = [(n, tuple(a) if isinstance(a, list) else a) for n, a in cfg.logical_axis_rules]
  micro, sides, pipe = int(cfg.gradient_accumulation_steps), mesh_sides(cfg, num_devices), Stages.of(cfg)
  tokens = batch_tokens(cfg, {a: i * d for a, (i, d) in sides.items()}, rules, num_devices)
  micro_rows = pipe.microbatch_tokens(tokens, int(cfg.max_target_length)) if pipe else rows
  runs = stage_costs.layer_runs(cfg, pipe, dense_layers, moe_layers)
  return _Step(rows, micro, layers, moe_layers, full, rerun, sides, rules, pipe, micro_rows, runs)


def _flops(cfg: Any, step: _Step) -> tuple[dict[str, float], float, float, float, str]:
  """({class: FLOPs with recompute}, MaxText's TFLOPs, the shared experts' TFLOPs, attention's forward FLOPs
  (every run of it: all but the backward, which MaxText counts as two thirds of its attention), how the
  recompute was counted)."""
  from maxtext_moe.upstream.maxtext.compile import expert_tflops_per_device, train_tflops_per_device  # pylint: disable=C0415

  total, weights, attention = train_tflops_per_device(cfg)
  routed, shared = expert_tflops_per_device(cfg)
  recompute, note = recompute_tflops(cfg, step.tokens, step.layers, step.moe_layers)
  if step.moe_rerun:
    recompute["grouped"] = routed / 3
    note += "; the experts' forward (and its exchange)"
  scale = 4 / 3 if step.full else 1  # the forward is a third of the training FLOPs
  model = {"dense": weights - routed, "grouped": routed, "attention": attention}
  if formats(cfg)["dense"] != "bf16":  # MaxText never quantizes the unembedding; our block keeps the router bf16
    router_bf16 = our_block(cfg)  # MaxText's own non-TE block quantizes its router
    per_token = int(cfg.vocab_size) + int(cfg.num_experts) * step.moe_layers * router_bf16
    model["head"] = min(6 * step.tokens * int(cfg.emb_dim) * per_token / 1e12, model["dense"])
    model["dense"] -= model["head"]
  head = "head" if "head" in model else "dense"
  recompute[head] = recompute.get(head, 0.0) + head_rerun_tflops(cfg, step.tokens, step.full)
  flops = {cls: (tf * scale + recompute.get(cls, 0.0)) * 1e12 for cls, tf in model.items()}
  attention_fwd = flops["attention"] - 2 / 3 * attention * 1e12
  return flops, total, shared, attention_fwd, f"{note}: {sum(flops.values()) / 1e12 - total:,.0f} TFLOP"


def _exchange(cfg: Any, step: _Step, dispatch: str) -> tuple[list[Transfer], float, float, str, float]:
  """(the expert exchange, one transfer per level; rows per token it delivers; host syncs of its rounds;
  the dispatcher; the share of it XLA:GPU runs beside GEMMs, `constants.exchange_beside`)."""
  ep_ici, ep_dcn = step.sides.get("expert", (1, 1))
  ep = ep_ici * ep_dcn
  kind = DispatchKind.TE_EP if maxtext_te_block(cfg) else DispatchKind(dispatch)
  k, experts = int(cfg.num_experts_per_tok), int(cfg.num_experts)
  if not step.moe_layers or ep <= 1:
    return [], float(k), 0.0, kind.value, 0.0
  buffers = ep_buffers(cfg, ep, kind.value)
  rounds = buffers.rounds(step.tokens, k) if kind != DispatchKind.TE_EP else None
  # One-way exchanges per layer: dispatch and combine in the forward, again in a full remat's, transposed
  # in the backward. In rounds 5 whatever the remat: the forward's two, the custom VJP's dispatch again and
  # both transposed (XLA drops a full remat's second forward of it, whose outputs feed nothing the backward
  # reads: XLA:GPU's 671B program moves 5 per layer).
  per_layer = 5 if rounds else 6 if step.full or step.moe_rerun else 4
  row_bytes = int(cfg.emb_dim) * dtype_bytes(cfg.dtype) * per_layer * step.moe_layers
  launches = per_layer * step.runs[1] * step.microbatches  # per micro-batch and layer run
  name = f"expert dispatch/combine ({kind.value}) x{ep}"
  if rounds is None:  # te_ep: a token once per rank, once per node over the network; all_to_all: padded
    if kind == DispatchKind.TE_EP:
      rows = step.tokens * unique_ranks(experts, k, ep)
      groups = buffers.routing_groups
      across = step.tokens * expected_nodes(num_experts=experts, top_k=k, nodes=ep_dcn, routing_groups=groups)
      network = across * (ep_dcn - 1) / ep_dcn * row_bytes if ep_dcn > 1 else None
    else:
      rows, network = received_rows(buffers, step.tokens, k), None
    transfer = Transfer(name, "all-to-all", rows * row_bytes, ep, ep_dcn, False, launches, network)
    return [transfer], rows / step.tokens, 0.0, kind.value, 0.0
  chunks, sizes = rounds
  out = []
  for i, level in enumerate(sizes):  # every chunk's round 0 of each level, its padded buffer on the wire
    across = len(sizes) > 1 and i == 0
    where = f" ({kind.value}, {'network' if across else 'NVLink'} level) x{level.ranks}"
    wire = chunks * level.recv_rows * row_bytes
    network = wire * (level.ranks - 1) / level.ranks if across else None
    domains = level.ranks if across else ep_dcn if len(sizes) == 1 else 1
    label = f"expert dispatch/combine{where}" if len(sizes) > 1 else name
    out.append(Transfer(label, "all-to-all", wire, level.ranks, domains, False, launches * chunks, network))
  # A loop's test per level and chunk, forward and backward (round 0 runs before it): the host syncs
  syncs = step.moe_layers * step.microbatches * chunks * 2 * len(sizes)
  return out, chunks * sizes[-1].recv_rows / step.tokens, syncs, kind.value, exchange_beside(chunks)


def _tensor_ways(sides: dict[str, tuple[int, int]]) -> int:
  return tensor_ways({axis: ici * dcn for axis, (ici, dcn) in sides.items()})


def _tensor(cfg: Any, step: _Step) -> list[Transfer]:
  """Tensor parallelism's activation collectives per step (see the module docstring)."""
  tp = _tensor_ways(step.sides)
  if tp <= 1:
    return []
  domains = math.prod(step.sides.get(a, (1, 1))[1] for a in TENSOR_AXES)
  one = step.tokens * int(cfg.emb_dim) * dtype_bytes(cfg.dtype)  # a device's share of a [tokens, D] activation
  each = (2 if step.full else 1) + 1  # forward (again under full remat) and backward
  ours = our_block(cfg)
  dense = step.layers + (step.layers - step.moe_layers) + step.moe_layers * (not ours)  # attention and MLPs
  n = dense * each
  out = [
    Transfer(f"tensor-parallel all-gathers x{tp}", "all-gather", n * one * tp, tp, domains, False, n),
    Transfer(f"tensor-parallel reduce-scatters x{tp}", "reduce-scatter", n * one * tp, tp, domains, False, n),
  ]
  if ours and step.moe_layers:  # the group's tokens split for the block, and back
    m = 2 * step.moe_layers * each
    out.append(
      Transfer(f"tensor-parallel token reshards x{tp} (MoE block)", "all-to-all", m * one, tp, domains, False, m)
    )
  return out


def _tensor_shapes(shapes: dict, sides: dict[str, tuple[int, int]]) -> dict:
  """The dense GEMMs (and the unembedding) under tensor parallelism: the group's rows, 1/tp of the width."""
  tp = _tensor_ways(sides)
  if tp <= 1:
    return shapes
  return shapes | {
    cls: [(m * tp, max(n // tp, 1), k, s) for m, n, k, s in shapes[cls]] for cls in ("dense", "head") if cls in shapes
  }


def _host_transfers(cfg: Any, leaves: list, step: _Step, kind: str) -> list[Transfer]:
  """Offloaded activations out and back, offloaded optimizer state and parameters in and back."""
  out = []
  ep = math.prod(step.sides.get("expert", (1, 1)))
  buffer_rows, _ = _moe_rows(cfg, step.tokens, ep, kind) if step.moe_layers else (0, 0)
  recomputed, layers = experts_recomputed(cfg, kind), outside_layer_counts(cfg, step.pipe)
  _, host = saved_activations.total(
    cfg, step.tokens, dtype_bytes(cfg.dtype), buffer_rows, recomputed=recomputed, layers=layers
  )
  if step.pipe is not None:  # a stage's layers at each iteration's microbatch
    micro_rows, _ = _moe_rows(cfg, step.micro_rows, ep, kind) if step.moe_layers else (0, 0)
    host += step.microbatches * saved_bytes(cfg, step.pipe, step.micro_rows, micro_rows, dispatch=kind)[1]
  if host:  # out in the forward and back in the backward, a copy per layer each way
    out.append(Transfer("host offload copies", "host", 2 * host, 1, 1, True, 2 * sum(step.runs)))
  sizes = {a: i * d for a, (i, d) in step.sides.items()}
  params_b, opt_b, _, _ = _state_bytes(cfg, leaves, step.rules, sizes, step.pipe)
  # The state on the host (the planner's `host_state`), each leaf brought in whole and written back once
  # per step: XLA:GPU's programs move exactly these bytes each way (`compile`'s host transfers).
  on_host = opt_b * bool(cfg.optimizer_memory_host_offload) + params_b * bool(cfg.parameter_memory_host_offload)
  if on_host:
    out.append(Transfer("optimizer/parameter offload copies", "host", 2 * on_host, 1, 1, True, 2))
  return out


def _kernels(cfg: Any, step: _Step) -> tuple[float, float]:
  """(outside, inside) command buffers: the kernels launched per step (`launch.py`)."""
  from maxtext_moe.config import flags  # pylint: disable=import-outside-toplevel

  fmts = formats(cfg)
  types = launch.xla_command_types(flags.for_config(cfg, keep_process_flags=False).xla_flags)
  te_gemms = maxtext_te_block(cfg) or str(cfg.quantization).startswith("te")
  out = inside = 0.0
  for moe, count in ((True, step.runs[1]), (False, step.runs[0])):
    o, i = launch.xla_split(launch.kernels_per_layer(cfg, fmts, moe=moe), types, te_gemms)
    out += o * count * step.passes * step.microbatches
    inside += i * count * step.passes * step.microbatches
  return out, inside


def workload(
  cfg: Any, leaves: list, *, num_devices: int, dispatch: str, label: str, imbalance: Imbalance = UNMEASURED
) -> Workload:
  """The `Workload` of one GPU of `cfg`'s training step on `num_devices` GPUs, its routing at `imbalance`."""
  step = _step(cfg, num_devices, dispatch)
  flops, total, shared, attention_fwd, recompute_note = _flops(cfg, step)
  exchange, rows_per_token, host_syncs, kind, beside = _exchange(cfg, step, dispatch)
  transfers = fsdp.transfers(cfg, leaves, step.rules, step.sides, step.pipe) + exchange
  transfers += _host_transfers(cfg, leaves, step, kind) + stage_costs.sends(cfg, step.pipe, step.sides, step.micro_rows)
  transfers += _tensor(cfg, step)
  moe_bytes, dense_bytes = memory_bytes_per_token(cfg, rows_per_token, formats(cfg))
  layers = (step.layers - step.moe_layers, step.moe_layers)
  memory = step.passes * step.tokens * (moe_bytes * step.moe_layers + dense_bytes * layers[0])
  return Workload(
    label=label,
    tokens=step.tokens,
    model_tflops=total,
    flops=flops,
    formats=formats(cfg),
    memory_bytes=memory,
    transfers=transfers,
    hideable_flops=shared * (4 / 3 if step.full else 1) * 1e12,
    host_syncs=host_syncs,
    exchange_beside=beside,
    attention_fwd_flops=attention_fwd,
    gemm_shapes=_tensor_shapes(stage_costs.shapes(cfg, step.pipe, step.rows, step.micro_rows, layers), step.sides),
    pipeline=stage_costs.pipeline(cfg, step.pipe, flops, layers),
    kernels=_kernels(cfg, step),
    imbalance=imbalance.factor if step.moe_layers else 1.0,
    sources={
      "FLOPs": f"MaxText's count ({total:,.0f} TFLOP) + recompute ({recompute_note})",
      "collectives": "analytic, from the parameter tree's shardings and the MoE settings",
      "GEMM efficiency": "by shape, XLA:GPU's measured matmul table (steptime/gemm.py)",
      "routing imbalance": imbalance.source,
    },
  )
