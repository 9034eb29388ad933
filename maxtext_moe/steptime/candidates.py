"""The layout search's candidates (`search.py`): per NVLink domain (one HGX node, or up to a rack of NVL72
trays) and across domains:
- EP x FSDP inside a domain: every split whose EP divides the experts; and, asked for (`plan --search
  --tensor`), EP x TP, tensor parallelism 2 or 4 in place of FSDP where it divides the attention heads
  (`tensor`: MaxText splits each activation over it, our block its tokens);
- across domains: data parallel (each domain a replica: what fits one domain fits N), FSDP over all of
  them, FSDP 2 x data parallel the rest, or (over more than 4 domains) FSDP over half of them x data 2;
- expert parallelism across domains: every GPU of a domain on the expert axis, over 2, 4, ... domains
  (`_ep_across`: dividing the experts, and group-limited routing's groups), the domains left over laid out
  as above;
- pipeline stages across domains as well (2, 4 or 8 where they divide the domains and the layers allow),
  the domains left over laid out as above; each pipelines the largest multiple of the stages among the
  MoE layers (`pipeline_parallel_layers`; the rest run outside the pipeline: before it in a DeepSeek
  decoder, MaxText's `_init_pipeline_deepseek`, after it in the others); once a layout fits, it is timed in
  1, 2 or 4 repeats (a circular pipeline's virtual stages: the largest multiple of stages x repeats
  pipelined, `num_layers_per_pipeline_stage` of them per stage and repeat; `upstream/pipeline/records.py`)
  and with microbatches the stages x 1, 2, 4 or 8 (MaxText's rule: a multiple of the stages dividing the
  batch) while a microbatch keeps a whole sequence per batch shard (`fitting.timed`);
- the remat policy: full, or every matmul output kept but the experts';
- the micro-batch per GPU: 1, 2, 4, 8 (each larger one only while the smaller fits);
- offload: none, else the optimizer, else the optimizer and parameters (the first that fits; not the
  parameters for a recipe that starts from a checkpoint, whose layer axis they would move: `offloads`).
"""

import dataclasses
from typing import Any

import yaml

from maxtext_moe.config import hardware, offload

_ATTENTION = ("query_proj", "key_proj", "value_proj", "qkv_proj", "out_proj", "context")
_ATTENTION += ("mla_q", "mla_kv", "query_wa_proj", "kv_wa_proj")
_MLP = ("mlpwi", "mlpwi_0", "mlpwi_1", "mlpwo")
_EXPERTS = ("moe_mlpwi_0", "moe_mlpwi_1", "moe_mlpwo")
# Two ends of MaxText's remat: `full` (each layer's input kept, its forward run again) and a custom policy
# that keeps every matmul output but the experts' (their GEMMs run again: the largest activations of a MoE
# layer, and the cheapest to recompute per byte kept).
REMATS = {
  "full": ["remat_policy=full"],
  "experts recomputed": ["remat_policy=custom", *(f"{n}=device" for n in _ATTENTION + _MLP)]
  + [f"{n}=remat" for n in _EXPERTS],
}
GIVES_UP = {
  "full": "recomputes every layer's forward (+1/3 FLOPs)",
  "experts recomputed": "recomputes the experts' GEMMs",
}
OFFLOADS = ("none", "optimizer", "optimizer_params")


def offloads(*, loads_weights: bool) -> tuple[str, ...]:
  """The OFFLOADS a recipe can take, in their order: not the parameters' when it starts from a checkpoint
  (`config.offload.takes`: the layer axis a converted checkpoint keeps)."""
  return tuple(o for o in OFFLOADS if offload.takes(o, loads_weights=loads_weights))


BATCHES = (1, 2, 4, 8)
STAGES = (2, 4, 8)
TENSOR = (1, 2, 4)  # tensor-parallel degrees inside a domain
REPEATS = (1, 2, 4)  # a circular pipeline's repeats (virtual stages per stage)
MICROBATCHES_PER_STAGE = (1, 2, 4, 8)


def keys_of(overrides: list[str]) -> dict[str, Any]:
  return {k: yaml.safe_load(v) for k, _, v in (o.partition("=") for o in overrides)}


@dataclasses.dataclass(frozen=True)
class Layout:
  """One candidate: its overrides and the words for it."""

  ep: int
  fsdp: int
  dcn_fsdp: int
  dcn_data: int
  remat: str
  batch: int
  offload: str = "none"
  stages: int = 1  # pipeline stages across domains (dcn_pipeline_parallelism)
  pipelined: int = 0  # pipeline_parallel_layers
  microbatches: int = 0  # num_pipeline_microbatches
  dcn_ep: int = 1  # expert parallelism across domains (dcn_expert_parallelism): EP ep x dcn_ep in all
  tp: int = 1  # tensor parallelism inside the domain (ici_tensor_parallelism): ep x fsdp x tp its GPUs
  repeats: int = 1  # a circular pipeline's repeats (num_pipeline_repeats, which MaxText derives)

  @property
  def per_stage(self) -> int:
    """Layers a stage runs per iteration (per repeat)."""
    return self.pipelined // (self.stages * self.repeats)

  @property
  def bubble(self) -> float:
    """MaxText's bubble share of the pipelined layers' iterations: (S - 1) / (M x R + S - 1)."""
    return (self.stages - 1) / (self.microbatches * self.repeats + self.stages - 1) if self.stages > 1 else 0.0

  def overrides(self) -> list[str]:
    out = [f"ici_expert_parallelism={self.ep}", f"ici_fsdp_parallelism={self.fsdp}"]
    out += [f"ici_tensor_parallelism={self.tp}"]
    out += [f"dcn_expert_parallelism={self.dcn_ep}"]
    out += [f"dcn_fsdp_parallelism={self.dcn_fsdp}", f"dcn_data_parallelism={self.dcn_data}"]
    if self.stages > 1:
      out += ["ici_pipeline_parallelism=1", f"dcn_pipeline_parallelism={self.stages}"]
      out += [f"pipeline_parallel_layers={self.pipelined}", f"num_layers_per_pipeline_stage={self.per_stage}"]
      out += [f"num_pipeline_microbatches={self.microbatches}"]
    out += [*REMATS[self.remat], f"per_device_batch_size={self.batch}", f"offload={self.offload}"]
    return out

  def keys(self) -> dict[str, Any]:
    """The layout as YAML keys (what --write puts in the recipe)."""
    return keys_of(self.overrides())

  def gives_up(self) -> str:
    out = [GIVES_UP[self.remat]]
    if self.tp > 1:
      out.append(f"activations gathered and reduce-scattered around every layer (TP {self.tp})")
    if self.offload != "none":
      out.append(f"{self.offload.replace('_', ' and ')} in host memory (PCIe/C2C traffic each step)")
    if self.dcn_fsdp > 1:
      out.append(f"weights gathered over the network ({self.dcn_fsdp} domains)")
    if self.dcn_ep > 1:
      out.append(f"tokens sent over the network to experts in {self.dcn_ep} domains")
    if self.stages > 1:
      out.append(f"a pipeline bubble of {self.bubble:.1%}; activations sent between stages over the network")
    if self.repeats > 1:
      out.append(f"each stage's weights gathered for each of its {self.repeats} repeats per microbatch")
    return "; ".join(out)


def _divisors(n: int) -> list[int]:
  return [d for d in range(1, n + 1) if n % d == 0]


def _across(domains: int) -> list[tuple[int, int]]:
  """(FSDP, data) degrees over `domains` NVLink domains: data, FSDP over all, FSDP 2 x data the rest, and
  FSDP over half x data 2 (where FSDP over all no longer divides the model's narrowest split weights:
  DeepSeek-V3's 512-wide latent on 1,024 GPUs)."""
  out = [(1, domains)]
  if domains > 1:
    out.append((domains, 1))
  if domains > 2 and domains % 2 == 0:
    out.append((2, domains // 2))
  if domains > 4 and domains % 2 == 0:
    out.append((domains // 2, 2))
  return out


def _ep_across(ici: int, domains: int, num_experts: int, routing_groups: int) -> list[int]:
  """Degrees of expert parallelism across domains, with the whole domain on the expert axis: those that
  divide the domains and, with the domain's EP, the experts; and with group-limited routing the groups, or
  that the groups divide (whole groups on each domain, or each group on whole domains: `config/checks.py`)."""
  return [
    d
    for d in _divisors(domains)[1:]
    if num_experts % (ici * d) == 0 and (routing_groups <= 0 or routing_groups % d == 0 or d % routing_groups == 0)
  ]


def layouts(
  gpu: hardware.GpuModel,
  nodes: int,
  num_experts: int,
  *,
  moe_layers: int = 0,
  routing_groups: int = 0,
  tensor: tuple[int, ...] = (1,),
) -> list[Layout]:
  """Every candidate layout (batch 1, no offload) on `nodes` nodes of `gpu`; with pipeline stages across
  domains for a decoder of `moe_layers` layers it can pipeline (0: none), at as many microbatches as stages
  (`microbatch_counts` gives the others); with expert parallelism across domains (`_ep_across`); and at
  each tensor-parallel degree of `tensor` (above 1) that divides a domain, in place of FSDP."""
  g = gpu.gpus_per_node
  per_domain = max(k for k in range(1, nodes + 1) if nodes % k == 0 and k * g <= max(gpu.nvlink_domain, g))
  ici = per_domain * g
  domains = nodes // per_domain
  staged = [(1, 0)] + [(s, moe_layers // s * s) for s in STAGES if domains % s == 0 and s <= moe_layers]
  out = []
  for stages, pipelined in staged:
    # tensor parallelism in place of FSDP inside the domain: EP x TP its GPUs
    splits = [(1, e) for e in _divisors(ici)] + [(t, ici // t) for t in tensor if t > 1 and ici % t == 0]
    for tp, ep in splits:
      if num_experts % ep:
        continue
      for dcn_fsdp, dcn_data in _across(domains // stages):
        micro = stages * (stages > 1)
        out += [
          Layout(ep, ici // tp // ep, dcn_fsdp, dcn_data, remat, 1, "none", stages, pipelined, micro, 1, tp)
          for remat in REMATS
        ]
    for dcn_ep in _ep_across(ici, domains // stages, num_experts, routing_groups):
      for dcn_fsdp, dcn_data in _across(domains // stages // dcn_ep):
        micro = stages * (stages > 1)
        out += [
          Layout(ici, 1, dcn_fsdp, dcn_data, remat, 1, "none", stages, pipelined, micro, dcn_ep) for remat in REMATS
        ]
  return out


def microbatch_counts(stages: int, sequences: int) -> list[int]:
  """Microbatch counts to time for `stages` stages: MaxText's multiples of the stages that divide the
  micro batch, here while each microbatch keeps whole sequences on every batch shard (`sequences`: per
  shard of the pipeline's batch axes, which leave out the stage axis)."""
  return [stages * k for k in MICROBATCHES_PER_STAGE if sequences % (stages * k) == 0]
