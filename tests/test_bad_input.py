"""The catalogue of bad inputs: each gets the one line it must produce, exit code 2, and leaves nothing
behind (the test compares the working directory before and after).

The cases run `maxtext_moe.cli.main` in this process (a subprocess each would cost minutes): the same
parsing, resolution and checks as the command line. What the CLI does at the file-descriptor level after
the line (`maxtext_moe.stderr.last_word`) is exercised by the subprocess tests in test_errors.py and
test_recovery.py; here the line is printed plainly so pytest keeps its own standard error.
"""

import os
import sys
import threading

import pytest

from conftest import REPO
from maxtext_moe import cli

FIXTURE = REPO / "tests" / "fixtures" / "hf_deepseek3_tiny" / "bf16"
H200 = "h200x8/deepseek3-proxy-16b"
FT = "cpu/deepseek3-tiny-finetune"
SFT = ["train", "cpu/deepseek3-tiny-sft", "finetune=false"]
# the 16B proxy on 4 H100 nodes in two pipeline stages, a stage's 16 GPUs data 2 x EP 8, 64 sequences a step
STAGED_PROXY = [
  "plan",
  "h100x8/deepseek3-proxy-16b",
  "--nodes",
  "4",
  "ici_expert_parallelism=8",
  "ici_fsdp_parallelism=1",
  "dcn_pipeline_parallelism=2",
  "dcn_data_parallelism=2",
  "pipeline_parallel_layers=24",
]
SLURM_BAD = {
  "SLURM_JOB_ID": "7",
  "SLURM_STEP_NODELIST": "n1",
  "SLURM_NTASKS": "2",
  "SLURM_PROCID": "2",
  "SLURM_LOCALID": "0",
}

# (id, argv with {tmp} for the case's directory, the message's start or a part of it)
CASES = [
  # configs
  ("unknown_key", ["train", "learning_rat=1"], "unknown config key 'learning_rat'; did you mean 'learning_rate'?"),
  ("bad_type", ["train", "steps=many"], "bad value for 'steps'"),
  ("bad_enum", ["train", "progress=fancy"], "bad value for 'progress'"),
  ("derived_key", ["train", "emb_dim=96"], "emb_dim is derived by MaxText from other keys"),
  (
    "flags_not_a_list",
    ["train", "xla_flags_extra=--xla_foo"],
    "'xla_flags_extra' takes a list, as xla_flags_extra=[a,b]",
  ),
  (
    "flag_not_xla",
    ["train", "xla_flags_extra=[foo]"],
    "xla_flags_extra entry 'foo' is not of the form --xla_name=value",
  ),
  ("env_not_key_value", ["train", "env_extra=[NOEQUALS]"], "env_extra entry 'NOEQUALS' is not KEY=VALUE"),
  ("zero_batch", ["train", "per_device_batch_size=0"], "per_device_batch_size=0 gives a global batch of 0 sequences"),
  ("ep_not_dividing", ["train", "ici_expert_parallelism=3"], "num_experts=16 is not divisible by expert parallelism 3"),
  (
    "tp_not_dividing_heads",
    ["plan", "h100x8/qwen3-30b-a3b", "ici_tensor_parallelism=8", "ici_fsdp_parallelism=1", "ici_expert_parallelism=1"],
    "impossible layout: tensor parallelism 8 (ici/dcn_tensor x tensor_sequence) does not divide num_kv_heads=4; "
    "use ici_tensor_parallelism=4",
  ),
  ("two_auto_axes", ["train", "ici_expert_parallelism=-1"], "at most one ici_*_parallelism may be -1"),
  ("vocab_tiles", ["train", "num_vocab_tiling=3"], "num_vocab_tiling=3 must divide a device's tokens, "),
  ("vocab_tiles_zero", ["train", "num_vocab_tiling=0"], "num_vocab_tiling=0 must be 1 (the loss untiled) or "),
  (
    "dcn_degree_on_one_process",
    ["train", "dcn_expert_parallelism=2"],
    "dcn_expert_parallelism=2 needs a multiple of 2 nodes but this job has 1, and on CPU a node is one process: "
    "start 2 (maxtext-moe launch --nproc-per-node 1 --nnodes 2), or set dcn_expert_parallelism=1",
  ),
  ("override_without_equals", ["train", "cpu/deepseek3-tiny", "steps"], "expected key=value, got 'steps'"),
  ("nonfinite_policy", ["train", "on_nonfinite_loss=maybe"], "bad value for 'on_nonfinite_loss'"),
  ("nonfinite_skips", ["train", "max_nonfinite_skips=0"], "bad value for 'max_nonfinite_skips'"),
  (
    "bos_missing_for_concat_then_split",  # Qwen3's tokenizer has no BOS; grain raised from inside the pipeline
    [
      "train",
      "dataset_type=grain",
      f"grain_train_files={REPO / 'README.md'}",
      "train_data_columns=[text]",
      "tokenizer_type=huggingface",
      f"tokenizer_path={REPO / 'tests' / 'fixtures' / 'chat_tokenizers' / 'qwen3'}",
      "vocab_from_tokenizer=true",
      "grain_packing_type=concat_then_split",
    ],
    "add_bos=true with grain_packing_type=concat_then_split starts every packed row with the BOS token, and the "
    f"tokenizer at {REPO / 'tests' / 'fixtures' / 'chat_tokenizers' / 'qwen3'} has no BOS token (Qwen3's has "
    "none); set add_bos=false",
  ),
  (
    "keep_no_checkpoint",
    ["train", "max_num_checkpoints_to_keep=0"],
    "max_num_checkpoints_to_keep=0 would delete every checkpoint as soon as it is saved, the last one included; "
    "keep at least 1",
  ),
  # the MoE block and the GPU path
  ("no_sparse_matmul", ["train", "sparse_matmul=false"], "moe_impl=dropless replaces MaxText's sparse_matmul path"),
  (
    "pipeline_stages_not_dividing_layers",  # the tiny model's 3 MoE layers over 2 stages
    ["train", "ici_pipeline_parallelism=2"],
    "pipeline stages: the 3 pipelined layers (pipeline_parallel_layers; by default all the decoder's MoE layers) "
    "do not split into 2 stages x num_layers_per_pipeline_stage=1; set pipeline_parallel_layers=2 (the other 1 run "
    "outside the pipeline), or a stage count",
  ),
  (
    "pipeline_layers_per_stage_not_dividing",  # 4 MoE layers: 2 stages of 3 layers
    [
      "train",
      "base_num_decoder_layers=5",
      "override_model_config=true",
      "ici_pipeline_parallelism=2",
      "num_layers_per_pipeline_stage=3",
    ],
    "do not split into 2 stages x num_layers_per_pipeline_stage=3; set num_layers_per_pipeline_stage=1 or 2, or",
  ),
  (
    "pipeline_repeats_not_dividing",  # 4 MoE layers: 2 stages x 1 layer x 3 repeats
    [
      "train",
      "base_num_decoder_layers=5",
      "override_model_config=true",
      "ici_pipeline_parallelism=2",
      "num_pipeline_repeats=3",
    ],
    "x num_pipeline_repeats=3; set num_pipeline_repeats=2 (or -1: derived)",
  ),
  (
    "pipeline_microbatches_not_a_multiple_of_stages",
    ["train", "ici_pipeline_parallelism=2", "pipeline_parallel_layers=2", "num_pipeline_microbatches=3"],
    "The number of microbatches (3) must be divisible by the number of stages (2)",
  ),
  (
    "pipeline_prefetching_per_repeat_with_moe",  # a circular pipeline (2 repeats), MaxText's prefetching kind
    [
      "train",
      "base_num_decoder_layers=5",
      "override_model_config=true",
      "ici_pipeline_parallelism=2",
      "pipeline_fsdp_ag_per_repeat=true",
    ],
    "pipeline_fsdp_ag_per_repeat=true with MoE layers: MaxText's prefetching pipeline keeps only the layer records",
  ),
  (
    "pipeline_with_load_balance_loss",
    ["train", "ici_pipeline_parallelism=2", "pipeline_parallel_layers=2", "load_balance_loss_weight=0.01"],
    "pipeline stages (2) with load_balance_loss_weight=0.01: MaxText averages the pipelined layers' load-balance",
  ),
  (
    "pipeline_with_maxtext_block",
    ["train", "ici_pipeline_parallelism=2", "pipeline_parallel_layers=2", "moe_impl=maxtext"],
    "pipeline stages (2) with moe_impl=maxtext: MaxText's own MoE block takes a routing-bias sign per microbatch",
  ),
  (
    "pipeline_with_te_ep",
    [
      "train",
      "ici_pipeline_parallelism=2",
      "pipeline_parallel_layers=2",
      "moe_dispatch=te_ep",
      "ici_expert_parallelism=2",
    ],
    "moe_dispatch=te_ep does not run inside pipeline stages (2)",
  ),
  (
    "pipeline_microbatch_smaller_than_its_split",  # 64 sequences in 32 microbatches of 2, split over EP 4
    [
      "train",
      "ici_pipeline_parallelism=2",
      "pipeline_parallel_layers=2",
      "ici_expert_parallelism=4",
      "num_pipeline_microbatches=32",
    ],
    "pipeline stages: 32 microbatches of the step's 64 sequences do not split over a stage's 4 devices on the batch "
    "(expert=4): each microbatch is 2 sequences; set num_pipeline_microbatches=16",
  ),
  (
    "pipeline_microbatch_split_across_nodes",  # a stage's 16 GPUs (data 2 x EP 8) share 8 sequences a microbatch
    [*STAGED_PROXY, "num_pipeline_microbatches=8"],
    "8 microbatches of the step's 64 sequences do not split over a stage's 16 devices on the batch (data=2 x "
    "expert=8): each microbatch is 8 sequences; set num_pipeline_microbatches=4",
  ),
  (
    "pipeline_with_te_quantized_dense",  # TE 2.20's quantize has no working vmap rule
    [*STAGED_PROXY, "num_pipeline_microbatches=4", "quantization=te_fp8_delayedscaling"],
    "quantization=te_fp8_delayedscaling does not run inside pipeline stages (2): Transformer Engine's quantize "
    "cannot be vmapped over the stages",
  ),
  (
    "pipeline_with_te_grouped_gemm",  # TE 2.20's grouped GEMM and quantize have no working vmap rule
    ["train", "ici_pipeline_parallelism=2", "pipeline_parallel_layers=2", "moe_gemm_backend=te"],
    "moe_gemm_backend=te moe_gemm_quantization=none does not run inside pipeline stages (2): Transformer Engine's "
    "grouped GEMM and quantize cannot be vmapped over the stages",
  ),
  (
    "exchange_chunks_not_dividing_a_devices_tokens",  # the job's 8 devices: train's preflight
    ["train", "ici_expert_parallelism=2", "moe_exchange_chunks=3"],
    "moe_exchange_chunks=3 does not divide the 2,048 tokens a device holds in each MoE layer, so the exchange "
    "would run one chunk with 3x the buffers and nothing beside the GEMMs; set moe_exchange_chunks=2 or 4, or 0",
  ),
  (
    "exchange_chunks_not_dividing_a_microbatch",  # the recipe's 32 GPUs: the config check
    [*STAGED_PROXY, "num_pipeline_microbatches=4", "moe_exchange_chunks=6"],
    # 64 sequences in 4 microbatches of 16, over a stage's 16 devices: one sequence of 4,096 tokens each
    "moe_exchange_chunks=6 does not divide the 4,096 tokens a device holds in a pipelined layer's microbatch, so "
    "the exchange would run one chunk with 6x the buffers and nothing beside the GEMMs; set moe_exchange_chunks=4 "
    "or 8, or 0",
  ),
  # expert parallelism across nodes
  (
    "cross_node_groups_not_on_nodes",  # 3 routing groups of the tiny model's 48 experts on 2 nodes
    [
      "train",
      "--nodes",
      "2",
      "dcn_expert_parallelism=2",
      "dcn_data_parallelism=1",
      "num_experts=48",
      "n_routing_groups=3",
      "topk_routing_group=1",
      "override_model_config=true",
    ],
    "n_routing_groups=3 do not split evenly over the 2 nodes expert parallelism spans (dcn_expert_parallelism)",
  ),
  (
    "cross_node_ragged",
    ["train", "--nodes", "2", "dcn_expert_parallelism=2", "dcn_data_parallelism=1", "moe_dispatch=ragged_all_to_all"],
    "moe_dispatch=ragged_all_to_all exchanges over the whole expert axis and cannot go by node",
  ),
  (
    "cross_node_capacity",
    [
      "train",
      "--nodes",
      "2",
      "dcn_expert_parallelism=2",
      "dcn_data_parallelism=1",
      "moe_dispatch=all_to_all",
      "moe_buffers=worst_case",
      "moe_capacity_factor=1",
    ],
    "expert parallelism across 2 nodes runs moe_dispatch=all_to_all in dropless rounds, which take no",
  ),
  (
    "cross_node_ep_not_dividing_experts",  # 16 experts over EP 3 x 2 nodes
    ["train", "--nodes", "2", "ici_expert_parallelism=3", "dcn_expert_parallelism=2", "dcn_data_parallelism=1"],
    "num_experts=16 is not divisible by expert parallelism 6",
  ),
  (
    "buffer_factor_below_the_mean",
    ["train", "moe_buffer_factor=0.5"],
    "moe_buffer_factor=0.5 sizes the dropless buffers below the mean load",
  ),
  ("te_ep_here", ["train", "moe_dispatch=te_ep", "ici_expert_parallelism=2"], "moe_dispatch=te_ep cannot run here:"),
  ("te_gemm_here", ["train", "moe_gemm_backend=te"], "moe_gemm_backend=te needs Transformer Engine on a GPU"),
  ("fp8_without_te", ["train", "moe_gemm_quantization=fp8"], "moe_gemm_quantization=fp8 needs moe_gemm_backend=te"),
  ("ragged_on_cpu", ["train", "moe_dispatch=ragged_all_to_all"], "moe_dispatch=ragged_all_to_all needs a GPU or TPU"),
  (
    "capacity_with_ragged",
    ["train", "moe_dispatch=ragged_all_to_all", "moe_capacity_factor=1.5"],
    "is always dropless",
  ),
  # recipes
  (
    "misspelled_recipe",
    ["train", "cpu/deepseek3-tini"],
    "unknown recipe 'cpu/deepseek3-tini'; did you mean 'cpu/deepseek3-tiny'?",
  ),
  ("invalid_yaml", ["train", "{tmp}/bad.yml"], "bad.yml: invalid YAML at line 3, column 1: "),
  ("empty_recipe_file", ["train", "{tmp}/empty.yml"], "empty.yml is empty: a recipe file starts with base_config: "),
  (
    "recipe_not_on_our_base",
    ["plan", "{tmp}/nobase.yml"],
    "nobase.yml is not layered on maxtext-moe's base: a recipe file starts with base_config: ${moe_configs:base.yml}",
  ),
  (
    "steps_zero",
    ["train", "steps=0"],
    "MaxText refuses this config: You must set steps or learning_rate_schedule_steps to a positive integer.",
  ),
  ("yaml_extension", ["train", "{tmp}/recipe.yaml"], "config files must end in .yml (MaxText's rule)"),
  # paths and data
  ("output_is_a_file", ["train", "base_output_directory={tmp}/plainfile/runs"], "plainfile is a file, so "),
  (
    "output_unwritable",
    ["train", "base_output_directory=/proc/runs"],
    "base_output_directory=/proc/runs: /proc is not writable",
  ),
  ("no_data_files", ["train", "grain_train_files={tmp}/none/*.parquet"], "grain_train_files="),
  (
    "no_tokenizer",
    ["train", "tokenizer_path={tmp}/missing.model"],
    "missing.model does not exist (tokenizer_type=sentencepiece)",
  ),
  # checkpoints and fine-tuning
  ("finetune_without_weights", ["train", FT], "finetune=true needs weights to start from: set load_parameters_path"),
  ("finetune_missing_checkpoint", ["train", FT, "load_parameters_path={tmp}/ckpt/items"], "does not exist"),
  ("finetune_not_orbax", ["train", FT, "load_parameters_path={tmp}"], "is not an Orbax checkpoint (no _METADATA)"),
  # conversion
  ("convert_without_hf", ["convert", "hf-to-maxtext", "--out", "{tmp}/out"], "hf-to-maxtext needs --hf DIR"),
  ("convert_without_ckpt", ["convert", "maxtext-to-hf", "--out", "{tmp}/out"], "maxtext-to-hf needs --ckpt DIR"),
  (
    "convert_out_under_file",
    ["convert", "hf-to-maxtext", "--hf", str(FIXTURE), "--out", "{tmp}/plainfile/x"],
    "plainfile is a file",
  ),
  (
    "convert_out_exists",
    ["convert", "hf-to-maxtext", "--hf", str(FIXTURE), "--out", "{tmp}"],
    "already exists; pass --force",
  ),
  ("convert_hf_missing", ["convert", "hf-to-maxtext", "--hf", "{tmp}/nohf", "--out", "{tmp}/out"], "nohf"),
  # SFT data (checked before anything is compiled or written)
  ("sft_no_messages_column", [*SFT, "grain_train_files={tmp}/text.parquet"], "text.parquet has no 'messages' column"),
  (
    "sft_unknown_role",
    [*SFT, "grain_train_files={tmp}/tool.jsonl"],
    "tool.jsonl line 1: turn 1 has the unknown role 'tool'",
  ),
  ("sft_no_assistant", [*SFT, "grain_train_files={tmp}/noanswer.jsonl"], "noanswer.jsonl line 2: no assistant turn"),
  ("sft_not_json", [*SFT, "grain_train_files={tmp}/broken.jsonl"], "broken.jsonl line 1: not valid JSON"),
  ("sft_empty_eval", [*SFT, "grain_eval_files={tmp}/empty.jsonl"], "the held-out split is empty"),
  ("sft_tokenizer_missing", [*SFT, "tokenizer_path={tmp}/notok"], "is not a directory (tokenizer_type=huggingface)"),
  ("sft_no_template", [*SFT, "tokenizer_path={tmp}/tok_plain"], "has no chat template; set chat_template"),
  ("sft_template_fails", [*SFT, "tokenizer_path={tmp}/tok_bad"], "line 1: the chat template does not render"),
  ("sft_too_long", [*SFT, "max_target_length=8", "sft_overlength=refuse"], "are longer than max_target_length=8"),
  ("sft_eval_without_weights", ["eval", "cpu/deepseek3-tiny-sft", "finetune=false"], "eval needs load_parameters_path"),
  # report
  ("report_missing", ["report", "{tmp}/norun"], "norun is not a directory"),
  ("report_foreign", ["report", "{tmp}"], "is not a maxtext-moe run directory"),
  # plan, bench, k8s
  ("plan_without_recipe", ["plan"], "plan needs a RECIPE"),
  ("plan_zero_gpus", ["plan", H200, "--gpus", "0"], "--gpus must be >= 1, got 0"),
  (
    "plan_capacity_below_one_for_auto_te_ep",  # auto is te_ep on this recipe's GPUs: the launch would refuse it
    ["plan", H200, "moe_capacity_factor=0.5"],
    "moe_dispatch=te_ep takes moe_capacity_factor 0 (dropless) or >= 1, got 0.5 (moe_dispatch=auto resolves",
  ),
  ("plan_time_cpu_recipe", ["plan", "cpu/deepseek3-tiny", "--time"], "this recipe runs on CPU"),
  ("plan_compiled_not_a_report", ["plan", H200, "--time", "--compiled", "{tmp}"], "not a compile report"),
  ("plan_compiled_without_time", ["plan", H200, "--compiled", "{tmp}"], "pass --time with it"),
  # compile --hlo DIR: asked about before the compile's minutes (XLA only logs a dump it cannot write)
  ("compile_hlo_is_a_file", ["compile", H200, "--hlo", "{tmp}/plainfile"], "plainfile is a file, not a directory"),
  ("compile_hlo_under_a_file", ["compile", H200, "--hlo", "{tmp}/plainfile/hlo"], "plainfile is a file, so"),
  ("compile_hlo_unwritable", ["compile", H200, "--hlo", "/proc/hlo"], "--hlo /proc/hlo: /proc is not writable"),
  ("compile_memory_not_a_number", ["compile", H200, "--memory", "lots"], "--memory lots: give the GiB of device"),
  ("compile_memory_zero", ["compile", H200, "--memory", "0"], "--memory 0: give the GiB of device memory"),
  ("bench_te_here", ["bench", "moe", "--backends", "te"], "bench moe --backends te needs Transformer Engine on a GPU"),
  (
    "k8s_wrong_nodes",
    ["k8s", "gb200-nvl72/deepseek3-671b", "--nodes", "20", "--image", "x"],
    "20 nodes x 4 GPUs = 80 GPUs is not a whole number of NVLink domains of 64 GPUs; use --nodes 16 or 32",
  ),
  ("k8s_bad_name", ["k8s", H200, "--nodes", "1", "--image", "x", "--name", "Bad_Name"], "--name 'Bad_Name'"),
  # distributed
  (
    "flags_not_together",
    ["train", "--coordinator", "127.0.0.1:1234"],
    "--coordinator, --num-processes and --process-id go together",
  ),
  (
    "coordinator_not_host_port",
    ["train", "--coordinator", "x", "--num-processes", "2", "--process-id", "0"],
    "is not HOST:PORT",
  ),
  (
    "process_id_out_of_range",
    ["train", "--coordinator", "h:1", "--num-processes", "2", "--process-id", "5"],
    "process id 5 is not in 0..1",
  ),
  ("init_timeout_zero", ["train", "--init-timeout", "0"], "--init-timeout must be > 0 seconds, got 0"),
  (
    "coordinator_unreachable",
    ["train", "--coordinator", "127.0.0.1:9", "--num-processes", "2", "--process-id", "1", "--init-timeout", "1"],
    "process 1 could not reach the coordinator 127.0.0.1:9 within 1 s",
  ),
  ("slurm_inconsistent", ["train", "ENV:slurm"], "SLURM: process id 2 is not in 0..1"),
  ("launch_zero_procs", ["launch", "--nproc-per-node", "0", "--", "train"], "--nproc-per-node must be >= 1"),
  (
    "launch_nodes_without_coordinator",
    ["launch", "--nproc-per-node", "2", "--nnodes", "2", "--", "train"],
    "2 nodes need --coordinator",
  ),
  ("launch_without_command", ["launch", "--nproc-per-node", "2"], "launch needs the command to run after '--'"),
  # k8s checks the layout as plan does before it writes anything; plan --search --write keeps a file it finds
  (
    "k8s_nodes_plan_refuses",  # the case: 3 nodes of a layout whose DCN degrees make 32
    ["k8s", "h100x8/deepseek3-671b", "--nodes", "3", "--image", "x"],
    "3 NVLink domains do not divide by the fixed DCN degrees' product 32; use --nodes 32",
  ),
  (
    "k8s_does_not_fit",
    ["k8s", "h100x8/deepseek3-671b", "offload=none", "--image", "x"],
    "h100x8/deepseek3-671b on 32 node(s) does not fit: ",
  ),
  (
    "k8s_data_claim_name",
    ["k8s", H200, "--nodes", "1", "--image", "x", "--data-claim", "My_Data"],
    "--data-claim 'My_Data': give a PersistentVolumeClaim's name",
  ),
  (
    "k8s_data_claim_over_checkpoints",
    ["k8s", H200, "--nodes", "1", "--image", "x", "--data-claim", "ds:/checkpoints/ds"],
    "--data-claim 'ds:/checkpoints/ds': /checkpoints/ds would share a path with --checkpoint-claim",
  ),
  (
    "k8s_two_data_claims_one_path",
    ["k8s", H200, "--nodes", "1", "--image", "x", "--data-claim", "a", "--data-claim", "b"],
    "--data-claim 'b': /data would share a path with --data-claim a",
  ),
  (
    "plan_write_over_a_file",
    ["plan", "deepseek3-tiny", "--gpu", "h100", "--nodes", "1", "--search", "--write", "{tmp}/bad.yml"],
    "--write {tmp}/bad.yml already exists; pass --force to replace it",
  ),
  ("plan_force_without_search", ["plan", H200, "--force"], "--force goes with --write FILE.yml"),
  ("plan_check_with_time", ["plan", H200, "--check", "--time"], "--time does not go with --check"),
]


def _sft_inputs(d):
  """Conversation files and tokenizer directories for the SFT cases."""
  import json
  import shutil

  import pyarrow as pa
  import pyarrow.parquet as pq

  from maxtext_moe.data import arithmetic

  good = json.dumps(arithmetic.conversation(12, 34))
  pq.write_table(pa.table({"text": ["hello"]}), d / "text.parquet")
  (d / "tool.jsonl").write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "x"}]}\n')
  (d / "noanswer.jsonl").write_text(good + '\n{"messages": [{"role": "user", "content": "hi"}]}\n')
  (d / "broken.jsonl").write_text('{"messages": [\n')
  (d / "empty.jsonl").write_text("\n")
  for name, template in (("tok_plain", None), ("tok_bad", "{{ messages[0]['content'] + 1 }}")):
    shutil.copytree(arithmetic.example_dir() / "tokenizer", d / name)
    cfg_path = d / name / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text())
    tok_cfg.pop("chat_template", None)
    (d / name / "chat_template.jinja").unlink(missing_ok=True)
    if template:
      tok_cfg["chat_template"] = template
    cfg_path.write_text(json.dumps(tok_cfg))


@pytest.fixture
def case_dir(tmp_path, monkeypatch):
  """A working directory with the inputs some cases need; the environment and Python's hooks restored."""
  (tmp_path / "plainfile").write_text("not a directory")
  (tmp_path / "bad.yml").write_text("base_config: deepseek3-tiny.yml\nsteps: 3\n: oops\n")
  (tmp_path / "recipe.yaml").write_text("steps: 3\n")
  (tmp_path / "empty.yml").write_text("")
  (tmp_path / "nobase.yml").write_text("steps: 3\n")
  _sft_inputs(tmp_path)
  monkeypatch.chdir(tmp_path)
  saved_env = dict(os.environ)
  monkeypatch.setattr(sys, "unraisablehook", sys.unraisablehook)
  monkeypatch.setattr(threading, "excepthook", threading.excepthook)
  monkeypatch.setattr(cli, "last_word", lambda line, verbose: print(line, file=sys.stderr))
  yield tmp_path
  os.environ.clear()
  os.environ.update(saved_env)


@pytest.mark.parametrize(("name", "argv", "expected"), CASES, ids=[f"bad_input_{c[0]}" for c in CASES])
def test_bad_input(name, argv, expected, case_dir, capfd, monkeypatch):
  del name
  if argv[1:2] == ["ENV:slurm"]:
    argv = argv[:1]
    for key, value in SLURM_BAD.items():
      monkeypatch.setenv(key, value)
  argv = [a.replace("{tmp}", str(case_dir)) for a in argv]
  before = sorted(p.relative_to(case_dir) for p in case_dir.rglob("*"))
  code = cli.main(argv)
  err = capfd.readouterr().err
  lines = [line for line in err.splitlines() if line.startswith("maxtext-moe: error:")]
  assert code == 2, err[-3000:]
  assert len(lines) == 1 and expected.replace("{tmp}", str(case_dir)) in lines[0], err[-3000:]
  assert "Traceback" not in err
  assert sorted(p.relative_to(case_dir) for p in case_dir.rglob("*")) == before, "nothing left behind"
