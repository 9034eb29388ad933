"""MaxText's model outside its trainer: the parameter tree, a forward pass from a checkpoint, one MoE layer.

- `param_leaves`: (path, shape, logical axes) of every parameter, from `jax.eval_shape` of MaxText's own
  init (nothing is allocated): what checkpoint conversion fills and the planner shards.
- `Forward` / `load_and_forward`: loads a parameter checkpoint with MaxText's `load_params_from_path` (what
  `load_parameters_path` runs in training) and returns logits, with our MoE block installed.
- `routed_moe_layer`: one MaxText `RoutedMoE` built from a config, for benchmarks.
"""

import contextlib
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.core.spmd import logical_axis_rules
from maxtext.common import checkpointing
from maxtext.layers import initializers
from maxtext.layers import moe as mt_moe
from maxtext.models import models
from maxtext.utils import maxtext_utils

from maxtext_moe.upstream import orbax
from maxtext_moe.upstream.maxtext import mesh, mla_norm, moe_layer, weights_load
from maxtext_moe.upstream.patches import Patch, installed
from maxtext_moe.upstream.pipeline import moe_stages as pipeline

# A one-device layout, for work that only traces shapes (checkpoint conversion, the planner's parameter tree).
ONE_DEVICE_OVERRIDES = [
  *(f"ici_{a}_parallelism=1" for a in ("fsdp", "expert", "tensor", "sequence", "pipeline", "context")),
  "ici_data_parallelism=-1",
  *(f"dcn_{a}_parallelism=1" for a in ("data", "fsdp", "expert", "pipeline")),
  "num_slices=1",
  "nodes=1",
  "recipe_num_devices=-1",
  "hardware=cpu",
  # the tree does not depend on the batch: a fractional per_device_batch_size (a job's 0.25 x 1,024 GPUs)
  # is 0 sequences on one device, which MaxText's routing divides by
  "per_device_batch_size=1",
  "num_vocab_tiling=1",  # MaxText checks it divides the batch's tokens, 1 x max_target_length here
  "attention=dot_product",  # the parameter tree does not depend on the kernel; cuDNN's needs TE to trace
  # MaxText's TE MoE block needs TE to trace; the tree of its parameters is the same size unfused
  "te_moe_block=false",
  "prefuse_moe_weights=false",
  # MaxText refuses TE EP's receive-buffer factor without expert parallelism (its MoE without TE's block)
  "ragged_buffer_factor=-1.0",
  "eval_ragged_buffer_factor=-1.0",
]

Leaf = tuple[tuple[str, ...], tuple[int, ...], tuple[str | None, ...]]


def model_patches(cfg: Any = None) -> list[Patch]:
  """What changes MaxText's model wherever it is built: our MoE block, the MLA norms' epsilon, the mesh of
  CPU processes as nodes, a weights-only load that reads our training checkpoints and starts the FP8
  scaling state fresh (and, given the resolved `cfg`, loads a checkpoint without pipeline stages into a
  model with them), MoE layers inside pipeline stages."""
  return [
    *moe_layer.patches(),
    *mla_norm.patches(),
    *mesh.patches(),
    *weights_load.patches(cfg),
    *pipeline.patches(),
  ]


def _linen_model(cfg: Any) -> tuple[Any, jax.sharding.Mesh]:
  with installed(mesh.patches()):
    device_mesh = maxtext_utils.get_mesh_from_config(cfg)
  return models.transformer_as_linen(cfg, device_mesh, quant=None, model_mode="train"), device_mesh


def param_leaves(cfg: Any) -> list[Leaf]:
  """[(collection-qualified path, shape, logical axis names)] of a resolved config's model parameters."""
  model, _ = _linen_model(cfg)
  tree = maxtext_utils.get_abstract_param(model, cfg)
  leaves = []
  flat = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, nn.LogicallyPartitioned))[0]
  for path, leaf in flat:
    value = leaf.value if isinstance(leaf, nn.LogicallyPartitioned) else leaf
    names = tuple(leaf.names) if isinstance(leaf, nn.LogicallyPartitioned) else (None,) * len(value.shape)
    leaves.append((tuple(str(getattr(k, "key", k)) for k in path), tuple(value.shape), names))
  return leaves


class Forward:
  """A parameter checkpoint loaded once (MaxText's `load_params_from_path`, what `load_parameters_path`
  runs in training) and a jitted forward pass: `forward(tokens)` gives the logits for `tokens` [B, S]
  (positions 0..S-1), with our MoE block installed. B must divide by the device count."""

  def __init__(self, cfg: Any, params_path: str):
    params_path = str(Path(params_path).absolute())  # Orbax's OCDBT spec refuses a relative path
    self.cfg = cfg
    self.model, self.mesh = _linen_model(cfg)
    replicated = jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec())
    abstract = jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=replicated),
      nn.unbox(maxtext_utils.get_abstract_param(self.model, cfg)),
    )
    gb = cfg.checkpoint_storage_concurrent_gb
    self.params = checkpointing.load_params_from_path(params_path, {"params": abstract["params"]}, gb)
    others = {k: v for k, v in abstract.items() if k != "params"}  # MoEBiasVar (the routing bias)
    if others:
      try:  # a converted or parameter checkpoint keeps them next to params
        self.params |= checkpointing.load_params_from_path(params_path, others, gb)
      except ValueError:  # a training checkpoint keeps NNX's non-Param state under nnx_aux/model
        self.params |= _training_aux(Path(params_path), others, replicated)
    moe_layer.prepare_te_ep(cfg)
    self._apply = jax.jit(self._logits)

  def _logits(self, params: Any, tokens: jax.Array) -> jax.Array:
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    out = self.model.apply(
      params, tokens, positions, decoder_segment_ids=jnp.ones_like(tokens), enable_dropout=False, mutable=True
    )
    return out[0] if isinstance(out, tuple) else out

  def __call__(self, tokens: Any) -> jax.Array:
    cfg = self.cfg
    with (
      installed(model_patches()),
      moe_layer.te_guard(),
      jax.set_mesh(self.mesh),
      logical_axis_rules(cfg.logical_axis_rules),
    ):
      return self._apply(self.params, jnp.asarray(tokens, jnp.int32))


def _training_aux(path: Path, abstract: dict[str, Any], sharding: Any) -> dict[str, Any]:
  """The leaves of `abstract` ({collection: tree}) as a MaxText training checkpoint stores them."""
  items = path / orbax.ITEMS if (path / orbax.ITEMS).is_dir() else path
  meta = json.loads((items / "_METADATA").read_text())

  def read(keys: tuple, leaf: jax.ShapeDtypeStruct) -> jax.Array:
    name = ".".join(["nnx_aux", "model", *(str(getattr(k, "key", k)) for k in keys[1:])])
    store = orbax.open_array(items, name, ocdbt=bool(meta.get("use_ocdbt")), zarr3=bool(meta.get("use_zarr3")))
    return jax.device_put(np.asarray(store.read().result(), leaf.dtype), sharding)

  return jax.tree_util.tree_map_with_path(read, abstract)


def load_and_forward(cfg: Any, params_path: str, tokens: Any) -> jax.Array:
  """The model's logits for `tokens` [B, S] (positions 0..S-1) with the parameters at `params_path`."""
  return Forward(cfg, params_path)(tokens)


def routed_moe_layer(cfg: Any) -> tuple[Callable, Callable, Any, jax.Array, Callable]:
  """MaxText's RoutedMoE for a resolved config: (fwd, fwd_bwd, params, x, run_ctx), our block installed
  while the functions are traced (call them inside `run_ctx()`).

  `fwd(params, x)` returns the layer output; `fwd_bwd(params, x)` returns grads of sum(y^2) for the layer's
  parameters and x (both jitted). `run_ctx()` enters MaxText's mesh, logical axis rules and our patch."""
  mesh = maxtext_utils.get_mesh_from_config(cfg)
  moe_layer.prepare_te_ep(cfg)

  def run_ctx() -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    stack.enter_context(installed(model_patches()))
    stack.enter_context(moe_layer.te_guard())
    stack.enter_context(jax.set_mesh(mesh))
    stack.enter_context(logical_axis_rules(cfg.logical_axis_rules))
    return stack

  with run_ctx():
    layer = mt_moe.RoutedMoE(
      config=cfg,
      num_experts=cfg.num_experts,
      num_experts_per_tok=cfg.num_experts_per_tok,
      mesh=mesh,
      kernel_init=initializers.nd_dense_init(1.0, "fan_in", "truncated_normal"),
      kernel_axes=("embed", None),
      intermediate_dim=cfg.moe_mlp_dim,
      dtype=cfg.dtype,
      weight_dtype=cfg.weight_dtype,
      rngs=nnx.Rngs(0),
    )
  graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
  batch = int(cfg.per_device_batch_size) * jax.device_count()
  x = jax.random.normal(jax.random.PRNGKey(1), (batch, cfg.max_target_length, cfg.emb_dim), cfg.dtype)

  def apply(params, x):
    return nnx.merge(graphdef, params, rest)(x)[0]

  def loss(state, x):
    return jnp.sum(apply(state, x).astype(jnp.float32) ** 2)

  return jax.jit(apply), jax.jit(jax.grad(loss, argnums=(0, 1))), params, x, run_ctx
