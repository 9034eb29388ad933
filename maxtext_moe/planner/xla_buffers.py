"""How many copies of each large buffer XLA keeps live at the train step's peak, per compiler.

Read off XLA's buffer assignment at the peak (`maxtext-moe compile --hlo DIR` writes the live set as
peak.json; `gpu_compile/peak.py`), for XLA:CPU on the tiny and 16B-proxy steps and for XLA:GPU on the proxy
(H200 x 8) and the other GPU recipes of `bench plan --gpu`. The two compilers fuse the loss and lay out the
MoE block's buffers differently, so a GPU recipe is planned with XLA:GPU's counts and a CPU one with
XLA:CPU's. Shape names: T tokens per device, V vocab, D model dim, F expert hidden dim, R routed rows,
S received rows, P expert-parallel ranks, B x H x L x L attention scores, E_l experts per device.
"""

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Copies:
  """Live copies at the peak, by buffer (`narrow` = the compute dtype, e.g. bf16)."""

  loss_f32_logits: int  # [T, V] float32 in the loss phase, for the model's own loss head
  loss_f32_logits_per_mtp_head: int  # [T, V] float32 in the loss phase, per multi-token-prediction head
  loss_narrow_logits: int  # [T, V] compute dtype in the loss phase (0 when the compute dtype is f32)
  layer_f32_logits: int  # [T, V] float32 still live while a layer's backward runs
  layer_narrow_logits_per_head: int  # [T, V] compute dtype still live then, per loss head (+ MTP's)
  rows_f32_by_d: int  # [R, D] float32 in the MoE block's backward
  rows_narrow: tuple[tuple[int, int], ...]  # ([R, D], [R, F]) compute dtype at each moment of the experts'
  # backward; the planner takes the largest
  received_narrow_by_d: int  # [S, D] compute dtype: the exchange's receive (and return) buffers
  layer_narrow_by_d: int  # [T, D] compute dtype: the residual stream's temporaries in a layer's backward
  layer_narrow_by_d_mla: int  # the same with MLA attention
  experts_gathered: tuple[int, int]  # (compute dtype, float32) copies of one MoE layer's expert matrices
  # (`layer_weights`) when they are stored split over FSDP-style axes
  experts_local: int  # compute-dtype copies of them when each device stores its experts whole
  experts_chunk_sums: int  # compute-dtype copies more when the exchange runs in chunks: the weight gradients'
  # sums over the chunks
  layer_weight_copies: int  # compute-dtype copies of one MoE and one dense layer's other weights, gathered
  scores_narrow: int  # [B, H, L, L] compute dtype: dot-product attention's scores and their gradient
  scores_mask: int  # [B, H, L, L] bool: the causal and segment masks
  te_ep_rows: tuple[tuple[int, int], tuple[int, int]]  # ([R, D], [R, F]) compute dtype at the peak of the
  # experts' backward with TE's NCCL EP: their forward recomputed, and their gated pair saved
  te_ep_experts_gathered: tuple[int, int]  # `experts_gathered` with TE's NCCL EP
  quantized_rows: tuple[int, int]  # 1-byte ([R, D], [R, F]) copies of a quantized grouped GEMM's rows


# XLA:CPU (tiny and proxy steps, 8 fake devices): the softmax cross-entropy keeps 4 float32 logits-sized
# buffers (logits, softmax, their gradient, the one-hot scatter) plus the narrow logits; 2 of the float32
# ones are still live in a layer's backward. Its peak is the optimizer's update (the 16B proxy at 1 x 1,024:
# the gradients, their copies and the embedding's), where no layer's weights or temporaries are live, so
# the layer terms are 0 here (`bench plan`: within 5% without them).
XLA_CPU = Copies(
  loss_f32_logits=4,
  loss_f32_logits_per_mtp_head=0,
  loss_narrow_logits=1,
  layer_f32_logits=2,
  layer_narrow_logits_per_head=0,
  rows_f32_by_d=1,
  rows_narrow=((4, 6),),
  received_narrow_by_d=0,
  layer_narrow_by_d=0,
  layer_narrow_by_d_mla=0,
  experts_gathered=(0, 0),
  experts_local=0,
  experts_chunk_sums=0,
  layer_weight_copies=0,
  scores_narrow=4,
  scores_mask=0,
  te_ep_rows=((4, 6), (4, 6)),
  te_ep_experts_gathered=(0, 0),
  quantized_rows=(0, 0),
)

# XLA:GPU (read off the live sets at the peak of every `bench plan --gpu` recipe, at the recipe's flags): the
# logits GEMM writes them narrow and the model's loss (MaxText's custom-gradient cross entropy) fuses in
# them, keeping no float32 [T, V] buffer (Qwen3 and the suite's proxy without MTP have none); each MTP
# head's loss (MaxText's logsumexp + take_along_axis) keeps one float32 buffer (the DeepSeek-V3 recipes, one
# MTP layer each). A layer's backward runs with each loss head's logits gradient live (narrow: XLA schedules
# the output projection's weight gradient after the layers' backward; the proxy's main head and its MTP
# head make 2, Qwen3 and the suite's proxy without MTP 1), and with:
# - the experts' backward: at the data-gradient GEMMs 6 [R, D] (the rows in, the gradient in, the two
#   partial input gradients of wi_0 and wi_1, the transposed rows and gradient for the weight gradients)
#   and 5 [R, F]; at the weight gradients 4 [R, D] and 9 [R, F] (gb300x1024, D much larger than F, peaks at
#   the first; the 16B proxy and Qwen3 at the second); and the all_to_all's receive and return buffers (4
#   [S, D]);
# - one MoE layer's expert matrices as the block computes with them, in the compute dtype: gathered, and
#   transposed for the data-gradient GEMMs, 2 copies (the block gathers them itself and reduce-scatters their
#   gradients, so no float32 copy): h200x8/deepseek3-671b-finetune holds 7 kernel-sized buffers where one
#   layer's experts are 3, h200x8/deepseek3-671b 4, h100x8/qwen3-235b-a22b 3; with the exchange in chunks
#   their weight gradients' sums once more (the 671B on H100, two chunks: 7); stored whole (EP over all the
#   devices), once;
# - the other weights gathered for 2 layers of each kind (a MoE layer's attention, router and shared
#   experts, a dense layer's attention and MLP: the pipelined all-gathers fetch the next layer's while this
#   one runs; 3.1 GiB at gb300x1024 where this gives 3.0);
# - [T, D] residual-stream temporaries (the layer's norms, sums and their gradients): 12 with MLA (the 671B
#   recipes hold 13), 5 without (Qwen3 5, Mixtral 3).
# With TE's NCCL EP (December 2026: the container's program compiled with TE, `.venv-te`), the receive
# buffer is the grouped GEMM's input and XLA:GPU keeps more of the rows and fewer of the weights:
# - the experts' forward recomputed (`remat_policy: full`): 9 [R, D] and 7 [R, F] at the peak (the dispatch
#   output, the combine gradient and their double buffers, the GEMMs' outputs; the 16B proxy 9 and 7,
#   gb200-nvl72 10 and 7, Qwen3-30B-A3B 7 and 4, beside its 27 GiB of float32 expert gradients: the planner
#   is -2%, -1% and +12% on them); their gated pair saved (`moe_mlpwi_0/1` on the device or the host): 6 [R, D] and
#   1 [R, F] (gb300x128);
# - one MoE layer's expert matrices once, in the compute dtype, and no float32 copy (gb200-nvl72: the
#   three, 2.6 GiB; gb300x128: the gated pair);
# - a quantized grouped GEMM (FP8 or MXFP8) adds 1-byte copies of its rows: 2 [R, D] (the input and its
#   gradient) and 4 [R, F] (gb300x128, MXFP8).
# The GPU recipes' attention is cuDNN's flash attention (`estimate`'s flash term); MaxText's dot-product
# attention, where a user picks it, keeps 2 score buffers with 2 masks.
XLA_GPU = Copies(
  loss_f32_logits=0,
  loss_f32_logits_per_mtp_head=1,
  loss_narrow_logits=2,
  layer_f32_logits=0,
  layer_narrow_logits_per_head=1,
  rows_f32_by_d=0,
  rows_narrow=((6, 5), (4, 9)),
  received_narrow_by_d=4,
  layer_narrow_by_d=5,
  layer_narrow_by_d_mla=12,
  experts_gathered=(2, 0),
  experts_local=1,
  experts_chunk_sums=1,
  layer_weight_copies=2,
  scores_narrow=2,
  scores_mask=2,
  te_ep_rows=((9, 7), (6, 1)),
  te_ep_experts_gathered=(1, 0),
  quantized_rows=(2, 4),
)


# XLA:GPU for Blackwell (sm_100 and up) fuses the main loss head's softmax cross entropy differently: its
# float32 exponentials are kept as a [T, V] buffer beside the float32 logits-sized one (b200x8 and
# gb200-nvl72's 671B programs hold 2 float32 [T, V] with the MTP head's, where the H200 ones hold 1).
XLA_GPU_BLACKWELL = dataclasses.replace(XLA_GPU, loss_f32_logits=1)


def for_config(cfg: Any) -> Copies:
  """The counts of the compiler a config's program is built by: XLA:CPU, XLA:GPU for Hopper and before, or
  for Blackwell (its recipe's GPU model)."""
  from maxtext_moe.config import hardware  # pylint: disable=import-outside-toplevel

  if str(cfg.hardware) == "cpu":
    return XLA_CPU
  gpu = hardware.gpu(getattr(cfg, "recipe_hardware", None))
  return XLA_GPU_BLACKWELL if gpu is not None and gpu.compute_capability[0] >= 10 else XLA_GPU
