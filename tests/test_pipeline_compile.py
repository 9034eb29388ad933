"""XLA:GPU's program for a DeepSeek-V3-shaped model with pipeline stages and its multi-token prediction
layer: nothing the step moves between GPUs over the stage axis is of the size of the batch's logits.

MaxText runs the multi-token prediction block after the decoder, outside the pipeline. Under the plain axis
rules its activations were split over every batch axis but `stage`, so every stage ran the whole batch
through the MTP layer and its output head, and the logits' gradient was gathered onto every GPU (4.0 GiB
over the 8 GPUs here, one GPU's share of the logits being 0.5 GiB; 1,974 GiB per GPU for the 671B's 2
stages on 256 H100s). `upstream/pipeline/moe_stages.py` runs the block under the rules MaxText gives the layers it
runs before the pipeline, where the stage axis splits tokens like data."""

import pytest

from conftest import compile_report
from maxtext_moe.gpu_compile.command import plugin_installed

pytestmark = pytest.mark.ci  # one XLA:GPU compile, about 2 minutes on 2 cores

BATCH, LENGTH, VOCAB = 2, 1024, 129280  # per GPU; the proxy's vocabulary
SMALL = [
  "override_model_config=true",
  "base_num_decoder_layers=5",  # 1 dense + 4 MoE layers, 2 per stage
  "base_emb_dim=512",
  "base_mlp_dim=1024",
  "base_moe_mlp_dim=256",
  f"max_target_length={LENGTH}",
  f"per_device_batch_size={BATCH}",
  "mtp_num_layers=1",
]
STAGES = ["ici_pipeline_parallelism=2", "ici_fsdp_parallelism=2", "ici_expert_parallelism=2"]


@pytest.mark.skipif(not plugin_installed(), reason="needs jax-cuda12-plugin (./setup.sh --gpu-compile)")
def test_pipelined_step_keeps_the_mtp_layer_split_over_the_stages(tmp_path):
  args = ["compile", "h100x8/deepseek3-proxy-16b", *SMALL, *STAGES, "num_layers_per_pipeline_stage=2", "--json"]
  report = compile_report(args, cwd=tmp_path)
  assert report["layout"] == {"stage": 2, "fsdp": 2, "expert": 2}
  share = BATCH * LENGTH * VOCAB * 2  # one GPU's bf16 logits
  across = {k: row["bytes"] for k, row in report["collectives"].items() if row["group_size"] == 8}
  assert across and max(across.values()) < share / 4, across
  # Every device runs a quarter of the batch's MTP layer and head at most once: without stages the same
  # model needs 3.4 GiB per GPU; with 2 stages about 4 GiB (5.4 GiB with the MTP layer unsplit).
  assert report["device_bytes"] < 4.5 * 2**30, report["device_bytes"]
