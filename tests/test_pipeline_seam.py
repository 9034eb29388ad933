"""Groundwork for MaxText's pipeline stages with MoE layers: which iterations are the bubble's (checked
against MaxText's own schedule), folding per-iteration records into layers, the biases of all MoE layers
as one, and the block under the stages' vmap on 8 fake CPU devices."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import linen as nn
from flax import nnx
from jax.sharding import Mesh
from maxtext.common.common_types import ShardMode
from maxtext.layers import pipeline as mt_pipeline

from maxtext_moe.moe.block import moe_block
from maxtext_moe.moe.settings import DispatchKind, MoESettings
from maxtext_moe.upstream.patches import installed
from maxtext_moe.upstream.pipeline import moe_stages as pipeline
from maxtext_moe.upstream.pipeline import records as stage_records

SCHEDULES = [(2, 2, 1, 1), (2, 4, 1, 1), (4, 4, 1, 1), (2, 2, 3, 1), (4, 8, 2, 1), (2, 4, 1, 2), (3, 6, 2, 2)]


@pytest.mark.parametrize("stages,micro,repeats,delay", SCHEDULES)
def test_slots_follow_maxtexts_schedule(stages, micro, repeats, delay):
  """Each real (repeat, stage) slot gets its M microbatches, at the repeat MaxText's pipeline itself
  computes for that iteration and stage; everything else is the bubble."""
  s = pipeline.Schedule(stages, micro, repeats, delay)
  mesh = Mesh(np.array(jax.devices()[:1]), ("stage",))
  fake = types.SimpleNamespace(
    forwarding_delay=delay,
    num_stages=stages,
    mesh=mesh,
    config=types.SimpleNamespace(num_pipeline_microbatches=micro),
    _maybe_shard_with_name=lambda x, _sharding: x,
  )
  slots = s.slots()
  assert slots.shape == (micro * repeats + delay * (stages - 1), stages)
  for t in range(slots.shape[0]):
    _, repeat_ids = mt_pipeline.PipelineBase.get_microbatch_and_repeat_ids(fake, t)
    real = slots[t] < repeats * stages
    np.testing.assert_array_equal(slots[t][real], np.asarray(repeat_ids)[real] * stages + np.arange(stages)[real])
  counts = np.bincount(slots.reshape(-1), minlength=repeats * stages + 1)
  assert list(counts[:-1]) == [micro] * (repeats * stages)
  assert counts[-1] == slots.size - micro * repeats * stages  # the bubble


@pytest.mark.parametrize("stages,micro,repeats,delay", [*SCHEDULES, (8, 64, 7, 1)])
def test_the_outputs_are_put_back_in_order_by_a_rotation_whose_backward_scatters_nothing(stages, micro, repeats, delay):
  """MaxText's pipeline puts its outputs back in microbatch order with a gather by a permutation; ours is the
  rotation that permutation is (MaxText's own `realign_output_microbatches`): the same values, and a backward
  with no scatter-add (which XLA:GPU ran on the whole output buffer, all-reduced over the stages)."""
  from maxtext_moe.upstream.patches import original

  base = mt_pipeline.PipelineBase
  fake = types.SimpleNamespace(
    forwarding_delay=delay,
    num_stages=stages,
    microbatches_per_stage=micro // stages,
    state_io_logical=None,
    config=types.SimpleNamespace(num_pipeline_microbatches=micro, num_pipeline_repeats=repeats),
    _maybe_shard_with_logical=lambda x, _axes: x,
  )
  for name in ("iterations_to_complete_first_microbatch", "iterations_to_complete_first_microbatch_one_repeat"):
    setattr(fake, name, types.MethodType(getattr(base, name), fake))
  fake.realign_output_microbatches = types.MethodType(base.realign_output_microbatches, fake)
  gather = original(base, "permute_output_micro_per_stage_dim")
  out = jnp.arange(stages * (micro // stages) * 3, dtype=jnp.float32).reshape(stages, micro // stages, 3)
  np.testing.assert_array_equal(pipeline.realigned_output(fake, out), gather(fake, out))

  def backward(f):
    return str(jax.make_jaxpr(lambda x, g: jax.vjp(lambda y: f(fake, y), x)[1](g))(out, out))

  assert "scatter-add" not in backward(pipeline.realigned_output)
  assert micro == stages or "scatter-add" in backward(gather)  # one microbatch per stage: nothing to permute


def test_fold_sums_real_iterations_and_drops_the_bubble():
  s = pipeline.Schedule(2, 2, 1, 1)  # T=3: stage 1 idles at t=0, stage 0 at t=2
  rec = jnp.arange(3 * 2 * 4, dtype=jnp.int32).reshape(3, 2, 4)
  want = np.stack([rec[0, 0] + rec[1, 0], rec[1, 1] + rec[2, 1]])
  np.testing.assert_array_equal(pipeline.fold(rec, s), want)
  np.testing.assert_array_equal(pipeline.fold(rec, s, largest=True), np.stack([rec[1, 0], rec[2, 1]]))
  with pytest.raises(ValueError, match=r"expected a \[3, 2, \.\.\.\] record"):
    pipeline.fold(rec[:2], s)


class _Recording(nnx.Module):
  """A pipeline stage that records, as an MoE layer does, a sum of its input per call."""

  def __init__(self, rngs: nnx.Rngs):
    self.w = nnx.Param(jax.random.normal(rngs.params(), (3,)))

  def __call__(self, x, segment_ids, positions, deterministic, model_mode):
    del segment_ids, positions, deterministic, model_mode
    self.sow(nnx.Intermediate, "record", jnp.sum(x, axis=(0, 1)))
    return jnp.tanh(x * self.w[...] + 1.0)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # NNX's sow outside nnx.capture, `with mesh`
@pytest.mark.parametrize("repeats,micro,delay", [(1, 2, False), (2, 2, False), (2, 4, False), (3, 4, True)])
def test_a_circular_pipeline_hands_out_each_iterations_records(repeats, micro, delay):
  """MaxText's own pipeline, 2 stages, the repeats of a circular one: what the layers record per iteration
  comes out [T, S, ...] and folds (`pipeline.fold`) into each layer's sum over the microbatches, and the
  output is the layers run one after another (MaxText alone stops on the records with repeats)."""
  s, d = 2, 3
  cfg = types.SimpleNamespace(
    ici_pipeline_parallelism=s,
    dcn_pipeline_parallelism=1,
    pipeline_delay_activation_forwarding=delay,
    micro_batch_size_to_train_on=micro,
    num_pipeline_microbatches=micro,
    num_pipeline_repeats=repeats,
    shard_mode=ShardMode.AUTO,
    max_target_length=2,
    emb_dim=d,
    scan_layers=False,
    pipeline_fsdp_ag_once=False,
    set_remat_policy_on_pipeline_iterations=True,
    scan_pipeline_iterations=True,
    remat_policy="full",
    debug_sharding=False,
    logical_axis_rules=[],
  )
  mesh = Mesh(np.array(jax.devices()[:s]), ("stage",))
  x = jax.random.normal(jax.random.PRNGKey(1), (micro, 2, d))
  with installed(stage_records.patches()), mesh, nn.partitioning.axis_rules([("activation_stage", "stage")]):
    pipe = mt_pipeline.NNXPipeline(cfg, _Recording, mesh, rngs=nnx.Rngs(0))
    y = pipe(x, None, None, True)
    (records,) = nnx.pop(pipe, nnx.Intermediate)["layers"]["record"].get_value()
  w = np.asarray(pipe.layers.w[...]).reshape(repeats * s, d)  # [(R,) S, D]: layer r*S + s
  want, want_y = np.zeros((repeats * s, d)), []
  for m in range(micro):
    h = np.asarray(x[m])
    for layer in range(repeats * s):
      want[layer] += h.sum(axis=0)
      h = np.tanh(h * w[layer] + 1.0)
    want_y.append(h)
  schedule = pipeline.Schedule(s, micro, repeats, 2 if delay else 1)
  assert records.shape == (schedule.iterations, s, d)
  np.testing.assert_allclose(pipeline.fold(records, schedule), want, rtol=1e-5)
  np.testing.assert_allclose(y, np.stack(want_y), rtol=1e-5)


def _cfg(**kw):
  base = dict(
    using_pipeline_parallelism=True,
    ici_pipeline_parallelism=2,
    dcn_pipeline_parallelism=1,
    num_pipeline_microbatches=2,
    num_pipeline_repeats=1,
    pipeline_delay_activation_forwarding=False,
    num_experts=4,
    routed_bias=True,
    routed_bias_update_rate=0.5,
    gradient_accumulation_steps=1,
  )
  return types.SimpleNamespace(**(base | kw))


def _aux(counts_TSE, outside_LE):
  key = pipeline.BIAS_UPDATES
  return {
    "intermediate_outputs": {
      "decoder": {
        "pipeline_module": {"layers": {key: (counts_TSE,)}},
        "moe_layers_outside_pipeline": {key: (outside_LE,)},
      }
    }
  }


@pytest.mark.parametrize("ga", [1, 4])
def test_bias_update_from_the_steps_counts_outside_layers_first(ga):
  """The pipelined layers' counts are summed over the step's real iterations before the one sign update
  (a sign per microbatch, summed, is a different update); gradient accumulation gets the counts."""
  counts = jnp.array(
    [[[5, 1, 1, 1], [9, 9, 9, 9]], [[0, 6, 1, 1], [1, 1, 1, 5]], [[9, 9, 9, 9], [1, 1, 5, 1]]], jnp.int32
  )
  outside = jnp.array([[0.5, -0.5, 0.5, -0.5]], jnp.float32) if ga == 1 else jnp.array([[3, 1, 3, 1]], jnp.int32)
  out = pipeline.fold_aux(_aux(counts, outside), _cfg(gradient_accumulation_steps=ga))
  (signal,) = out["moe_bias_updates"]
  step_counts = np.array([[5, 7, 2, 2], [2, 2, 6, 6]])  # stage 0: t=0,1; stage 1: t=1,2
  if ga == 1:
    want = np.concatenate([np.asarray(outside), 0.5 * np.sign(step_counts.mean(1, keepdims=True) - step_counts)])
  else:
    want = np.concatenate([np.asarray(outside), step_counts])
  np.testing.assert_array_equal(np.asarray(signal), want)
  folded = out["intermediate_outputs"]["decoder"]["pipeline_module"]["layers"][pipeline.BIAS_UPDATES][0]
  np.testing.assert_array_equal(np.asarray(folded), step_counts)


def test_without_stages_aux_is_untouched():
  aux = _aux(jnp.zeros((3, 2, 4)), jnp.zeros((1, 4)))
  assert pipeline.fold_aux(aux, _cfg(using_pipeline_parallelism=False)) is aux


def test_bias_view_reads_and_writes_every_layer_in_order():
  a = nnx.Variable(jnp.zeros((1, 4)))
  b = nnx.Variable(jnp.ones((2, 1, 4)))
  view = pipeline.BiasView([a, b])
  np.testing.assert_array_equal(view.value, np.concatenate([np.zeros((1, 4)), np.ones((2, 4))]))
  view.value = view.value + jnp.arange(3, dtype=jnp.float32)[:, None]
  np.testing.assert_array_equal(a.get_value(), np.zeros((1, 4)))
  np.testing.assert_array_equal(b.get_value(), np.array([[[2.0] * 4], [[3.0] * 4]]))


def test_stage_axis_is_vmapped_inside_the_pipeline_only():
  cfg = _cfg()
  with nn.partitioning.axis_rules((("activation_batch", ("data", "fsdp")),)):
    assert pipeline.vmapped_axes(cfg) == ("stage",)
  with nn.partitioning.axis_rules((("activation_batch", ("stage", "data", "fsdp")),)):  # outside: PP acts as DP
    assert pipeline.vmapped_axes(cfg) == ()
  assert pipeline.vmapped_axes(_cfg(using_pipeline_parallelism=False)) == ()


def test_mtp_block_runs_with_the_stage_axis_as_data(monkeypatch):
  """With stages, MaxText's multi-token prediction block (after the decoder, outside the pipeline) runs
  under the rules of the layers outside the pipeline: `stage` splits its tokens like `data`."""
  from maxtext.layers import multi_token_prediction as mt_mtp

  seen = []

  def probe(module, *args, **kwargs):
    rules = dict(nn.partitioning.get_axis_rules())
    seen.append((tuple(rules["activation_batch"]), pipeline.vmapped_axes(module.config), args, kwargs))
    return "out"

  monkeypatch.setattr(mt_mtp.MultiTokenPredictionBlock, "__call__", probe)
  rules = (("activation_batch", ("data", "fsdp")), ("activation_stage", "stage"))
  block = types.SimpleNamespace(config=_cfg(logical_axis_rules=rules))
  with nn.partitioning.axis_rules(rules):
    assert pipeline.mtp_call(block, 1, x=2) == "out"
    block.config = _cfg(logical_axis_rules=rules, using_pipeline_parallelism=False)
    assert pipeline.mtp_call(block, 1, x=2) == "out"
  assert seen == [(("stage", "data", "fsdp"), (), (1,), {"x": 2}), (("data", "fsdp"), (), (1,), {"x": 2})]


class _Layer(nnx.Module):
  """A layer with what MaxText's decoder layers have: a config, parameters, a sown intermediate."""

  def __init__(self, config, *, rngs):
    self.config = config
    self.w = nnx.Param(jax.random.normal(rngs.params(), (4, 4)))

  def __call__(self, x, scale, deterministic, model_mode):
    assert deterministic is True and model_mode == "train"
    y = jnp.tanh(x @ self.w[...]) * scale
    self.sow(nnx.Intermediate, "seen", jnp.sum(y))
    return y


def _stage_cfg(policy):
  return types.SimpleNamespace(remat_policy=policy, scan_layers=True, gradient_accumulation_steps=1, hardware="cpu")


@pytest.mark.parametrize("policy", ["full", "minimal"])
def test_a_stage_layer_rematted_on_its_own_computes_what_it_did(policy):
  """`stage_remat.rematted`: one subclass per layer class, the same parameter tree, the same output,
  gradients and sown values, and a checkpoint of its own with MaxText's per-layer policy (none saved
  under full remat) around a call whose input is named for the pipeline's policy."""
  from maxtext_moe.upstream.pipeline import remat as stage_remat

  sub = stage_remat.rematted(_Layer)
  assert stage_remat.rematted(_Layer) is sub and issubclass(sub, _Layer) and sub.__name__ == "_Layer"
  cfg = _stage_cfg(policy)
  plain, checked = _Layer(cfg, rngs=nnx.Rngs(0)), sub(cfg, rngs=nnx.Rngs(0))
  assert jax.tree.structure(nnx.state(plain)) == jax.tree.structure(nnx.state(checked))
  x, scale = jnp.arange(8.0).reshape(2, 4) / 8, jnp.float32(1.5)

  def loss(layer, x):
    return jnp.sum(layer(x, scale, True, "train") ** 2)

  (want, want_grads), (got, got_grads) = (nnx.value_and_grad(loss, argnums=(0, 1))(m, x) for m in (plain, checked))
  np.testing.assert_allclose(got, want, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads), strict=True):
    np.testing.assert_allclose(a, b, rtol=1e-6)
  sown = [nnx.state(m, nnx.Intermediate)["seen"][0] for m in (plain, checked)]
  np.testing.assert_allclose(sown[1], sown[0], rtol=1e-6)

  jaxpr = str(
    jax.make_jaxpr(lambda s, x: nnx.merge(nnx.graphdef(checked), s)(x, scale, True, "train"))(nnx.state(checked), x)
  )
  named, remat = jaxpr.find(f"name[name={stage_remat.LAYER_INPUT}]"), jaxpr.find("remat2[")
  assert 0 <= named < remat and jaxpr.count("remat2[") == 1, jaxpr
  assert ("policy=None" in jaxpr) == (policy == "full") == (stage_remat.layer_policy(cfg) is None), jaxpr


@pytest.mark.ci  # two compiles, about 33 s on 2 cores: the pipeline's training tests (ci) cover it end to end
@pytest.mark.parametrize("ep", [1, 2])
def test_block_under_the_stages_vmap_matches_each_stage_alone(ep):
  """The block inside MaxText's stage vmap (spmd_axis_name='stage') on stage 2 x fsdp 2 x expert EP: each
  stage's output equals the block run on that stage's tokens and weights alone."""
  mesh = Mesh(np.array(jax.devices()[: 4 * ep]).reshape(2, 2, ep), ("stage", "fsdp", "expert"))
  e, d, f, t, k = 4, 8, 12, 32, 2
  keys = jax.random.split(jax.random.PRNGKey(0), 5)
  x = jax.random.normal(keys[0], (2, t, d))
  ids = jnp.argsort(jax.random.uniform(keys[1], (2, t, e)), axis=-1)[..., :k].astype(jnp.int32)
  w = jax.nn.softmax(jax.random.normal(keys[2], (2, t, k)))
  w0, w1 = (jax.random.normal(kk, (2, e, d, f)) / 4 for kk in jax.random.split(keys[3]))
  wo = jax.random.normal(keys[4], (2, e, f, d)) / 4
  settings = MoESettings(dispatch=DispatchKind.AUTO)
  axis = "expert" if ep > 1 else None

  def stage(*args):
    return moe_block(*args, mesh=mesh, expert_axis=axis, settings=settings, vmapped_axes=("stage",))

  with mesh:
    y, stats = jax.jit(jax.vmap(stage, spmd_axis_name="stage"))(x, ids, w, w0, w1, wo)
  sub = Mesh(np.array(jax.devices()[: 2 * ep]).reshape(2, ep), ("fsdp", "expert"))
  for s in range(2):
    want, want_stats = moe_block(x[s], ids[s], w[s], w0[s], w1[s], wo[s], mesh=sub, expert_axis=axis, settings=settings)
    np.testing.assert_allclose(y[s], want, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(stats["load"][s], want_stats["load"])
