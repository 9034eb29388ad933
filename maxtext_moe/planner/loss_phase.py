"""The loss phase's logits-sized buffers, by loss head, and MaxText's vocab tiling (`estimate.py` adds them
to the step's peak; docs/planner.md, "MaxText's vocab tiling")."""

from typing import Any

from maxtext_moe.planner import xla_buffers
from maxtext_moe.planner.shards import mesh_axes_of


def logits_bytes(cfg: Any, tokens: int, d_b: int, copies: xla_buffers.Copies, batch: int) -> tuple[int, int]:
  """(the loss phase's logits-sized buffers, those still live in a layer's backward): per loss head, the
  model's and each multi-token-prediction layer's; `batch`: the micro batch's tokens over all devices where
  a tiled loss gathers them (`tiled_batch_gathered`), else 0.

  With `num_vocab_tiling` n > 1 MaxText computes the model's own head a chunk at a time in a custom VJP
  that returns the hidden states' gradient (`vocab_tiling_nnx_loss`), so none of its [T, V] buffers is
  live in a layer's backward; the MTP heads compute theirs whole (MaxText tiles only the model's head), and
  the head is gathered whole for each chunk. It cuts the chunks from the whole batch flattened ([B x L, D]
  into [n, B x L / n, D], each chunk split over the batch's devices), which no device's rows line up with,
  so XLA re-splits the batch (`tiled_batch_gathered`). `h100x8/deepseek3-671b per_device_batch_size=3
  num_vocab_tiling=3` at 256 GPUs holds, at its peak in the loss's backward, the gathered bf16
  [768, 4096, 7168] (42.0 GiB), the head gathered whole (1.7 GiB) and the MTP head's bf16 logits (3.0 GiB):
  97.4 GiB compiled where the recipe at n = 1 is 65; `h100x8/deepseek3-proxy-16b num_vocab_tiling=4` keeps
  the MTP head's bf16 [T, V] alone at the peak. The loss phase then: the gathered batch and head, one
  chunk's logits (a float32 and a compute-dtype copy), each MTP head's float32 buffer and logits."""
  vocab, narrow = int(cfg.vocab_size), d_b if d_b < 4 else 0
  mtp = int(getattr(cfg, "mtp_num_layers", 0) or 0)
  n = tiles(cfg)
  heads = tokens * vocab * copies.loss_f32_logits_per_mtp_head * 4 * mtp
  if n > 1:
    gathered = (batch + vocab) * int(cfg.emb_dim) * d_b
    chunk = tokens // n * vocab * (4 + narrow)
    return gathered + chunk + heads + tokens * vocab * narrow * mtp, tokens * vocab * (
      copies.layer_narrow_logits_per_head * mtp * narrow
    )
  main = tokens * vocab * (copies.loss_f32_logits * 4 + copies.loss_narrow_logits * narrow)
  layer = tokens * vocab * (copies.layer_f32_logits * 4 + copies.layer_narrow_logits_per_head * (1 + mtp) * narrow)
  return main + heads, layer


def tiles(cfg: Any) -> int:
  """The tiled loss's chunks (`num_vocab_tiling`), 1 untiled."""
  return int(getattr(cfg, "num_vocab_tiling", 1) or 1)


def batch_split(rules: list, sides: dict[str, tuple[int, int]]) -> tuple[int, int]:
  """(GPUs the loss's batch is split over, NVLink domains they span): its logical batch axis's mesh axes."""
  group = domains = 1
  for axis in mesh_axes_of(("activation_embed_and_logits_batch",), rules)[0]:
    ici, dcn = sides.get(axis, (1, 1))
    group, domains = group * ici * dcn, domains * dcn
  return group, domains


def tiled_batch_gathered(cfg: Any, rules: list, sides: dict[str, tuple[int, int]]) -> bool:
  """Whether XLA gathers the whole batch's hidden states on every device for MaxText's tiled loss: where
  the batch is split across NVLink domains. Read off three programs: the 671B over 32 H100 nodes (the
  batch over FSDP 16 x EP 16, both across nodes) gathers them whole; one node's (the 16B proxy, FSDP 4 x
  EP 2) and XLA:CPU's 8 devices re-split them with all-to-alls and collective-permutes of each device's
  share."""
  return tiles(cfg) > 1 and batch_split(rules, sides)[1] > 1
