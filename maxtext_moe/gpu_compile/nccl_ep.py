"""The size of TE's NCCL EP dispatch handle, answered for a target GPU without one.

TE's `ep_prepare` returns a uint8 buffer per call (its "handle mem": the routing tables dispatch and combine
share, kept for the backward), and the traced program needs its size: TE asks its bootstrapped EP backend
(`transformer_engine_jax.ep_handle_mem_size(top_k, alignment)` -> `nvte_ep_handle_mem_size` ->
`ncclEpHandleMemSize`), which needs a live NCCL EP group, so GPUs and their peers. `maxtext-moe compile`
answers it from the group's sizes instead, with this function (`upstream.te.compile_target.ep_for_target`).

How NCCL EP sizes it, read from nccl-extensions' `nccl_ep/nccl_ep.cc` (`HtBlockLayout::compute`) at commit
9f47d6eb (August 2026; the commit Transformer Engine's main branch and its 2.19 release pin): the
high-throughput algorithm with the expert-major layout TE asks for, in the "local permute" mode NCCL EP
picks when zero-copy is off (TE 2.20.2 builds its group with `zero_copy = 0`) and neither
`NCCL_EP_HT_EM_LOCAL_DUP` nor `NCCL_EP_HT_EM_NVLINK_DUP` is set. Every region is rounded up to 256 bytes;
the hidden size does not enter. The terms, for T tokens a rank sends (max_tokens_per_rank), R rows it may
receive (the receive capacity), E experts, E_l local experts, K top-k, L ranks of the EP group inside one
NVLink domain (NCCL EP's "LSA team"), N such domains the group spans (its "rail" team, N x L = EP) and S
streaming multiprocessors:

| region | bytes |
|---|---|
| rdma-to-attention map | N x T rounded up to 16 |
| attention-to-rdma map (N > 1) | T x (N - 1) |
| local expert routing map | R x E_l |
| tokens-for-experts counter | 4 |
| sparse-to-dense map | N x T x L x 4 |
| rank masks | N x T x L x 8 ceil(L / 64) |
| scan scratch | S x L x 8 |
| routing probabilities (N = 1) | T x E x 4 |
| cached top-k ids | T x K x 8 |
| per-expert counts, offsets | E_l x 4, (E_l + 1) x 8 |
| flat-to-expert-major slots, their weights | R x K x 4, R x K x 4 |
| token-to-receive-slot map | T x L x N x 4 |

TE 2.20.2's wheel bundles a later build of NCCL EP (`transformer_engine/wheel_lib/libnccl_ep.so`) whose
source is not published; its `HtBlockLayout::compute` reads more of the group (more modes), so this is the
published formula, not necessarily that library's. tests/test_fp8_container_program.py compares the two where TE can
answer (a bootstrapped group: two or more GPUs, one per process). The handle is small beside the step: on
`gb300x128/deepseek3-671b` (T = 8,192, R = 262,144, E_l = 64, K = 8, L = 4, S = 160) 41 MiB per MoE
layer's call.
"""

from dataclasses import dataclass

ALIGN = 256  # every region of the handle is rounded up to this many bytes
PINNED_SOURCE = "NVIDIA/nccl-extensions@9f47d6eb nccl_ep/nccl_ep.cc HtBlockLayout::compute"


@dataclass(frozen=True)
class EpGroup:
  """What the handle size depends on: one NCCL EP group as TE bootstraps it, and the GPU it runs on."""

  num_experts: int
  ep_size: int
  max_tokens_per_rank: int
  recv_capacity_per_rank: int
  nvlink_ranks: int  # ranks of the group inside one NVLink domain (NCCL EP's LSA team)
  sm_count: int

  @property
  def local_experts(self) -> int:
    return self.num_experts // self.ep_size

  @property
  def domains(self) -> int:
    """NVLink domains the group spans (NCCL EP's rail team)."""
    return self.ep_size // self.nvlink_ranks


def group_for(
  *, num_experts: int, ep_size: int, tokens: int, capacity: int, nvlink_domain: int, sm_count: int
) -> EpGroup:
  """The group of `ep_size` consecutive ranks on GPUs whose NVLink domains hold `nvlink_domain` each."""
  lsa = min(ep_size, nvlink_domain)
  if ep_size % lsa:
    raise ValueError(f"an EP group of {ep_size} ranks does not split evenly into NVLink domains of {nvlink_domain}")
  return EpGroup(num_experts, ep_size, tokens, capacity, lsa, sm_count)


def _aligned(nbytes: int) -> int:
  return -(-nbytes // ALIGN) * ALIGN


def handle_mem_size(group: EpGroup, *, top_k: int) -> int:
  """Bytes of one dispatch handle (see the module docstring for the terms)."""
  t, r, k = group.max_tokens_per_rank, group.recv_capacity_per_rank, top_k
  e, e_l, lsa, rails = group.num_experts, group.local_experts, group.nvlink_ranks, group.domains
  routing = [
    rails * (-(-t // 16) * 16),  # rdma-to-attention map (bool, padded to 16 tokens)
    t * (rails - 1),  # attention-to-rdma map (bool; empty inside one domain)
    r * e_l,  # local expert routing map (bool)
    4,  # tokens-for-experts counter
  ]
  tables = [
    rails * t * lsa * 4,  # sparse-to-dense map
    rails * t * lsa * 8 * -(-lsa // 64),  # rank masks, 64 ranks per word
    group.sm_count * lsa * 8,  # the preprocessing scan's per-block state
    t * e * 4 if rails == 1 else 0,  # routing probabilities, kept where there is no inter-domain hop
    t * k * 8,  # cached top-k ids (int64)
    e_l * 4,  # active per-expert counts
    (e_l + 1) * 8,  # expert offsets, with the padded total
    r * k * 4,  # flat-to-expert-major slot map
    r * k * 4,  # received top-k weights, flat
    t * lsa * rails * 4,  # token-to-receive-slot map
  ]
  return sum(_aligned(n) for n in (*routing, *tables))
