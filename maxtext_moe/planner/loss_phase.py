"""The loss phase's logits-sized buffers, by loss head, and MaxText's vocab tiling (`estimate.py` adds them
to the step's peak; docs/planner.md, "MaxText's vocab tiling")."""

from typing import Any

from maxtext_moe.planner import xla_buffers


def logits_bytes(cfg: Any, tokens: int, d_b: int, copies: xla_buffers.Copies, batch: int) -> tuple[int, int]:
  """(the loss phase's logits-sized buffers, those still live in a layer's backward): per loss head, the
  model's and each multi-token-prediction layer's; `batch`: the micro batch's tokens over all devices.

  With `num_vocab_tiling` n > 1 MaxText computes the model's own head a chunk at a time in a custom VJP
  that returns the hidden states' gradient (`vocab_tiling_nnx_loss`), so none of its [T, V] buffers is
  live in a layer's backward; the MTP heads compute theirs whole (MaxText tiles only the model's head).
  But it cuts the chunks from the whole batch flattened ([B x L, D] into [n, B x L / n, D], each chunk
  split over the batch's devices), which no device's rows line up with: XLA:GPU gathers every device's
  hidden states whole to re-split them. `h100x8/deepseek3-671b per_device_batch_size=3 num_vocab_tiling=3`
  at 256 GPUs holds, at its peak in the loss's backward, the gathered bf16 [768, 4096, 7168] (42.0 GiB), the
  head gathered whole (1.7 GiB) and the MTP head's bf16 logits (3.0 GiB): 97.4 GiB compiled where the
  recipe at n = 1 is 65; on the 16B proxy's 8 GPUs the batch is 0.25 GiB and tiling saves its gradient
  (`h100x8/deepseek3-proxy-16b num_vocab_tiling=4` keeps the MTP head's bf16 [T, V] alone at the peak).
  The loss phase then: the gathered batch and head, one chunk's logits (a float32 and a compute-dtype
  copy), each MTP head's float32 buffer and logits."""
  vocab, narrow = int(cfg.vocab_size), d_b if d_b < 4 else 0
  mtp = int(getattr(cfg, "mtp_num_layers", 0) or 0)
  tiles = int(getattr(cfg, "num_vocab_tiling", 1) or 1)
  heads = tokens * vocab * copies.loss_f32_logits_per_mtp_head * 4 * mtp
  if tiles > 1:
    gathered = (batch + vocab) * int(cfg.emb_dim) * d_b
    chunk = tokens // tiles * vocab * (4 + narrow)
    return gathered + chunk + heads + tokens * vocab * narrow * mtp, tokens * vocab * (
      copies.layer_narrow_logits_per_head * mtp * narrow
    )
  main = tokens * vocab * (copies.loss_f32_logits * 4 + copies.loss_narrow_logits * narrow)
  layer = tokens * vocab * (copies.layer_f32_logits * 4 + copies.layer_narrow_logits_per_head * (1 + mtp) * narrow)
  return main + heads, layer
