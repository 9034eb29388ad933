"""The step-time model: its communication formulas worked by hand, its FLOP classes against MaxText's own
count, the compiled program's collectives taking the analytic ones' place, and `plan --time` as a user
runs it (its bad input is in test_bad_input.py)."""

import functools
import itertools
import json
import math

import pytest

from maxtext_moe.config.hardware import GPUS
from maxtext_moe.steptime import model as st


def test_a_collective_inside_one_nvlink_domain_moves_its_ring_share_over_nvlink():
  gpu = GPUS["gb300"]
  t = st.Transfer("ag", "all-gather", 64e9, group=8, domains=1, overlappable=True)
  nvlink = gpu.nvlink_gbs * 1e9 * st.constant("nvlink_efficiency")
  assert st.transfer_seconds(t, gpu) == pytest.approx(64e9 * 7 / 8 / nvlink)
  # an all-reduce is a reduce-scatter and an all-gather: twice the traffic
  assert st.transfer_seconds(st.Transfer("ar", "all-reduce", 64e9, 8, 1, True), gpu) == pytest.approx(
    2 * 64e9 * 7 / 8 / nvlink
  )


def test_a_group_across_domains_is_bounded_by_the_nics_it_has_in_each():
  gpu = GPUS["gb300"]
  net = gpu.network_gbs * 1e9 * st.constant("network_efficiency")
  nvlink = gpu.nvlink_gbs * 1e9 * st.constant("nvlink_efficiency")
  # 2 GPUs in 2 racks: each chunk crosses once, through one NIC
  two = st.Transfer("ag", "all-gather", 10e9, group=2, domains=2, overlappable=True)
  assert st.transfer_seconds(two, gpu) == pytest.approx(max(10e9 / 2 / nvlink, 10e9 / 2 / net))
  # 16 GPUs in 2 racks: (r - 1) / g of the data out of each NIC, so NVLink's share dominates
  sixteen = st.Transfer("ag", "all-gather", 10e9, group=16, domains=2, overlappable=True)
  assert st.transfer_seconds(sixteen, gpu) == pytest.approx(10e9 * 15 / 16 / nvlink)
  # an all-to-all cannot share a crossing: half its rows go over the network
  a2a = st.Transfer("ep", "all-to-all", 10e9, group=16, domains=2, overlappable=False)
  assert st.transfer_seconds(a2a, gpu) == pytest.approx(10e9 / 2 / net)


def test_unique_ranks_is_the_expected_number_of_distinct_destinations():
  experts, k, ranks = 8, 3, 4
  combos = list(itertools.combinations(range(experts), k))
  exact = sum(len({e // (experts // ranks) for e in c}) for c in combos) / len(combos)
  assert st.unique_ranks(experts, k, ranks) == pytest.approx(exact)
  assert st.unique_ranks(256, 8, 1) == 1.0


@functools.cache
def _context(recipe: str):
  """The planner's context of `recipe` (its parameter tree traced once: the layout does not change it)."""
  from maxtext_moe.planner.planning import planning as context

  return context(recipe, [], None, None)[0]


def _workload(recipe: str, overrides: list[str]):
  from maxtext_moe.moe.settings import resolve_dispatch
  from maxtext_moe.steptime.workload import workload
  from maxtext_moe.upstream import resolution

  ctx = _context(recipe)
  cfg = resolution.resolved(ctx.path, [*ctx.base_overrides, *overrides])
  kind = resolve_dispatch(cfg.moe_dispatch, ep=8, platform=ctx.platform).value
  return cfg, workload(cfg, ctx.leaves, num_devices=ctx.num_devices, dispatch=kind, label=recipe)


def test_the_flop_classes_add_up_to_maxtexts_count_and_the_experts_to_the_hand_count():
  from maxtext_moe.upstream.maxtext.compile import train_tflops_per_device

  cfg, w = _workload("h200x8/deepseek3-proxy-16b", ["remat_policy=minimal"])  # no recompute modelled
  total, _, _ = train_tflops_per_device(cfg)
  assert sum(w.flops.values()) == pytest.approx(total * 1e12, rel=1e-12)
  tokens = cfg.per_device_batch_size * cfg.max_target_length
  moe_layers = cfg.num_decoder_layers - cfg.first_num_dense_layers + cfg.mtp_num_layers
  by_hand = 3 * 2 * tokens * 3 * cfg.emb_dim * cfg.moe_mlp_dim * cfg.num_experts_per_tok * moe_layers
  assert w.flops["grouped"] == pytest.approx(by_hand, rel=1e-12)
  # full remat runs the forward again: a third more of every class
  _, full = _workload("h200x8/deepseek3-proxy-16b", ["remat_policy=full"])
  for cls, flops in w.flops.items():
    assert full.flops[cls] == pytest.approx(flops * 4 / 3, rel=1e-12)


def test_the_fsdp_gathers_cover_every_weight_twice_per_step():
  """FSDP=8 alone: every sharded parameter is gathered (forward, backward) whole, in the compute dtype; the
  replicated ones (norm scales) are not."""
  from maxtext_moe.planner.shards import mesh_axes_of

  cfg, w = _workload("h200x8/deepseek3-proxy-16b", ["ici_expert_parallelism=1", "ici_fsdp_parallelism=8"])
  ctx = _context("h200x8/deepseek3-proxy-16b")
  rules = [(n, tuple(a) if isinstance(a, list) else a) for n, a in cfg.logical_axis_rules]
  sharded = [
    (p, s, n) for p, s, n in ctx.leaves if p[0] == "params" and any("fsdp" in a for a in mesh_axes_of(n, rules))
  ]
  params = sum(math.prod(shape) for _, shape, _ in sharded)
  assert 0 < len(sharded) < len([leaf for leaf in ctx.leaves if leaf[0][0] == "params"])
  gathers = [t for t in w.transfers if t.kind == "all-gather"]
  assert sum(t.wire_bytes for t in gathers) == pytest.approx(2 * 2 * params, rel=1e-9)  # bf16, twice
  assert {t.group for t in gathers} == {8} and not any(t.kind == "all-to-all" for t in w.transfers)


def test_vocab_tiling_gathers_the_head_per_chunk_and_runs_its_forward_again():
  """num_vocab_tiling=4: MaxText's tiled loss gathers the output head in each chunk of its forward scan and
  of its backward's (XLA:GPU's proxy program), gathers the batch's hidden states whole twice a step where
  the batch spans nodes (the 671B's program: its chunks are cut from the whole batch flattened), and
  computes each chunk's logits again in the backward: without full remat 2 x T x D x V more FLOPs; under
  full remat none more (its whole-forward-again already counts the head). Nothing else changes."""
  from maxtext_moe.steptime import fsdp

  layout = ["ici_expert_parallelism=1", "ici_fsdp_parallelism=8", "remat_policy=minimal"]
  cfg, one = _workload("h200x8/deepseek3-proxy-16b", layout)
  tiled_cfg, tiled = _workload("h200x8/deepseek3-proxy-16b", [*layout, "num_vocab_tiling=4"])
  ctx = _context("h200x8/deepseek3-proxy-16b")
  head = next(math.prod(s) for p, s, _ in ctx.leaves if p[:3] == ("params", "decoder", "logits_dense"))
  by_name = lambda w: {t.name: t for t in w.transfers}  # noqa: E731
  for name, t in by_name(one).items():
    u = by_name(tiled)[name]
    extra = {"all-gather": 2 * 3, "reduce-scatter": 3}.get(t.kind, 0) * head * 2  # bf16, 3 more chunks
    assert (u.wire_bytes - t.wire_bytes, u.kind, u.group) == (pytest.approx(extra, rel=1e-9), t.kind, t.group)
  assert by_name(one).keys() == by_name(tiled).keys()  # inside one node XLA re-splits the batch by all-to-alls
  # across nodes it gathers the whole batch's hidden states (the 671B's program at 256 GPUs)
  rules = [(n, tuple(a) if isinstance(a, list) else a) for n, a in tiled_cfg.logical_axis_rules]
  (batch,) = fsdp._tiled_loss_gathers(tiled_cfg, rules, {"fsdp": (8, 4)})
  tokens = cfg.per_device_batch_size * cfg.max_target_length
  assert (batch.kind, batch.group, batch.domains, batch.overlappable, batch.count) == ("all-gather", 32, 4, False, 2)
  assert batch.wire_bytes == 2 * 32 * tokens * cfg.emb_dim * 2  # bf16, forward and backward
  assert fsdp._tiled_loss_gathers(cfg, rules, {"fsdp": (8, 4)}) == []  # untiled
  rerun = 2 * tokens * cfg.emb_dim * cfg.vocab_size
  assert {c: f - one.flops[c] for c, f in tiled.flops.items()} == {
    c: pytest.approx(rerun if c == "dense" else 0, abs=1) for c in one.flops
  }
  _, full = _workload("h200x8/deepseek3-proxy-16b", [*layout[:2], "remat_policy=full"])
  _, full_tiled = _workload("h200x8/deepseek3-proxy-16b", [*layout[:2], "remat_policy=full", "num_vocab_tiling=4"])
  assert full_tiled.flops == full.flops


def test_tensor_parallelism_gathers_and_reduce_scatters_around_every_layer():
  """TP 2 beside EP 2 x FSDP 2 (Qwen3-30B-A3B, 48 MoE layers, full remat): per layer its attention's input
  gathered and output reduce-scattered in the forward, its recompute and the backward (3 x 48 of each, the
  group's [tokens, D] each), our block's tokens split and joined (2 x 3 x 48 all-to-alls of a device's
  share), the expert weights gathered over `tensor` too, the dense GEMMs at twice the rows and half the
  width; none of it without TP."""
  cfg, w = _workload("h100x8/qwen3-30b-a3b", ["ici_tensor_parallelism=2", "ici_fsdp_parallelism=2"])
  share = cfg.per_device_batch_size * cfg.max_target_length * cfg.emb_dim * 2  # bf16 [tokens, D] per device
  tp = {t.name: t for t in w.transfers if "tensor-parallel" in t.name}
  gathers, scatters = tp["tensor-parallel all-gathers x2"], tp["tensor-parallel reduce-scatters x2"]
  assert (gathers.count, gathers.wire_bytes, gathers.overlappable) == (144, 144 * 2 * share, False)
  assert (scatters.count, scatters.wire_bytes) == (144, 144 * 2 * share)
  reshards = tp["tensor-parallel token reshards x2 (MoE block)"]
  assert (reshards.kind, reshards.count, reshards.wire_bytes) == ("all-to-all", 288, 288 * share)
  _, flat = _workload("h100x8/qwen3-30b-a3b", ["ici_tensor_parallelism=1", "ici_fsdp_parallelism=4"])
  assert not [t for t in flat.transfers if "tensor-parallel" in t.name]
  assert sorted((m * 2, n // 2, k) for m, n, k, _ in flat.gemm_shapes["dense"]) == sorted(
    (m, n, k) for m, n, k, _ in w.gemm_shapes["dense"]
  )
  # the expert weights (3 x 128 x 2,048 x 768 per layer, bf16) gathered over fsdp x tensor = 4, as FSDP 4 alone
  expert_gathers = lambda wl: sum(t.wire_bytes for t in wl.transfers if t.name.startswith("FSDP") and t.group == 4)  # noqa: E731
  assert expert_gathers(w) >= 2 * 2 * 48 * 3 * 64 * 2048 * 768  # 64 experts per EP rank, forward and backward


def test_the_compiled_programs_collectives_replace_the_analytic_ones():
  from maxtext_moe.steptime.recipe import with_compiled

  w = st.Workload(
    "x", 1, 1.0, {"dense": 1e12}, {}, 0.0,
    [st.Transfer("ep", "all-to-all", 1e9, 8, 1, False), st.Transfer("fsdp", "all-gather", 5e9, 8, 1, True)],
    0.0,
  )  # fmt: skip
  report = {
    "devices": 16,
    "partitions": 2,
    "host_syncs_per_step": 7,
    "collectives": {
      "reduce-scatter x16": {"count": 3, "bytes": 1e8, "kind": "reduce-scatter", "group_size": 16, "axes": ["fsdp"]},
      "all-to-all x8 (in a branch)": {"count": 9, "bytes": 4e9, "kind": "all-to-all", "group_size": 8},
    },
  }
  c = with_compiled(w, report, {"fsdp": (8, 2), "expert": (1, 1)})
  kinds = {t.name: t for t in c.transfers}
  assert set(kinds) == {"ep", "XLA:GPU reduce-scatter x16"}  # the analytic gather gone, the exchange kept
  rs = kinds["XLA:GPU reduce-scatter x16"]
  assert rs.wire_bytes == pytest.approx(16e8) and rs.domains == 2  # its input: the result x the group
  assert c.host_syncs == 7 and "XLA:GPU" in c.sources["collectives"]


def test_plan_time_as_a_user_runs_it(capfd):
  from maxtext_moe import cli

  assert cli.main(["plan", "h200x8/deepseek3-proxy-16b", "--time", "--json"]) == 0
  plan = json.loads(capfd.readouterr().out.strip().splitlines()[-1])
  t = plan["time"]
  tflops = plan["estimate"]["tflops_per_step"]
  assert t["step_s"] > 0 and t["tflops_per_gpu"] == pytest.approx(tflops / t["step_s"], rel=1e-3)
  assert "analytic" in t["sources"]["collectives"] and len(t["exposed_s"]) <= 3
  assert sum(t["parts_s"][k] for k in t["parts_s"] if "(overlapped)" not in k) == pytest.approx(t["step_s"], rel=1e-3)
  # the links' busy time: every transfer's seconds on each, the floor under the step
  net = sum(v for k, v in t["parts_s"].items() if "over" in k and "NVLink domains" in k)
  assert set(t["links_busy_s"]) == {"network", "NVLink"} and max(t["links_busy_s"].values()) <= t["step_s"] + 1e-3
  assert t["links_busy_s"]["NVLink"] > 0 and net == 0.0  # 8 GPUs: one node, nothing over the network
  assert t["links_busy_s"]["network"] == 0.0


def test_the_exchange_is_beside_the_gemms_only_where_the_scheduler_has_memory_for_it():
  """XLA:GPU's scheduler works to the slop factor x (the allocator's limit - the arguments): the 671B
  recipe plans 45.2 GiB of temporaries under its 53.4 (the profile's 85% of 72.8 less the 10.0 GiB of
  parameters) and its compile puts 53% of the exchange beside a GEMM; at batch 4 with the parameters on
  the host it plans 63.9 over 61.9, and its compile put 9% there, not the 49% its chunks had then (the search
  ranked it first at 1,517 tokens/s per GPU by the model; its compiled program gives 1,354)."""
  from maxtext_moe.planner.planning import estimate_of, planning
  from maxtext_moe.steptime.constants import EXCHANGE_BESIDE_OVER_LIMIT, exchange_beside
  from maxtext_moe.steptime.recipe import predict_config, scheduler_room

  gib = 2**30
  shares = {}
  for name, overrides in (("batch 2", []), ("batch 4", ["per_device_batch_size=4", "offload=optimizer_params"])):
    ctx, cfg = planning("h100x8/deepseek3-671b", overrides, None, None)
    est = estimate_of(ctx, cfg, [])[0]
    planned, limit = scheduler_room(cfg, est)
    pred = predict_config(ctx, cfg, name, est=est)
    shares[name] = (round(planned / gib, 1), round(limit / gib, 1), pred.workload.exchange_beside)
    note = pred.workload.sources.get("expert exchange beside GEMMs", "")
    assert ("over the 61.9 GiB XLA:GPU's scheduler works to" in note) == (name == "batch 4"), note
  assert shares == {
    "batch 2": (45.2, 53.4, exchange_beside(4)),
    "batch 4": (63.9, 61.9, EXCHANGE_BESIDE_OVER_LIMIT.value),
  }
