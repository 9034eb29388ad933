"""Pipeline stages in the planner, the step-time model and the layout search: a device's weights, the
pipeline loop's activations worked by hand, MaxText's bubble, the stage sends and per-iteration gathers,
the candidates, and a pipelined layout found, timed and written for DeepSeek-V3 671B on 32 H100 nodes."""

import dataclasses
import types

import pytest

from maxtext_moe.config import hardware
from maxtext_moe.config.hardware import GPUS
from maxtext_moe.planner import stages
from maxtext_moe.planner.estimate import _state_bytes
from maxtext_moe.planner.shards import shard_elements
from maxtext_moe.steptime import candidates, fsdp, stage_costs
from maxtext_moe.steptime import model as st

RULES = [("exp", ("expert",)), ("embed_moe", ("fsdp",)), ("embed", ("fsdp",)), ("mlp_moe", ()), ("mlp", ())]
RULES += [("moe_layers", ()), ("dense_layers", ()), ("layers", ("stage",)), ("vocab", ())]
SIZES = {"expert": 2, "fsdp": 2, "stage": 2}


def _cfg(**kw):
  """A DeepSeek-shaped config with 1 dense and 5 MoE layers, 4 of them in 2 stages (2 repeats)."""
  base = dict(
    using_pipeline_parallelism=True,
    ici_pipeline_parallelism=2,
    dcn_pipeline_parallelism=1,
    num_pipeline_microbatches=4,
    num_pipeline_repeats=2,
    pipeline_delay_activation_forwarding=False,
    num_layers_per_pipeline_stage=1,
    pipeline_parallel_layers=4,
    decoder_block="deepseek",
    num_decoder_layers=6,
    first_num_dense_layers=1,
    num_experts=8,
    mtp_num_layers=0,
    weight_dtype="float32",
    grad_dtype="float32",
    mu_dtype="float32",
    dtype="bfloat16",
    opt_type="adamw",
    param_scan_axis=1,
    scan_layers=True,
    emb_dim=64,
    remat_policy="full",
  )
  return types.SimpleNamespace(**(base | kw))


LEAVES = [
  (("params", "experts"), (8, 5, 64, 32), ("exp", "moe_layers", "embed_moe", "mlp_moe")),
  (("params", "dense_mlp"), (64, 1, 128), ("embed", "dense_layers", "mlp")),
  (("params", "embedding"), (100, 64), ("vocab", "embed")),
]


def test_a_device_stores_its_stages_layers_and_every_layer_outside_the_pipeline():
  """By hand: one MoE layer's experts split over EP 2 and FSDP 2 are 8/2 x 64/2 x 32 = 4,096 elements; a
  device stores its stage's 2 (4 pipelined / 2 stages) and the 1 MoE layer outside the pipeline whole; the
  dense layer and the embedding are not split over the stages."""
  pipe = stages.Stages.of(_cfg())
  assert (pipe.stages, pipe.repeats, pipe.per_stage, pipe.outside, pipe.stack) == (2, 2, 2, 1, "moe_layers")
  experts, dense, embedding = 4096 * 3, 32 * 128, 100 * 32
  params, optimizer, grads, scan_copy = _state_bytes(_cfg(), LEAVES, RULES, SIZES, pipe)
  assert params == grads == 4 * (experts + dense + embedding) and optimizer == 2 * params
  assert scan_copy == 4 * (4096 + dense)  # the scanned stacks outside the pipeline, re-laid out
  # without stages every MoE layer: 5 x 4,096
  assert _state_bytes(_cfg(), LEAVES, RULES, SIZES)[0] == 4 * (5 * 4096 + dense + embedding)
  # 2 stages of 2 layers each, nothing outside: the pipelined layers alone are halved
  two = stages.Stages.of(_cfg(num_decoder_layers=5, pipeline_parallel_layers=4))
  assert two.outside == 0 and stages.stored_elements(*LEAVES[0][1:], RULES, SIZES, two) == 2 * 4096


def test_the_pipeline_loop_keeps_its_stage_inputs_and_buffers():
  """S=2, M=4, R=2: 4 x 2 + 1 x (2 - 1) = 9 iterations. Under full remat each keeps the stage input and the
  layer input of a microbatch; the loop holds state_io (M / S = 2 microbatches), shift, and with R > 1 and
  M > S the circular storage (M microbatches) and its mover: 8 microbatches."""
  cfg = _cfg()
  pipe = stages.Stages.of(cfg)
  assert pipe.iterations == 9 and pipe.circular_storage
  assert pipe.bubble == pytest.approx(1 / 9)
  assert stages.loop_buffer_elements(pipe, 128, 64) == 8 * 128 * 64
  layer_input = 128 * 64 * 2
  assert stages.saved_per_iteration(cfg, layer_input, 128, 2) == 2 * layer_input
  # a custom policy keeps what it names; the stage input is not among MaxText's names
  custom = _cfg(remat_policy="custom")
  assert stages.saved_per_iteration(custom, 5 * layer_input, 128, 2) == 5 * layer_input
  # M = S: no circular storage (the last stage feeds the first directly); the delay adds prev_outputs
  assert not stages.Stages.of(_cfg(num_pipeline_microbatches=2)).circular_storage
  delayed = stages.Stages.of(_cfg(pipeline_delay_activation_forwarding=True))
  assert delayed.iterations == 10 and stages.loop_buffer_elements(delayed, 1, 1) == 2 + 1 + 1
  # a microbatch's tokens per device: 4 sequences of 16 over 4 microbatches, one each; 2 over 4: rounded up
  assert pipe.microbatch_tokens(4 * 16, 16) == 16 and pipe.microbatch_tokens(2 * 16, 16) == 16
  assert stages.outside_layer_counts(cfg, pipe) == (1, 1) and stages.outside_layer_counts(cfg, None) == (1, 5)


@pytest.mark.parametrize(("s", "m", "r", "delay"), [(2, 2, 1, 1), (4, 4, 14, 1), (8, 16, 7, 1), (4, 8, 14, 2)])
def test_the_bubble_is_maxtexts_share_of_the_pipelined_layers_time(s, m, r, delay):
  """MaxText runs M x R + delay x (S - 1) iterations, delay x (S - 1) of them the bubble's: that share of
  the pipelined layers' time, whose useful part is the compute times their share."""
  share = 0.9
  w = st.Workload("w", 1, 1.0, {"dense": 1e15}, {}, 0.0, [], 0.0, pipeline=st.Pipeline(s, r, m, delay, share))
  p = st.predict(w, GPUS["h100"])
  compute = sum(v for k, v in p.parts.items() if not k.startswith("exposed"))
  bubble = dict(p.exposed)["pipeline bubble"]
  assert bubble / (share * compute + bubble) == pytest.approx(delay * (s - 1) / (m * r + delay * (s - 1)))
  pipe = stages.Stages(s, m, r, delay, 1, s * r, "moe_layers", s * r)
  assert bubble / (share * compute + bubble) == pytest.approx(pipe.bubble)
  # Megatron's form is unchanged: (pp - 1) / (vpp x microbatches) of the whole compute
  megatron = st.Workload("w", 1, 1.0, {"dense": 1e15}, {}, 0.0, [], 0.0, pipeline=st.Pipeline(s, 1, m))
  megatron = st.predict(megatron, GPUS["h100"])
  assert dict(megatron.exposed)["pipeline bubble"] == pytest.approx(compute * (s - 1) / m)


def test_stage_sends_and_per_iteration_gathers():
  """Per iteration, forward and backward: a microbatch's activations to the next stage (waited for without
  the delay), state_io's and the circular storage's rotations beside the compute; over the network when
  the stages span domains. A pipelined layer's weights are gathered once per iteration."""
  cfg = _cfg()
  pipe = stages.Stages.of(cfg)
  one = 128 * 64 * 2  # 128 tokens x 64 x bf16
  shift, rotations = stage_costs.sends(cfg, pipe, {"stage": (1, 2)}, 128)
  assert (shift.kind, shift.wire_bytes, shift.count, shift.domains) == ("p2p", 18 * one, 18, 2)
  assert not shift.overlappable  # the next stage waits for it
  assert rotations.wire_bytes == 2 * 18 * one and rotations.overlappable and "over the network" in rotations.name
  delayed = _cfg(pipeline_delay_activation_forwarding=True)
  shift, _ = stage_costs.sends(delayed, stages.Stages.of(delayed), {"stage": (2, 1)}, 128)
  assert shift.overlappable and shift.count == 20 and "over NVLink" in shift.name  # 10 iterations
  assert stage_costs.sends(cfg, None, {}, 128) == []
  sides = {"expert": (2, 1), "fsdp": (2, 1), "stage": (2, 1)}
  rows = fsdp.param_splits(_cfg(dtype="bfloat16"), LEAVES[:1], RULES, sides, pipe)
  layer = 8 * 64 * 32 * 2 / 2  # one layer's experts in bf16, each device its 4 experts
  # 9 iterations of 1 layer; 2 layers stored; the last field: bytes on the wire per byte (1: gathered in bf16)
  assert rows[0] == (layer * 9, 2, 1, 9, layer / 2 * 2, False, 1.0)
  assert rows[1] == (layer, 2, 1, 1, layer / 2, True, 1.0)  # the layer outside, once
  # 2 layers per stage, one repeat: 4 + 1 iterations of 2 layers; a DeepSeek stack launches once per pass
  one_repeat = stages.Stages.of(_cfg(num_pipeline_repeats=1, num_layers_per_pipeline_stage=2))
  rows = fsdp.param_splits(_cfg(), LEAVES[:1], RULES, sides, one_repeat)
  assert rows[0] == (layer * 10, 2, 1, 5, layer / 2 * 2, False, 1.0)
  assert shard_elements((8, 64, 32), ("exp", "embed_moe", "mlp_moe"), RULES, SIZES) * 2 == layer / 2


def test_candidates_span_stages_and_microbatches():
  """671B on 32 H100 nodes (32 domains of 8): 2 stages take all 58 MoE layers, 4 and 8 take 56 (2 run before
  the pipeline), in one repeat (the search times the others once a layout fits: `fitting._schedules`); the
  domains left over go data, FSDP or FSDP 2 x data; a model without MoE layers to pipeline gets none."""
  found = candidates.layouts(hardware.GPUS["h100"], 32, 256, moe_layers=58)
  staged = {(c.stages, c.repeats, c.pipelined, c.microbatches) for c in found if c.stages > 1}
  assert staged == {(2, 1, 58, 2), (4, 1, 56, 4), (8, 1, 56, 8)}
  circular = dataclasses.replace(next(c for c in found if c.stages == 8), repeats=4, pipelined=32, microbatches=8)
  assert "num_layers_per_pipeline_stage=1" in circular.overrides() and circular.bubble == pytest.approx(7 / (32 + 7))
  assert {(c.dcn_fsdp, c.dcn_data) for c in found if c.stages == 8 and c.dcn_ep == 1} == {(1, 4), (4, 1), (2, 2)}
  assert {(c.dcn_ep, c.dcn_fsdp, c.dcn_data) for c in found if c.stages == 8 and c.dcn_ep > 1} == {
    (2, 1, 2),
    (2, 2, 1),
    (4, 1, 1),
  }  # EP across the domains of a stage too
  assert all(c.stages * c.dcn_ep * c.dcn_fsdp * c.dcn_data == 32 for c in found)
  assert not [c for c in candidates.layouts(hardware.GPUS["h100"], 32, 256) if c.stages > 1]
  lay = next(c for c in found if c.stages == 4)
  assert {"dcn_pipeline_parallelism=4", "pipeline_parallel_layers=56"} <= set(lay.overrides())
  # one repeat: a stage runs its 14 layers per visit
  assert "num_layers_per_pipeline_stage=14" in lay.overrides() and lay.bubble == pytest.approx(3 / (4 + 3))
  # a microbatch keeps a whole sequence per batch shard: 4 sequences per shard take 4 microbatches only
  assert candidates.microbatch_counts(4, 4) == [4] and candidates.microbatch_counts(4, 16) == [4, 8, 16]


def _staged_against_flat(model: list[str], staged: list[str], stack_name: str):
  """cpu/deepseek3-tiny (+ `model`) on 8 devices, FSDP 4 with 2 stages (+ `staged`) and FSDP 4 x data 2:
  (the staged config, its estimate, the flat one's, one device's shard of the stack `stack_name` flat)."""
  from maxtext_moe.planner.planning import estimate_of, planning, resolved

  ctx, _ = planning("cpu/deepseek3-tiny", model, None, None)  # the parameter tree, traced once
  staged_cfg = resolved(ctx.path, [*ctx.base_overrides, "ici_pipeline_parallelism=2", *staged])
  flat_cfg = resolved(ctx.path, [*ctx.base_overrides, "ici_data_parallelism=2"])
  (staged_est, _), (flat, _) = estimate_of(ctx, staged_cfg, []), estimate_of(ctx, flat_cfg, [])
  rules = [(n, tuple(a) if isinstance(a, list) else a) for n, a in flat_cfg.logical_axis_rules]
  sizes = {"fsdp": 4, "data": 2}
  leaves = (leaf for leaf in ctx.leaves if leaf[0][0] == "params" and stack_name in leaf[2])
  return staged_cfg, staged_est, flat, sum(shard_elements(shape, names, rules, sizes) for _, shape, names in leaves)


def test_the_tiny_models_plan_with_stages_against_the_same_split_without():
  """cpu/deepseek3-tiny (1 dense + 3 MoE layers) on 8 devices, FSDP 4 with 2 stages (2 MoE layers pipelined,
  1 before the pipeline) against FSDP 4 x data 2: the same split of every weight but the MoE stack, of
  which a device stores 2 layers of 3 with stages; the pipeline keeps, per each of its 2 x 1 + 1 iterations,
  a microbatch's stage input and layer input (full remat): 64 sequences of 256 tokens over FSDP 4 in 2
  microbatches, float32."""
  staged_cfg, staged, flat, stack = _staged_against_flat([], ["pipeline_parallel_layers=2"], "moe_layers")
  assert stack > 0 and flat.params - staged.params == 4 * stack // 3
  assert (staged.stages, staged.microbatches, staged.iterations) == (2, 2, 3)
  assert staged.microbatch_tokens == 64 * 256 // 4 // 2 and staged.tokens_per_step == flat.tokens_per_step
  assert staged.pipeline_saved == 3 * 2 * staged.microbatch_tokens * 64 * 4
  assert int(staged_cfg.num_pipeline_repeats) == 1 and staged.peak_layer


def test_a_qwen3_moe_model_plans_its_layers_stack_over_the_stages():
  """A 4-layer Qwen3-MoE on 8 devices, FSDP 4 with 2 stages x 2 repeats (every layer pipelined: its `layers`
  stack, no layer before the pipeline) against FSDP 4 x data 2: a device stores half the stack, and the
  loop runs 2 x 2 + 1 iterations."""
  model = ["model_name=qwen3-moe-from-hf", "override_model_config=true", "base_num_decoder_layers=4"]
  model += ["base_emb_dim=64", "base_num_query_heads=4", "base_num_kv_heads=2", "head_dim=16", "base_mlp_dim=96"]
  model += ["base_moe_mlp_dim=32", "num_experts=16", "num_experts_per_tok=4", "vocab_size=32000"]
  staged_cfg, staged, flat, stack = _staged_against_flat(model, [], "layers")
  assert stack > 0 and flat.params - staged.params == 4 * stack // 2
  assert int(staged_cfg.num_pipeline_repeats) == 2 and (staged.stages, staged.iterations) == (2, 5)


@pytest.mark.ci
def test_the_search_ranks_pipelined_671b_layouts_on_32_h100_nodes_and_writes_one(monkeypatch, tmp_path):
  """The candidates cut to EP 4 x FSDP 2 with FSDP across the domains left, full remat, with and without
  stages (the whole search takes minutes): pipelined layouts are resolved, planned, timed and ranked beside
  the one without stages, the table shows their stages and microbatches, and the fastest pipelined one
  written as a recipe resolves in MaxText with its pipeline keys and times as the search timed it. 2 and 4
  stages fit at batch 1 with the optimizer state on the host (64.5 and 69.8 GiB of 72.8: the bounded rounds
  run under stages, no worst-case exchange buffers); 8 do not: they split the weights before the pipeline
  over fewer FSDP ways and keep more microbatches' inputs, and MaxText's step brings the offloaded
  parameters back to the device (73.6 GiB with them offloaded)."""
  from rich.console import Console

  from maxtext_moe.planner.planning import resolved
  from maxtext_moe.steptime import search
  from maxtext_moe.steptime.recipe import for_recipe

  every = candidates.layouts

  def few(gpu, nodes, experts, *, moe_layers=0, routing_groups=0, tensor=(1,)):
    cands = every(gpu, nodes, experts, moe_layers=moe_layers, routing_groups=routing_groups, tensor=tensor)
    return [c for c in cands if c.ep == 4 and c.dcn_ep == 1 and c.dcn_data == 1 and c.remat == "full"]

  monkeypatch.setattr(search, "layouts", few)
  base = search.base_of("deepseek3-671b", "h100", 32, [])
  found, tried, ctx = search.search(base)
  assert ctx.num_devices == 256 and 0 < len(found) <= tried
  assert {f.layout.stages for f in found} == {1, 2, 4}, [f.row() for f in found]
  assert found == search.ranked(found, ctx.hbm_gib)
  staged = next(f for f in found if f.layout.stages > 1)
  row = staged.row()
  assert row["pipeline_parallel_layers"] in (56, 58) and row["microbatches"] % row["stages"] == 0
  console = Console(record=True, width=300)
  console.print(search.table(found, top=len(found), title="t"))
  text = console.export_text()
  assert "stages" in text and "microbatches" in text and "bubble)" in text
  recipe = tmp_path / "staged.yml"
  recipe.write_text(search.recipe_text(base, staged, command="test", hbm_gib=ctx.hbm_gib))
  cfg = resolved(recipe, [])
  lay = staged.layout
  assert cfg.using_pipeline_parallelism and int(cfg.num_pipeline_repeats) == lay.repeats
  assert (int(cfg.dcn_pipeline_parallelism), int(cfg.ici_pipeline_parallelism)) == (lay.stages, 1)
  assert (int(cfg.num_pipeline_microbatches), int(cfg.pipeline_parallel_layers)) == (lay.microbatches, lay.pipelined)
  timed = for_recipe(str(recipe), [])
  assert timed.tokens_per_s_per_gpu == pytest.approx(staged.prediction.tokens_per_s_per_gpu, rel=1e-3)
  assert "pipeline bubble" in dict(timed.exposed) and any("stage sends" in k for k in timed.parts)


@pytest.mark.ci  # kept out of the README suite's 10 minutes; CI runs the ci tier
def test_a_qwen3_decoder_with_layers_left_after_the_pipeline_is_planned_and_its_schedules_searched():
  """Qwen3-235B-A22B's 94 layers on 8 stages (88 pipelined, 6 after the pipeline; the stack traced without
  stages is not what `stage` splits) plans; the search times the layout in 1, 2 and 4 repeats, each
  pipelining the largest multiple of stages x repeats, at every microbatch count that keeps whole
  sequences."""
  from maxtext_moe.planner.memory_plan import memory_plan
  from maxtext_moe.planner.planning import planning, resolved
  from maxtext_moe.steptime import fitting

  staged = ["ici_expert_parallelism=8", "ici_fsdp_parallelism=1", "dcn_fsdp_parallelism=1", "dcn_data_parallelism=1"]
  staged += ["dcn_pipeline_parallelism=8", "pipeline_parallel_layers=88", "num_layers_per_pipeline_stage=11"]
  staged += ["num_pipeline_microbatches=8", "per_device_batch_size=1"]
  plan = memory_plan("h100x8/qwen3-235b-a22b", staged)
  assert plan.base.stages == 8 and plan.layout == {"stage": 8, "expert": 8}
  ctx, _ = planning("h100x8/qwen3-235b-a22b", staged, None, None)
  cand = resolved(ctx.path, ctx.base_overrides)
  layout = candidates.Layout(8, 1, 1, 1, "full", 1, "none", 8, 88, 8)
  found = {(s.repeats, s.pipelined, s.per_stage, s.microbatches) for s in fitting._schedules(ctx, layout, cand)}
  # 8 sequences per shard take 8 microbatches only; one repeat at 8 is the layout already timed
  assert found == {(2, 80, 5, 8), (4, 64, 2, 8)}
