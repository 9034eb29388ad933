"""How many copies of each large buffer XLA keeps live at the train step's peak, per compiler.

Read off XLA's buffer assignment at the peak (`maxtext-moe compile --hlo DIR` writes the live set as
peak.json; `tools/peak.py`), for XLA:CPU on the tiny and 16B-proxy steps and for XLA:GPU on the proxy
(H200 x 8) and the other GPU recipes of `bench plan --gpu`. The two compilers fuse the loss and lay out the
MoE block's buffers differently, so a GPU recipe is planned with XLA:GPU's counts and a CPU one with
XLA:CPU's. Shape names: T tokens per device, V vocab, D model dim, F expert hidden dim, R routed rows,
S received rows, P expert-parallel ranks, B x H x L x L attention scores.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class Copies:
  """Live copies at the peak, by buffer (`narrow` = the compute dtype, e.g. bf16)."""

  loss_f32_logits: int  # [T, V] float32 in the loss phase, for the model's own loss head
  loss_f32_logits_per_mtp_head: int  # [T, V] float32 in the loss phase, per multi-token-prediction head
  loss_narrow_logits: int  # [T, V] compute dtype in the loss phase (0 when the compute dtype is f32)
  layer_f32_logits: int  # [T, V] float32 still live while a layer's backward runs
  layer_narrow_logits_per_head: int  # [T, V] compute dtype still live then, per loss head (+ MTP's)
  rows_f32_by_d: int  # [R, D] float32 in the MoE block's backward
  rows_narrow_by_d: int  # [R, D] compute dtype
  rows_narrow_by_f: int  # [R, F] compute dtype
  received_narrow_by_d: int  # [S, D] compute dtype: the exchange's receive (and return) buffers
  scores_narrow: int  # [B, H, L, L] compute dtype: dot-product attention's scores and their gradient
  scores_mask: int  # [B, H, L, L] bool: the causal and segment masks


# XLA:CPU (tiny and proxy steps, 8 fake devices): the softmax cross-entropy keeps 4 float32 logits-sized
# buffers (logits, softmax, their gradient, the one-hot scatter) plus the narrow logits; 2 of the float32
# ones are still live in a layer's backward.
XLA_CPU = Copies(4, 0, 1, 2, 0, 1, 4, 6, 0, 4, 0)

# XLA:GPU (proxy on 8 H200s): the logits GEMM writes them narrow and the model's loss (MaxText's
# custom-gradient cross entropy) fuses in them, keeping no float32 [T, V] buffer (Qwen3 and the suite's
# proxy without MTP have none); each MTP head's loss (MaxText's logsumexp + take_along_axis) keeps one
# float32 buffer (the DeepSeek-V3 recipes, one MTP layer each). A layer's backward runs with each loss
# head's logits gradient live (narrow: XLA schedules the output projection's weight gradient after the
# layers' backward; the proxy's main head and its MTP head make 2, Qwen3 and the suite's proxy without
# MTP 1), the Mosaic GEMM's padded row buffers (4 [R, D], 8 [R, F]) and the all_to_all's receive and
# return buffers (4 [S, D]); the GPU recipes' attention is cuDNN's flash attention (`estimate`'s flash
# term); MaxText's dot-product attention, where a user picks it, keeps 2 score buffers with 2 masks.
XLA_GPU = Copies(0, 1, 2, 0, 1, 0, 4, 8, 4, 2, 2)


def for_hardware(hardware: str) -> Copies:
  return XLA_CPU if str(hardware) == "cpu" else XLA_GPU
