"""The dropless MoE block at MaxText's seam: `RoutedMoE.sparse_matmul`, replaced.

MaxText's `RoutedMoE.__call__` runs the gate and calls `sparse_matmul(inputs, gate_logits, pre_bias_logits,
w0, w1, wo, biases..., input_ids, forced_routed_experts) -> (out, lb_loss, bias_updates)`. Our
replacement keeps MaxText's routing (`get_topk`: DeepSeek-V3 sigmoid + bias, group-limited top-k,
routed_scaling_factor), its load-balance loss and its aux-loss-free bias update, and runs our
dispatch -> grouped GEMM -> combine (`maxtext_moe.moe.block.moe_block`) in between. The parameter tree is
untouched, so checkpoints stay interchangeable with stock MaxText. With `moe_impl=maxtext` it falls
through to MaxText's own method.
"""

import inspect
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from maxtext.layers import moe as mt_moe
from maxtext.utils import maxtext_utils

from maxtext_moe.moe import mesh_axes, round_plan
from maxtext_moe.moe.block import moe_block
from maxtext_moe.moe.layout import dispatch_for, exchange_chunks, expert_nodes, fp8_gathered, routing_groups
from maxtext_moe.moe.settings import DispatchKind, GemmBackend, MoEImpl, MoESettings, detect_platform, resolve_backend
from maxtext_moe.moe.stats import BIAS, INTERMEDIATE_PREFIX
from maxtext_moe.upstream.patches import Patch, original
from maxtext_moe.upstream.pipeline import moe_stages as pipeline
from maxtext_moe.upstream.te import calls as te

# The logical axes of the [batch, length, embed] activations MaxText's decoder layers hand the MoE layer.
ACTIVATIONS = ("activation_batch", "activation_norm_length", "activation_embed")


def mesh_axis_sizes(cfg: Any) -> dict[str, int]:
  """MaxText's mesh for this config, as {axis: size}."""
  return dict(maxtext_utils.get_mesh_from_config(cfg).shape)


def _num_devices(cfg: Any) -> int:
  return int(cfg.recipe_num_devices) if int(cfg.recipe_num_devices) > 0 else jax.device_count()


def resolved_kinds(cfg: Any) -> tuple[DispatchKind, GemmBackend]:
  """What `auto` becomes for this config on this platform: under pipeline stages never TE's grouped GEMM,
  which cannot be vmapped over them (`config.stage_checks.check_pipeline_for_moe` refuses it named)."""
  dispatch = dispatch_for(cfg, num_devices=_num_devices(cfg), platform=detect_platform())
  backend = resolve_backend(cfg.moe_gemm_backend, platform=detect_platform())
  if backend == GemmBackend.TE and getattr(cfg, "using_pipeline_parallelism", False):
    backend = GemmBackend.TOKAMAX
  return dispatch, backend


def settings_from_config(cfg: Any) -> MoESettings:
  dispatch, gemm = resolved_kinds(cfg)
  nodes = expert_nodes(cfg, _num_devices(cfg))
  return MoESettings(
    dispatch=dispatch,
    gemm=gemm,
    capacity_factor=float(cfg.moe_capacity_factor),
    buffers=cfg.moe_buffers,
    buffer_factor=float(cfg.moe_buffer_factor),
    activation=cfg.mlp_activations[0],
    quantization=cfg.moe_gemm_quantization,
    te_recv_capacity=te.bootstrapped_capacity(),
    ep_nodes=nodes,
    routing_groups=routing_groups(cfg),
    exchange_chunks=exchange_chunks(cfg, nodes=nodes),
    fp8_gather=fp8_gathered(cfg),
  )


def prepare_te_ep(cfg: Any) -> None:
  """Bootstraps TE's NCCL EP, once per process and before the step is traced, when this config runs
  te_ep: sized for the largest per-rank batch the process will dispatch (training or eval micro-batch),
  dropless unless a capacity is set. With a capacity TE drops what overflows and counts it
  (total_recv_tokens), and the host stops the run on it unless moe_allow_drops (moe.stats.step_metrics):
  TE's other mode traps on the device, which would end the job without a word."""
  if resolved_kinds(cfg)[0] != DispatchKind.TE_EP:
    return
  mesh = maxtext_utils.get_mesh_from_config(cfg)
  ranks = math.prod(mesh.shape.get(a, 1) for a in (*mesh_axes.TE_EP_OUTER, mesh_axes.EXPERT))  # TE EP's token split
  batch = max(int(cfg.micro_batch_size_to_train_on), int(cfg.micro_batch_size_to_eval_on or 0))
  tokens = -(-batch // ranks) * int(cfg.max_target_length)
  capacity = te.recv_capacity(
    num_experts=cfg.num_experts,
    top_k=cfg.num_experts_per_tok,
    tokens_per_rank=tokens,
    ep_size=mesh.shape[mesh_axes.EXPERT],
    factor=float(cfg.moe_capacity_factor),
  )
  te.bootstrap(
    mesh,
    axes=mesh_axes.TE_RESOURCES,
    num_experts=cfg.num_experts,
    tokens_per_rank=tokens,
    capacity=capacity,
    hidden_dim=cfg.emb_dim,
    drop=float(cfg.moe_capacity_factor) > 0,
  )


def te_guard() -> Any:
  """TE's mesh resources named as MaxText names its axes (a null context where TE is absent)."""
  return te.shard_guard(mesh_axes.TE_RESOURCES)


def _load_balance_loss(layer: Any, gate_logits, pre_bias_logits, top_k_indices):
  """MaxText's auxiliary load-balance loss, computed as its dense_matmul does (None when off)."""
  cfg = layer.config
  if cfg.model_call_mode == "inference" or layer.is_hash_routing or cfg.load_balance_loss_weight <= 0.0:
    return None
  if mt_moe.uses_megatron_seq_aux_loss(cfg):
    return layer.megatron_seq_aux_loss(pre_bias_logits if pre_bias_logits is not None else gate_logits)
  probs = jax.nn.softmax(gate_logits.astype(jnp.float32), axis=-1).astype(layer.dtype)
  return layer.load_balance_loss(top_k_indices, probs)


def _bias_magnitude(layer: Any) -> jax.Array:
  """Mean |routing bias| of this layer (DeepSeek-V3's aux-loss-free correction bias; 0 without one)."""
  bias = getattr(layer.gate, "bias", None)
  if not isinstance(bias, mt_moe.MoEBiasVar):
    return jnp.zeros((), jnp.float32)
  return jnp.mean(jnp.abs(bias.value.astype(jnp.float32)))


def _bias_updates(layer: Any, top_k_indices):
  """DeepSeek-V3's aux-loss-free bias update from the pre-dispatch top-k ids, as MaxText computes it."""
  cfg = layer.config
  if not layer.should_update_load_balance():
    return None
  if getattr(cfg, "gradient_accumulation_steps", 1) > 1 or pipeline.vmapped_axes(cfg):  # summed before the sign
    return mt_moe.calculate_expert_counts(top_k_indices, cfg.num_experts, axis_names=None)
  return mt_moe.calculate_load_balance_updates(
    top_k_indices, cfg.num_experts, cfg.routed_bias_update_rate, axis_names=None
  )


def _compute_weights(layer: Any, kernels: tuple, dtype: Any) -> tuple:
  """The experts' kernels in the compute dtype, cast where they are stored: each keeps its stored sharding
  (MaxText's kernel axes), so the block's FSDP all-gather moves compute-dtype bytes. Without the constraint
  XLA is free to gather the float32 kernel and cast after; it does when MaxText's parameter offload moves the
  kernels onto the device inside the step (an all-gather of twice the bytes, and float32 copies of a layer's
  gathered experts at the backward's peak: h100x8/deepseek3-671b, +14 GiB per GPU)."""
  w0, w1, wo = kernels
  axes = (layer.wi_kernel_axes, layer.wi_kernel_axes, layer.wo_kernel_axes)
  return tuple(layer._maybe_shard_with_logical(w.astype(dtype), a) for w, a in zip((w0, w1, wo), axes, strict=True))  # pylint: disable=protected-access


def _stored_specs(layer: Any) -> tuple:
  """How the experts' kernels are stored over the mesh (MaxText's kernel axes resolved, as
  `_compute_weights` constrains them): the block takes them so and gathers them itself."""
  axes = (layer.wi_kernel_axes, layer.wi_kernel_axes, layer.wo_kernel_axes)
  return tuple(layer._logical_to_mesh_axes(a) for a in axes)  # pylint: disable=protected-access


def _token_order(layer: Any) -> tuple[str, ...]:
  """The mesh axes the layer's [batch, length] tokens arrive split over, major first (MaxText's activation
  rules in effect), which the block splits its tokens over first."""
  spec = layer._logical_to_mesh_axes(ACTIVATIONS[:2])  # pylint: disable=protected-access
  return tuple(a for entry in (spec or ()) for a in ((entry,) if isinstance(entry, str) else entry or ()))


def dropless_sparse_matmul(
  self,
  inputs,
  gate_logits,
  pre_bias_logits,
  w0_kernel,
  w1_kernel,
  wo_kernel,
  w0_bias,
  w1_bias,
  wo_bias,
  input_ids=None,
  forced_routed_experts=None,
):
  """Drop-in for RoutedMoE.sparse_matmul: MaxText routing, then our dispatch -> grouped GEMM -> combine."""
  weights = (w0_kernel, w1_kernel, wo_kernel, w0_bias, w1_bias, wo_bias)
  if str(getattr(self.config, "moe_impl", MoEImpl.MAXTEXT)) != MoEImpl.DROPLESS:
    fall_through = original(mt_moe.RoutedMoE, "sparse_matmul")
    return fall_through(
      self,
      inputs,
      gate_logits,
      pre_bias_logits,
      *weights,
      input_ids=input_ids,
      forced_routed_experts=forced_routed_experts,
    )
  if any(b is not None for b in (w0_bias, w1_bias, wo_bias)):
    raise ValueError("moe_impl=dropless does not support MLP biases; set moe_impl=maxtext")
  weights_TK, ids_TK = self.get_topk(
    gate_logits, pre_bias_logits, self.rngs, input_ids=input_ids, forced_routed_experts=forced_routed_experts
  )
  # The tokens enter and leave split as the layer's activations are (and so do their gradients): left free,
  # XLA:GPU took the block's split for the gradient beside the shared experts' and, with tensor parallelism
  # under stages x data, made the shared experts' input gradient through the whole batch (docs/moe-block.md).
  inputs = self._maybe_shard_with_logical(inputs, ACTIVATIONS)  # pylint: disable=protected-access
  b, s, d = inputs.shape
  k = ids_TK.shape[-1]
  ep = self.mesh.shape.get(mesh_axes.EXPERT, 1)
  # The bias update's expert counts are summed over the whole batch (an all-reduce over the batch's axes)
  # before the tokens leave: left free, XLA:GPU ran that all-reduce beside the expert GEMMs, and kept every
  # all-to-all over those devices from them while it was in flight (docs/moe-block.md).
  x_TD, updates = round_plan.tie(inputs.reshape(b * s, d), _bias_updates(self, ids_TK))
  y_TD, stats = moe_block(
    x_TD,
    ids_TK.reshape(b * s, k).astype(jnp.int32),
    weights_TK.reshape(b * s, k).astype(inputs.dtype),
    *_compute_weights(self, (w0_kernel, w1_kernel, wo_kernel), inputs.dtype),
    mesh=self.mesh,
    expert_axis=mesh_axes.EXPERT if ep > 1 else None,
    settings=settings_from_config(self.config),
    vmapped_axes=pipeline.vmapped_axes(self.config),
    weight_specs=_stored_specs(self),
    token_order=_token_order(self),
  )
  stats[BIAS] = _bias_magnitude(self)
  for name, value in stats.items():
    self.sow(nnx.Intermediate, INTERMEDIATE_PREFIX + name, value)
  lb_loss = _load_balance_loss(self, gate_logits, pre_bias_logits, ids_TK)
  return self._maybe_shard_with_logical(y_TD.reshape(b, s, d), ACTIVATIONS), lb_loss, updates  # pylint: disable=protected-access


def routed_moe_init(self, config, *args, **kwargs):
  """RoutedMoE built without MaxText's `quant` under our block: the dense layers around it quantize
  (`quantization`), while the router stays in the model's dtype, as DeepSeek-V3 and NVIDIA's published run
  keep it, and the routed experts follow `moe_gemm_quantization` in our grouped GEMM. Without `quant` MaxText
  adds no FP8 einsum state under the block, so the block's parameter tree is the bf16 one."""
  init = original(mt_moe.RoutedMoE, "__init__")
  call = inspect.signature(init).bind(self, config, *args, **kwargs)
  if str(getattr(config, "moe_impl", MoEImpl.MAXTEXT)) == MoEImpl.DROPLESS:
    call.arguments["quant"] = None
  init(*call.args, **call.kwargs)


def patches() -> list[Patch]:
  """Our block in place of RoutedMoE.sparse_matmul, and RoutedMoE without `quant` under it (configs with
  moe_impl=maxtext still reach MaxText's own)."""
  return [
    Patch(mt_moe.RoutedMoE, "sparse_matmul", dropless_sparse_matmul),
    Patch(mt_moe.RoutedMoE, "__init__", routed_moe_init),
  ]
