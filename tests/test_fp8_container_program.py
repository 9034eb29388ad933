"""The container's FP8 program compiled whole: TE NCCL EP's dispatch handle answered for a target without a
GPU (gpu_compile.nccl_ep), and checked against TE's own answer where TE can give one (a bootstrapped NCCL EP
group: two or more GPUs, one per process)."""

import json
import os
import socket
import subprocess
import sys
import textwrap

import pytest

from maxtext_moe.bench.plan_accuracy import TE_PYTHON
from maxtext_moe.gpu_compile import nccl_ep
from maxtext_moe.moe.te_capacity import te_ep_capacity


def _deepseek_rack(**kw) -> nccl_ep.EpGroup:
  """DeepSeek-V3 on gb300x128 as shipped: EP 4 inside an NVL72 rack, 2 x 4,096 tokens per rank, TE's dropless
  worst case of receive rows, a GB300's 160 SMs."""
  sizes = {"num_experts": 256, "ep_size": 4, "tokens": 8192, "capacity": 262144, "nvlink_domain": 72, "sm_count": 160}
  return nccl_ep.group_for(**(sizes | kw))


def test_fp8_container_te_ep_handle_is_the_sum_of_its_regions_on_a_worked_example():
  """Each region of NCCL EP's expert-major handle, worked out by hand for DeepSeek-V3 at EP 4 in one rack."""
  regions = {
    "rdma-to-attention map: 1 domain x 8,192 tokens": 8192,
    "local expert routing map: 262,144 rows x 64 local experts": 262144 * 64,
    "tokens-for-experts counter, one 256-byte block": 256,
    "sparse-to-dense map: 8,192 x 4 ranks x int32": 8192 * 4 * 4,
    "rank masks: 8,192 x 4 ranks x one 64-bit word": 8192 * 4 * 8,
    "scan scratch: 160 SMs x 4 ranks x 8": 160 * 4 * 8,
    "routing probabilities (no inter-domain hop): 8,192 x 256 x f32": 8192 * 256 * 4,
    "cached top-k ids: 8,192 x 8 x int64": 8192 * 8 * 8,
    "active per-expert counts: 64 x int32, one block": 256,
    "expert offsets: 65 x int64 = 520, in three blocks": 768,
    "flat-to-expert-major slots: 262,144 x 8 x int32": 262144 * 8 * 4,
    "received top-k weights: 262,144 x 8 x f32": 262144 * 8 * 4,
    "token-to-receive-slot map: 8,192 x 4 x 1 x int32": 8192 * 4 * 4,
  }
  size = nccl_ep.handle_mem_size(_deepseek_rack(), top_k=8)
  assert size == sum(regions.values()) == 43_006_208
  assert size % nccl_ep.ALIGN == 0


def test_fp8_container_te_ep_handle_follows_the_receive_rows_and_the_nvlink_domains():
  base = nccl_ep.handle_mem_size(_deepseek_rack(), top_k=8)
  more_rows = nccl_ep.handle_mem_size(_deepseek_rack(capacity=262144 + 256), top_k=8)
  assert more_rows - base == 256 * (64 + 2 * 8 * 4)  # routing map, slots and weights per row
  # EP 16 over two 8-GPU domains: a rail team of 2 (a cross-domain map, no routing probabilities kept)
  two = nccl_ep.group_for(num_experts=256, ep_size=16, tokens=8192, capacity=262144, nvlink_domain=8, sm_count=132)
  one = nccl_ep.group_for(num_experts=256, ep_size=16, tokens=8192, capacity=262144, nvlink_domain=16, sm_count=132)
  assert (two.nvlink_ranks, two.domains, one.domains) == (8, 2, 1)
  # one domain of 16 against two of 8, region by region (the per-rank tables hold 16 x 1 = 8 x 2 entries)
  differences = {
    "routing probabilities, kept inside one domain only": 8192 * 256 * 4,
    "rdma-to-attention map over 1 domain, not 2": 8192 - 2 * 8192,
    "no cross-domain map": -8192,
    "scan scratch per rank of the domain": 132 * 16 * 8 - 132 * 8 * 8,
  }
  assert nccl_ep.handle_mem_size(one, top_k=8) - nccl_ep.handle_mem_size(two, top_k=8) == sum(differences.values())
  with pytest.raises(ValueError, match="does not split evenly into NVLink domains of 8"):
    nccl_ep.group_for(num_experts=240, ep_size=12, tokens=8, capacity=8, nvlink_domain=8, sm_count=132)


def _gpus() -> int:
  try:
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=False, timeout=30)
  except (OSError, subprocess.TimeoutExpired):
    return 0
  return out.stdout.count("GPU ") if out.returncode == 0 else 0


_RANK = textwrap.dedent(
  """
  import json, sys
  import jax
  rank = int(sys.argv[2])
  jax.distributed.initialize(sys.argv[1], num_processes=2, process_id=rank, local_device_ids=[rank])
  from jax.sharding import Mesh
  import numpy as np
  from maxtext_moe.upstream.te import calls as te
  from maxtext_moe.bench.plan_accuracy import TE_PYTHON
from maxtext_moe.gpu_compile import nccl_ep
from maxtext_moe.moe.te_capacity import te_ep_capacity
  from transformer_engine.jax import ep
  mesh = Mesh(np.array(jax.devices()).reshape(1, 1, 2), ("data", "fsdp", "expert"))
  capacity = te.recv_capacity(num_experts=16, top_k=4, tokens_per_rank=512, ep_size=2, factor=0)
  te.bootstrap(mesh, axes=("data", "fsdp", "expert"), num_experts=16, tokens_per_rank=512, capacity=capacity,
               hidden_dim=256, drop=False)
  sm = jax.devices()[0].core_count
  ours = nccl_ep.handle_mem_size(nccl_ep.group_for(num_experts=16, ep_size=2, tokens=512, capacity=capacity,
                                                   nvlink_domain=8, sm_count=sm), top_k=4)
  print(json.dumps({"te": ep.ep_handle_mem_size(ep.EpLayerConfig(top_k=4, dispatch_output_per_expert_alignment=128)),
                    "ours": ours}))
  """
)


@pytest.mark.skipif(_gpus() < 2, reason="TE answers the handle size from a bootstrapped NCCL EP group: needs 2+ GPUs")
def test_fp8_container_te_ep_handle_size_matches_tes_own_answer_on_gpus(tmp_path):
  """Two processes of one GPU each bootstrap TE's NCCL EP (EP 2 in one NVLink domain) and ask it for the
  handle size; ours must agree to the byte."""
  with socket.socket() as s:
    s.bind(("localhost", 0))
    coordinator = f"localhost:{s.getsockname()[1]}"
  script = tmp_path / "rank.py"
  script.write_text(_RANK)
  env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
  procs = [
    subprocess.Popen([sys.executable, str(script), coordinator, str(i)], stdout=subprocess.PIPE, text=True, env=env)
    for i in range(2)
  ]
  answers = [json.loads(p.communicate(timeout=600)[0].strip().splitlines()[-1]) for p in procs]
  assert all(p.returncode == 0 for p in procs)
  assert answers[0] == answers[1] and answers[0]["te"] == answers[0]["ours"], answers


def test_fp8_container_te_ep_receive_rows_are_tes_sizing_worked_out():
  """TE's receive capacity (moe.te_capacity), as TE's get_moe_recv_capacity_per_rank sizes it."""
  # gb300x128's 671B: 4 x 8,192 tokens, 8 of 64 local experts each: 262,144 assignments plus 127 rows of
  # padding for each of the 64 local experts, rounded up to 128
  assert te_ep_capacity(num_tokens=8192, top_k=8, num_ranks=4, num_experts=256) == 270_336
  # the 16B proxy at EP 8: 8 local experts, so the per-expert bound (8 x 131,072) is the smaller
  assert te_ep_capacity(num_tokens=16384, top_k=8, num_ranks=8, num_experts=64) == 1_048_576
  # a factor of 2 over balanced routing: 64 x round_up(1,024, 128) x 2
  assert te_ep_capacity(num_tokens=8192, top_k=8, num_ranks=4, num_experts=256, factor=2.0) == 131_072


@pytest.mark.skipif(not TE_PYTHON.is_file(), reason="needs the TE compile environment (./setup.sh --gpu-compile-te)")
def test_fp8_container_te_ep_receive_rows_match_tes_own_function():
  """Where TE imports (its libraries loaded against the stub driver), its sizing and ours agree over a grid."""
  grid = [(t, k, p, e, f) for t in (1, 100, 4096) for k in (1, 8) for p in (2, 8) for e in (16, 256) for f in (0, 1.5)]
  code = textwrap.dedent(
    f"""
    from maxtext_moe.gpu_compile import te_libraries
    te_libraries.load()
    from maxtext_moe.upstream.te import calls as te
    from maxtext_moe.moe.te_capacity import te_ep_capacity
    bad = []
    for t, k, p, e, f in {grid!r}:
      kw = dict(num_experts=e, top_k=k, tokens_per_rank=t, ep_size=p, factor=f)
      ours = te_ep_capacity(num_tokens=t, top_k=k, num_ranks=p, num_experts=e, factor=f)
      if te.recv_capacity(**kw) != ours:
        bad.append((kw, te.recv_capacity(**kw), ours))
    print(len(bad), bad[:3])
    """
  )
  r = subprocess.run([str(TE_PYTHON), "-c", code], capture_output=True, text=True, check=False, timeout=600)
  assert r.returncode == 0, r.stderr[-3000:]
  assert r.stdout.strip().splitlines()[-1] == "0 []", r.stdout


def test_fp8_container_planner_plans_tes_receive_buffer_and_its_quantized_rows():
  """gb300x128's 671B: the experts' rows at TE's capacity, and (MXFP8 grouped GEMM) their 1-byte copies."""
  from maxtext_moe.planner.memory_plan import memory_plan

  plain = memory_plan("gb300x128/deepseek3-671b", ["moe_gemm_quantization=none"]).base
  mxfp8 = memory_plan("gb300x128/deepseek3-671b", []).base
  assert plain.moe_rows == mxfp8.moe_rows == 270_336
  assert mxfp8.moe_dispatch - plain.moe_dispatch == 270_336 * (2 * 7168 + 4 * 2048)
