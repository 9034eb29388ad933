"""Each layer of a pipeline stage rematerialized on its own, as it is without stages.

MaxText's pipeline wraps one iteration (a stage running its `num_layers_per_pipeline_stage` layers on one
microbatch) in `jax.checkpoint` with its pipeline policy, and runs the stage's layers inside it without a
checkpoint of their own (`NNXSequentialPipelineStage`, `NNXScannedPipelineStage`). In the backward of an
iteration its forward is recomputed whole, and every layer of the stage keeps all it computed for its own
backward at once: a stage of one repeat runs all its layers per visit (a circular pipeline runs
num_layers_per_pipeline_stage of them), and DeepSeek-V3 671B's 2 stages of 29 layers needed 1,974 GiB per
H100 (XLA:GPU's buffer assignment: each of the 29 layers' attention scores, dispatch rows and expert
activations live together).

Here each layer of a stage of more than one is its own `jax.checkpoint` with the layer's remat policy
(MaxText's `NNXDecoder.get_remat_policy`, as its scanned decoder applies it per layer), and its input is
named `decoder_layer_input`, which the pipeline's policy saves per iteration: the backward then recomputes
one layer at a time from its saved input. The layer classes are subclassed only to add the checkpoint
(their parameter tree, and so checkpoints, are unchanged); a stage of one layer is left as MaxText builds
it (the iteration's checkpoint is already the layer's).
"""

import types
from typing import Any

import jax
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from maxtext.layers import nnx_decoders
from maxtext.utils import maxtext_utils

from maxtext_moe.upstream.patches import Patch, original

LAYER_INPUT = "decoder_layer_input"  # a name MaxText's pipeline policy saves (`get_pipeline_remat_policy`)

_REMATTED: dict[type, type] = {}  # upstream layer class -> its subclass with the checkpoint


class _PolicyReader:
  """What MaxText's `NNXDecoder.get_remat_policy` reads of a decoder: its config and `minimal_policy`."""

  minimal_policy = nnx_decoders.NNXDecoder.minimal_policy

  def __init__(self, config: Any):
    self.config = config


def layer_policy(cfg: Any) -> Any:
  """The remat policy MaxText's decoder gives each layer under `cfg` (None: save nothing)."""
  return nnx_decoders.NNXDecoder.get_remat_policy(_PolicyReader(cfg))


def _checkpointed_call(layer: Any, inputs: jax.Array, *args: Any, **kwargs: Any) -> Any:
  """The upstream layer's `__call__` as one `jax.checkpoint`, its state threaded through as MaxText's
  `_apply_layer_with_remat` threads it."""
  (upstream,) = type(layer).__bases__  # the class `rematted` subclassed
  graphdef, state = nnx.split(layer)

  def pure(state_in: Any, x: jax.Array) -> tuple[Any, Any]:
    merged = nnx.merge(graphdef, state_in)
    return upstream.__call__(merged, x, *args, **kwargs), nnx.state(merged)

  cfg = layer.config
  prevent_cse = maxtext_utils.should_prevent_cse_in_remat(cfg)
  out, new_state = jax.checkpoint(pure, policy=layer_policy(cfg), prevent_cse=prevent_cse)(
    state, checkpoint_name(inputs, LAYER_INPUT)
  )
  nnx.update(layer, new_state)
  return out


def rematted(cls: type) -> type:
  """`cls` with its call checkpointed (one subclass per class, so every build has the same types)."""
  if cls not in _REMATTED:
    sub = types.new_class(cls.__name__, (cls,), exec_body=lambda ns: ns.update(__call__=_checkpointed_call))
    sub.__module__, sub.__qualname__ = cls.__module__, cls.__qualname__
    _REMATTED[cls] = sub
  return _REMATTED[cls]


def stage_module(decoder: Any, decoder_blocks: Any, rngs: Any) -> Any:
  """MaxText's `NNXDecoder._get_pipeline_stage_module`, its layers checkpointed one by one in a stage of
  more than one layer."""
  build = original(nnx_decoders.NNXDecoder, "_get_pipeline_stage_module")
  if int(decoder.config.num_layers_per_pipeline_stage) > 1:
    decoder_blocks = type(decoder_blocks)(rematted(cls) for cls in decoder_blocks)
  return build(decoder, decoder_blocks, rngs)


def patches() -> list[Patch]:
  return [Patch(nnx_decoders.NNXDecoder, "_get_pipeline_stage_module", stage_module)]
