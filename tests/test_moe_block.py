"""The MoE block's parity ladder on 8 fake CPU devices: identity, loop reference, EP=1 vs EP>1."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from maxtext_moe.moe.block import moe_block, routed_experts
from maxtext_moe.moe.collectives import ragged_all_to_all_reference
from maxtext_moe.moe.dispatch import LocalDispatcher, Routing
from maxtext_moe.moe.registry import DispatchSpec, make_dispatcher
from maxtext_moe.moe.settings import BufferMode, DispatchKind, MoESettings

T, D, F, E, K = 64, 16, 24, 8, 3
TOL = {"rtol": 1e-5, "atol": 1e-5}


def _weights(seed=0):
  k = jax.random.split(jax.random.PRNGKey(seed), 3)
  return (
    jax.random.normal(k[0], (E, D, F)) / 4,
    jax.random.normal(k[1], (E, D, F)) / 4,
    jax.random.normal(k[2], (E, F, D)) / 4,
  )


def _tokens(routing="random", seed=1):
  kx, ki, kw = jax.random.split(jax.random.PRNGKey(seed), 3)
  x = jax.random.normal(kx, (T, D))
  if routing == "random":
    ids = jnp.argsort(jax.random.uniform(ki, (T, E)), axis=-1)[:, :K]  # K distinct experts per token
  elif routing == "one_expert":
    ids = jnp.broadcast_to(jnp.array([5, 2, 7]), (T, K))  # every token's first choice is expert 5
    ids = ids.at[:, 0].set(5)
  elif routing == "one_rank":
    # experts 6 and 7 only: the last rank at EP <= 4
    ids = jnp.stack([jnp.full((T,), 6), jnp.full((T,), 7), jnp.where(jnp.arange(T) % 2 == 0, 6, 7)], -1)
  weights = jax.nn.softmax(jax.random.normal(kw, (T, K)), axis=-1)
  return x, ids.astype(jnp.int32), weights


def _reference(x, ids, weights, w0, w1, wo):
  """Plain per-token, per-expert loop."""
  out = []
  for t in range(x.shape[0]):
    acc = jnp.zeros((D,))
    for k in range(ids.shape[1]):
      e = int(ids[t, k])
      acc = acc + weights[t, k] * ((jax.nn.silu(x[t] @ w0[e]) * (x[t] @ w1[e])) @ wo[e])
    out.append(acc)
  return jnp.stack(out)


def _mesh(ep):
  devices = np.array(jax.devices()[:8]).reshape(8 // ep, ep)
  return Mesh(devices, ("data", "expert"))


@functools.cache
def _block(ep, dispatch=DispatchKind.AUTO, cf=0.0, bf=0.0):
  settings = MoESettings(
    dispatch=dispatch,
    capacity_factor=cf,
    buffers=BufferMode.BOUNDED if bf else BufferMode.WORST_CASE,
    buffer_factor=bf or 1.0,
    window_sizes=(2, 8),
    ragged_exchange=ragged_all_to_all_reference,
  )
  return jax.jit(functools.partial(moe_block, mesh=_mesh(ep), expert_axis="expert", settings=settings))


def _run(x, ids, weights, w, *, ep, dispatch=DispatchKind.AUTO, cf=0.0, bf=0.0):
  return _block(ep, dispatch, cf, bf)(x, ids, weights, *w)


def test_dispatch_then_combine_is_identity_with_gradients():
  x, ids, _ = _tokens()
  uniform = jnp.full((T, K), 1.0 / K)
  disp = LocalDispatcher(E)

  def roundtrip(x):
    rows, _, meta = disp.dispatch(x, Routing(ids, uniform))
    return disp.combine(rows, meta)

  np.testing.assert_allclose(roundtrip(x), x, **TOL)
  g = jax.grad(lambda x: jnp.sum(roundtrip(x) * jnp.arange(D)))(x)
  np.testing.assert_allclose(g, jnp.broadcast_to(jnp.arange(D, dtype=x.dtype), x.shape), **TOL)


@dataclasses.dataclass(frozen=True)
class _IdentityExperts:
  """Experts that return their rows (`dispatch.Experts`; rows past the groups must come back as zeros)."""

  weights: tuple = ()

  def __call__(self, rows_RD, group_sizes_E):
    return jnp.where((jnp.arange(rows_RD.shape[0]) < jnp.sum(group_sizes_E))[:, None], rows_RD, 0)

  def with_weights(self, weights):
    return self


_EVERY_DISPATCHER = [
  (DispatchKind.LOCAL, BufferMode.WORST_CASE, 1),
  *(
    (kind, buffers, ep)
    for kind in (DispatchKind.ALL_TO_ALL, DispatchKind.RAGGED_ALL_TO_ALL)
    for buffers in BufferMode
    for ep in (2, 8)
  ),
]


@pytest.mark.parametrize("kind,buffers,ep", _EVERY_DISPATCHER, ids=lambda v: str(v))
def test_every_dispatcher_is_the_identity_with_identity_experts(kind, buffers, ep):
  """Dispatch -> identity experts -> combine gives each token back (routing weights sum to 1), gradients
  included, for every dispatcher the registry makes on CPU (te_ep needs GPUs: tests/gpu_ep_worker.py)."""
  x, ids, _ = _tokens("one_expert")  # skewed: bounded buffers take several rounds
  uniform = jnp.full((T, K), 1.0 / K)
  mesh = _mesh(ep)
  settings = MoESettings(dispatch=kind, buffers=buffers, buffer_factor=0.5, ragged_exchange=ragged_all_to_all_reference)
  dispatcher = make_dispatcher(
    DispatchSpec(dataclasses.replace(settings, top_k=K), E, mesh, "expert", ("data", "expert"), T // 8)
  )
  assert not dispatcher.mesh_level

  def per_device(x, ids, w):
    return dispatcher.run(x, Routing(ids, w), _IdentityExperts())[0]

  tok = P(("data", "expert"))
  roundtrip = jax.jit(jax.shard_map(per_device, mesh=mesh, in_specs=(tok, tok, tok), out_specs=tok, check_vma=False))
  np.testing.assert_allclose(roundtrip(x, ids, uniform), x, **TOL)
  g = jax.grad(lambda x: jnp.sum(roundtrip(x, ids, uniform) * jnp.arange(D)))(x)
  np.testing.assert_allclose(g, jnp.broadcast_to(jnp.arange(D, dtype=x.dtype), x.shape), **TOL)


@pytest.mark.parametrize("routing", ["random", "one_expert", "one_rank"])
def test_local_layer_matches_loop_reference(routing):
  x, ids, weights = _tokens(routing)
  w = _weights()
  run = jax.jit(
    functools.partial(routed_experts, dispatcher=LocalDispatcher(E), settings=MoESettings(window_sizes=(2, 8)))
  )
  y, _ = run(x, ids, weights, *w)
  np.testing.assert_allclose(y, _reference(x, ids, weights, *w), **TOL)


def _rounds_needed(ids, *, ep, bf):
  """What bounded EP must run, counted directly: tokens are split over the 8 devices in order; each
  device's (row, local expert) pairs for each rank, over the per-round budget ceil(bf x T_dev x K / EP)."""
  ids = np.asarray(ids).reshape(8, -1, K)
  budget = max(K, int(np.ceil(bf * ids.shape[1] * K / ep)))
  pairs = np.stack([np.bincount((shard // (E // ep)).ravel(), minlength=ep) for shard in ids])
  return int(np.ceil(pairs / budget).max())


def _ep_cases() -> list:
  """Every EP degree x routing x dispatcher x buffer mode. The default suite runs EP=8 (the most rounds)
  with bounded buffers, and worst-case buffers on random routing; the rest is `pytest -m extended`."""
  cases = []
  for ep in (2, 4, 8):
    for routing in ("random", "one_expert", "one_rank"):
      for dispatch in (DispatchKind.ALL_TO_ALL, DispatchKind.RAGGED_ALL_TO_ALL):
        for bf, name in ((0.0, "worst_case"), (2.0, "bounded")):
          default = ep == 8 and (bf or routing == "random")
          marks = () if default else (pytest.mark.extended,)
          cases.append(pytest.param(ep, routing, dispatch, bf, marks=marks, id=f"{ep}-{routing}-{dispatch}-{name}"))
  return cases


@pytest.mark.parametrize(("ep", "routing", "dispatch", "bf"), _ep_cases())
def test_expert_parallel_matches_ep1_forward_and_gradients(ep, routing, dispatch, bf):
  """Worst-case buffers and bounded ones (moe_buffer_factor: rounds) give EP=1's outputs and gradients for
  natural and adversarial routing; the adversarial cases take more than one round and drop nothing."""
  x, ids, weights = _tokens(routing)
  w = _weights()

  def loss(ep):
    def f(x, weights, w0, w1, wo):
      kind = dispatch if ep > 1 else DispatchKind.LOCAL
      y, _ = _run(x, ids, weights, (w0, w1, wo), ep=ep, dispatch=kind, bf=bf if ep > 1 else 0.0)
      return jnp.sum(y * jnp.cos(jnp.arange(D)))

    return f

  ref_y, _ = _run(x, ids, weights, w, ep=1, dispatch=DispatchKind.LOCAL)
  got_y, stats = _run(x, ids, weights, w, ep=ep, dispatch=dispatch, bf=bf)
  if bf:
    assert float(stats["rounds"]) == _rounds_needed(ids, ep=ep, bf=bf)
    if routing == "one_rank" and ep >= 4 or ep == 8 and routing != "random":
      assert float(stats["rounds"]) > 1, "the adversarial cases must take more than one round here"
  np.testing.assert_allclose(got_y, ref_y, **TOL)
  np.testing.assert_allclose(ref_y, _reference(x, ids, weights, *w), rtol=1e-4, atol=1e-4)
  grads_ref = jax.jit(jax.grad(loss(1), argnums=(0, 1, 2, 3, 4)))(x, weights, *w)
  grads_ep = jax.jit(jax.grad(loss(ep), argnums=(0, 1, 2, 3, 4)))(x, weights, *w)
  for a, b in zip(grads_ep, grads_ref, strict=True):
    np.testing.assert_allclose(a, b, **TOL)
  assert float(stats["dropped"]) == 0.0, "dropless"
  assert float(stats["load"].sum()) == T * K


@pytest.mark.parametrize("dispatch", [DispatchKind.ALL_TO_ALL, DispatchKind.RAGGED_ALL_TO_ALL])
@pytest.mark.parametrize("ep", [2, 4, 8])
def test_dedup_rows_equal_distinct_destination_ranks(ep, dispatch):
  x, ids, weights = _tokens()
  _, stats = _run(x, ids, weights, _weights(), ep=ep, dispatch=dispatch)
  distinct = sum(len({int(e) // (E // ep) for e in row}) for row in np.asarray(ids))
  assert float(stats["rows_sent"]) == distinct
  assert float(stats["rows_sent_no_dedup"]) == T * K
  if E // ep > 1:  # with one expert per rank there is nothing to deduplicate
    assert distinct < T * K


def test_capacity_overflow_is_counted_not_silent():
  x, ids, weights = _tokens("one_rank")
  _, stats = _run(x, ids, weights, _weights(), ep=4, cf=0.5)
  # Every token needs only the last rank; capacity ceil(0.5 * 8 * 3 / 4) = 3 of each device's 8 tokens fit.
  assert float(stats["dropped"]) == 8 * (8 - 3) * K


def test_ragged_refuses_capacity():
  x, ids, weights = _tokens()
  with pytest.raises(ValueError, match="always dropless"):
    _run(x, ids, weights, _weights(), ep=2, dispatch=DispatchKind.RAGGED_ALL_TO_ALL, cf=1.0)


def test_real_ragged_all_to_all_traces_through_forward_and_backward():
  """XLA:CPU cannot compile the real op, but tracing and lowering the gradient checks our arguments
  against its abstract-eval and transpose rules; the lowered module must contain the collective."""
  x, ids, weights = _tokens()
  settings = MoESettings(dispatch=DispatchKind.RAGGED_ALL_TO_ALL, window_sizes=(2, 8))
  block = functools.partial(moe_block, mesh=_mesh(4), expert_axis="expert", settings=settings)

  def loss(x, w0, w1, wo):
    return jnp.sum(block(x, ids, weights, w0, w1, wo)[0])

  text = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3))).lower(x, *_weights()).as_text()
  # dispatch (x, ids, weights), combine, and the transposes that carry cotangents back
  assert text.count("custom_call @ragged_all_to_all") >= 4


def test_bounded_rounds_under_the_stages_vmap_run_each_stages_own_rounds():
  """MaxText's pipeline runs a stage's layers under `vmap(spmd_axis_name="stage")`. There the rounds
  (round 0, then a loop while some rank needs more) run each stage's own count: stage 0's natural
  routing one round, stage 1's adversarial routing several, with each stage's outputs and gradients those
  of the block on that stage alone; and no conditional, which the vmap would turn into a select that runs
  and keeps every round."""
  mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("stage", "expert"))
  sub = Mesh(np.array(jax.devices()[:4]), ("expert",))
  settings = MoESettings(
    dispatch=DispatchKind.ALL_TO_ALL, buffers=BufferMode.BOUNDED, buffer_factor=2.0, window_sizes=(2, 8)
  )
  stages = [_tokens("random"), _tokens("one_rank")]
  x, ids, weights = (jnp.stack(a) for a in zip(*stages, strict=True))
  w = tuple(jnp.stack([a, a * 0.5]) for a in _weights())

  def stage(x, ids, weights, *w):
    return moe_block(x, ids, weights, *w, mesh=mesh, expert_axis="expert", settings=settings, vmapped_axes=("stage",))

  def loss(fn):
    def f(x, weights, *w):
      return jnp.sum(fn(x, ids, weights, *w)[0] * jnp.cos(jnp.arange(D)))

    return jax.grad(f, argnums=(0, 1, 2, 3, 4))

  vmapped = jax.vmap(stage, spmd_axis_name="stage")
  with jax.set_mesh(mesh):
    y, stats = jax.jit(vmapped)(x, ids, weights, *w)
    grads = jax.jit(loss(vmapped))(x, weights, *w)
    text = jax.jit(loss(vmapped)).lower(x, weights, *w).compile().as_text()
  assert " conditional(" not in text and " while(" in text
  rounds = [float(r) for r in stats["rounds"]]
  assert rounds[0] == 1.0 and rounds[1] > 1.0, rounds
  for s_ in range(2):
    one = functools.partial(moe_block, mesh=sub, expert_axis="expert", settings=settings)
    want, want_stats = jax.jit(one)(x[s_], ids[s_], weights[s_], *(a[s_] for a in w))
    np.testing.assert_allclose(y[s_], want, **TOL)
    assert float(want_stats["rounds"]) == rounds[s_]

    def alone(x, weights, *w, s_=s_, one=one):
      return jnp.sum(one(x, ids[s_], weights, *w)[0] * jnp.cos(jnp.arange(D)))

    want_grads = jax.jit(jax.grad(alone, argnums=(0, 1, 2, 3, 4)))(x[s_], weights[s_], *(a[s_] for a in w))
    for a, b in zip(grads, want_grads, strict=True):
      np.testing.assert_allclose(a[s_], b, **TOL)


def _fsdp_mesh():
  return Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("data", "fsdp", "expert"))


@functools.cache
def _fsdp_block(specs):
  settings = MoESettings(dispatch=DispatchKind.ALL_TO_ALL, window_sizes=(2, 8))
  block = functools.partial(moe_block, mesh=_fsdp_mesh(), expert_axis="expert", settings=settings)
  return jax.jit(functools.partial(block, weight_specs=specs) if specs else block)


def test_weights_stored_split_over_fsdp_are_gathered_in_the_block_and_their_gradients_reduce_scattered():
  """Expert weights stored over (expert, fsdp) are taken so and gathered inside the block: the outputs and
  every gradient are EP=1's, and the compiled step reduce-scatters the weights' gradients over fsdp (an
  all-reduce over data of the shard) where taking them replicated all-reduced the whole gradient over every
  token axis."""
  x, ids, weights = _tokens()
  w = _weights()
  specs = (P("expert", "fsdp", None), P("expert", "fsdp", None), P("expert", None, "fsdp"))
  mesh = _fsdp_mesh()
  stored = [jax.device_put(a, jax.sharding.NamedSharding(mesh, s)) for a, s in zip(w, specs, strict=True)]

  def loss(block):
    def f(x, weights, w0, w1, wo):
      return jnp.sum(block(x, ids, weights, w0, w1, wo)[0] * jnp.cos(jnp.arange(D)))

    return f

  ref = jax.jit(functools.partial(moe_block, mesh=_mesh(1), expert_axis=None, settings=MoESettings()))
  ref_y, _ = ref(x, ids, weights, *w)
  got_y, _ = _fsdp_block(specs)(x, ids, weights, *stored)
  np.testing.assert_allclose(got_y, ref_y, **TOL)
  grads_ref = jax.grad(loss(ref), argnums=(0, 1, 2, 3, 4))(x, weights, *w)
  step = jax.jit(jax.grad(loss(_fsdp_block(specs)), argnums=(0, 1, 2, 3, 4)))
  grads = step(x, weights, *stored)
  for a, b in zip(grads, grads_ref, strict=True):
    np.testing.assert_allclose(a, b, **TOL)
  for g, s in zip(grads[2:], specs, strict=True):
    stored_so = jax.sharding.NamedSharding(mesh, s)
    assert g.sharding.is_equivalent_to(stored_so, g.ndim), "the gradient leaves the block split as stored"
  hlo = step.lower(x, weights, *stored).compile().as_text()
  old = jax.jit(jax.grad(loss(_fsdp_block(None)), argnums=(2, 3, 4))).lower(x, weights, *stored).compile().as_text()
  whole = f"f32[{E // 2},{D},{F}]"  # one expert rank's whole kernel
  assert "reduce-scatter(" in hlo and not any("all-reduce(" in ln and whole in ln for ln in hlo.splitlines())
  assert any("all-reduce(" in ln and whole in ln for ln in old.splitlines()), "the replicated intake all-reduced it"


def _tp_mesh():
  return Mesh(np.array(jax.devices()[:8]).reshape(2, 2, 2), ("data", "tensor", "expert"))


def test_tokens_are_split_first_over_the_axes_they_arrive_split_over():
  """With tensor parallelism between data and expert in the mesh, tokens that arrive split over (data,
  expert) and D over tensor (MaxText's activations) are split by the block over (data, expert, tensor) with
  `token_order`: entering it is a slice of what each device holds, one all-to-all over tensor; in the mesh's
  order (data, tensor, expert) it is a permutation across the batch's devices besides. The outputs and
  gradients are the same either way."""
  from maxtext_moe.moe.block import _token_axes  # pylint: disable=import-outside-toplevel

  mesh = _tp_mesh()
  assert _token_axes(mesh, T, (), ("data", "fsdp", "expert")) == ("data", "expert", "tensor")
  assert _token_axes(mesh, T, ("data",), ("data", "expert")) == ("expert", "tensor")
  assert _token_axes(mesh, T) == ("data", "tensor", "expert")
  x, ids, weights = _tokens()
  w = _weights()
  arrive = jax.sharding.NamedSharding(mesh, P(("data", "expert"), "tensor"))
  x = jax.device_put(x, arrive)
  settings = MoESettings(dispatch=DispatchKind.ALL_TO_ALL, window_sizes=(2, 8))

  def step(order):
    block = functools.partial(moe_block, mesh=mesh, expert_axis="expert", settings=settings, token_order=order)

    def loss(x, *w):
      y = jax.lax.with_sharding_constraint(block(x, ids, weights, *w)[0], arrive)
      return jnp.sum(y * jnp.cos(jnp.arange(D)))

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3)))

  compiled = {order: step(order).lower(x, *w).compile() for order in (("data", "expert"), ())}
  got, want = (compiled[order](x, *w) for order in (("data", "expert"), ()))
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(a, b, **TOL)
  permutes = {order: c.as_text().count("collective-permute(") for order, c in compiled.items()}
  assert permutes[("data", "expert")] == 0 < permutes[()], permutes
