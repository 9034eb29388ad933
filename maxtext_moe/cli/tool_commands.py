"""The commands around training: plan (plan_commands.py), bench (benchmarks), convert (checkpoints), doctor,
k8s (k8s_commands.py)."""

import argparse
import json
from typing import IO

from maxtext_moe.cli import k8s_commands, plan_commands
from maxtext_moe.errors import UserError


def _bench(ns: argparse.Namespace, out: IO[str]) -> int:
  if ns.which == "plan":
    from maxtext_moe.bench import plan_accuracy

    if ns.te and ns.gpu is None:
      raise UserError("--te goes with --gpu: bench plan --gpu --te")
    if ns.held_out is not None:
      from maxtext_moe.bench import held_out

      held_out.run(out=out, as_json=ns.json, only=ns.held_out or None)
    elif ns.gpu is not None:
      plan_accuracy.run_gpu(out=out, as_json=ns.json, only=ns.gpu or None, te=ns.te)
    else:
      plan_accuracy.run(out=out, as_json=ns.json, quick=ns.quick)
  elif ns.which == "flags":
    from maxtext_moe.bench import flag_profiles

    flag_profiles.run(out=out, as_json=ns.json, only=ns.gpu or None)
  elif ns.which in ("timemodel", "fp8"):
    from maxtext_moe.bench import fp8_loss, timemodel

    (timemodel if ns.which == "timemodel" else fp8_loss).run(out=out, as_json=ns.json, quick=ns.quick)
  elif ns.which == "convert":
    from maxtext_moe.bench import convert_speed

    convert_speed.run(out=out, as_json=ns.json, workdir=ns.workdir)
  else:
    import jax

    from maxtext_moe.bench import moe_speed
    from maxtext_moe.config import flags
    from maxtext_moe.launch import environment
    from maxtext_moe.moe.settings import detect_platform
    from maxtext_moe.upstream.te import calls as te

    if jax.default_backend() == "cpu":  # measure under the allocator settings `train` runs with on CPU
      environment.apply(flags.profile("cpu"))
    if "te" in (ns.backends or []) and not detect_platform().te_gemm:
      raise UserError(f"bench moe --backends te needs Transformer Engine on a GPU ({te.status().reason or 'no GPU'})")
    moe_speed.run(out=out, as_json=ns.json, backends=ns.backends)
  return 0


def _size(nbytes: int) -> str:
  """1,234,567 -> '1.2 MB' (decimal units, as disks are sold)."""
  for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
    if nbytes >= scale:
      return f"{nbytes / scale:.1f} {unit}"
  return f"{nbytes} bytes"


def _convert(ns: argparse.Namespace, out: IO[str]) -> int:
  from maxtext_moe.checkpoint.host_memory import bound_host_memory

  bound_host_memory()  # before JAX and TensorStore start their threads
  from maxtext_moe.checkpoint import convert, export  # pylint: disable=wrong-import-position
  from maxtext_moe.config.paths import unwritable_reason  # pylint: disable=wrong-import-position

  why = unwritable_reason(ns.out)
  if why:
    raise UserError(f"--out {ns.out}: {why}")

  if ns.direction == "hf-to-maxtext":
    if not ns.hf:
      raise UserError("hf-to-maxtext needs --hf DIR (a Hugging Face model directory)")
    summary = convert.hf_to_maxtext(ns.hf, ns.model, ns.out, overrides=ns.overrides, dtype=ns.dtype, force=ns.force)
  else:
    if not ns.ckpt:
      raise UserError("maxtext-to-hf needs --ckpt DIR (a MaxText parameter or training checkpoint)")
    summary = export.maxtext_to_hf(
      ns.ckpt, ns.model, ns.out, overrides=ns.overrides, force=ns.force, max_shard_gb=ns.max_shard_gb, dtype=ns.dtype
    )
  print(f"maxtext-moe: wrote {_size(summary['bytes_written'])} in {summary['seconds']:.1f} s to {ns.out}", file=out)
  if summary.get("ignored_hf_tensors"):
    n = len(summary["ignored_hf_tensors"])
    print(f"maxtext-moe: left out {n} HF tensors this model has no place for: {summary['ignored_summary']}", file=out)
  for note in summary.get("notes", ()):
    print(f"maxtext-moe: note: {note}", file=out)
  if "load_parameters_path" in summary:
    print(
      f"maxtext-moe: train from it with load_parameters_path={summary['load_parameters_path']} "
      f"model_file={summary['model_file']}",
      file=out,
    )
  return 0


def _doctor(ns: argparse.Namespace, out: IO[str]) -> int:
  from maxtext_moe.tools import doctor

  report = doctor.probe()
  print(json.dumps(report) if ns.json else doctor.table(report), file=out)
  return 0


def _register_doctor(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
  p = sub.add_parser(
    "doctor",
    parents=[common],
    help="what this machine offers the MoE block, and what moe_dispatch/moe_gemm_backend=auto pick here",
    description="One table: platform and GPU compute capability, jax/jaxlib, devices per process, NCCL, "
    "whether Transformer Engine imports (and why not), whether TE's NCCL EP can serve a job from this "
    "process (SM90+, NCCL 2.30.4+, one GPU per process, 2+ processes), whether this backend compiles "
    "ragged_all_to_all, and which grouped GEMM and dispatch `auto` picks here and why. Run it inside the "
    "job's own launcher (one process per GPU) to see what a training process sees.",
    epilog="Example: srun -N1 -n8 maxtext-moe doctor --json",
  )
  p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
  p.set_defaults(func=_doctor)


def _register_bench(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
  from maxtext_moe.moe.settings import GemmBackend

  p = sub.add_parser(
    "bench",
    parents=[common],
    help="run a benchmark and print its table",
    description="moe: grouped-GEMM efficiency per backend (vs a dense matmul of equal FLOPs), MaxText "
    "RoutedMoE forward+backward time for stock sparse_matmul, stock dense_matmul and ours, and the "
    "all_to_all dispatcher's dedup ratio at EP=8. Shapes are documented in maxtext_moe/bench/moe_speed.py. "
    "About 2-3 minutes on 2 CPU cores. convert: HF FP8 -> MaxText conversion of a synthetic ~1.5 GB "
    "checkpoint: GB/s next to a plain file copy, and peak memory over the largest tensor group "
    "(maxtext_moe/bench/convert_speed.py). Needs ~5 GB of temporary disk. plan: the planner's per-device "
    "memory estimate against XLA's compiled memory_analysis() for tiny and 16B-proxy configs on 8 fake CPU "
    "devices (maxtext_moe/bench/plan_accuracy.py); about 5 minutes on 2 cores, --quick about 1. "
    "timemodel: the step-time model against published DeepSeek-V3 figures (NVIDIA's 1,068 TFLOP/s and 97%% "
    "scaling, Megatron-Core's 970 on GB200), then the fastest layouts of our block on 128 and 1,024 GB300s "
    "(maxtext_moe/bench/timemodel.py); about 8 minutes, --quick (no layout search) under 1. flags: what each GPU "
    "flag profile changes in the compiled step (async pairs, streams, command buffers, host syncs), XLA:GPU "
    "without a GPU (maxtext_moe/bench/flag_profiles.py); about 2 minutes per case, --gpu CASE for one. "
    "fp8: the tiny model's loss with FP8 dense GEMMs (quantization=fp8) against none (float32) over 100 steps "
    "(maxtext_moe/bench/fp8_loss.py); about 6 minutes, --quick 20 steps.",
  )
  p.add_argument("which", choices=["moe", "convert", "plan", "timemodel", "flags", "fp8"], help="which benchmark")
  p.add_argument("--quick", action="store_true", help="plan: the two tiny cases; timemodel: no search; fp8: 20 steps")
  p.add_argument(
    "--gpu",
    nargs="?",
    const="",
    metavar="CASE",
    help="plan: against XLA:GPU at full size, one recipe of every GPU model (compiled without a GPU; minutes "
    "each); plan and flags: CASE runs only the cases whose name contains it",
  )
  p.add_argument(
    "--te",
    action="store_true",
    help="plan --gpu: the cases with Transformer Engine's grouped GEMM, compiled in the environment "
    "./setup.sh --gpu-compile-te makes",
  )
  p.add_argument(
    "--held-out",
    nargs="?",
    const="",
    metavar="CASE",
    help="plan: the planner against XLA:GPU on every shipped GPU recipe at its nodes and the search's first three "
    "layouts on six clusters (maxtext_moe/bench/held_out.py; hours on 2 cores); CASE runs only the cases whose "
    "name contains it",
  )
  p.add_argument("--workdir", help="convert: where to put the temporary checkpoints (default: the temp dir)")
  p.add_argument("--json", action="store_true", help="print the results as one JSON object (the table goes to stderr)")
  concrete = [b.value for b in GemmBackend if b != GemmBackend.AUTO]
  p.add_argument("--backends", nargs="+", choices=concrete, help="moe: grouped-GEMM backends to measure (default: all)")
  p.set_defaults(func=_bench)


def _register_convert(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
  p = sub.add_parser(
    "convert",
    parents=[common],
    help="convert DeepSeek-V3, Qwen3-MoE and Mixtral checkpoints between Hugging Face and MaxText",
    description="hf-to-maxtext: Hugging Face safetensors (BF16, F32, or FP8 e4m3 with 128x128 "
    "weight_scale_inv blocks, dequantized on the fly) -> a MaxText Orbax parameter checkpoint at OUT/items "
    "(for load_parameters_path), with OUT/model.yml (the model read from config.json, for model_file) and "
    "OUT/hf_config.json. Families (config.json's architectures): DeepseekV3ForCausalLM (DeepSeek-V3/R1/V3.1, "
    "Moonlight, Kimi-K2, ...), Qwen3MoeForCausalLM (Qwen3-30B-A3B, Qwen3-235B-A22B, ...) and MixtralForCausalLM "
    "(Mixtral-8x7B/8x22B): the model comes from config.json, every architecture field mapped or named if "
    "MaxText cannot represent it. "
    "maxtext-to-hf: the reverse, shards + index + config.json. Both stream one (layer, expert) slice at a "
    "time, check every tensor before writing, and write into a temporary directory renamed at the end. "
    "dtype rules: matrices and norms in --dtype, e_score_correction_bias always float32.",
    epilog="Examples: maxtext-moe convert hf-to-maxtext --hf /data/DeepSeek-V3 --out /ckpt/dsv3; "
    "maxtext-moe convert hf-to-maxtext --hf /data/Qwen3-30B-A3B --out /ckpt/qwen3 (then train "
    "h200x8/qwen3-30b-a3b-finetune load_parameters_path=/ckpt/qwen3/items model_file=/ckpt/qwen3/model.yml)",
  )
  p.add_argument("direction", choices=["hf-to-maxtext", "maxtext-to-hf"])
  p.add_argument("--hf", help="Hugging Face model directory (config.json + *.safetensors) to read")
  p.add_argument("--ckpt", help="MaxText checkpoint to read (OUT of hf-to-maxtext, OUT/items, or a training step)")
  p.add_argument(
    "--model",
    help="hf-to-maxtext: a recipe whose model config.json must match (default: the model config.json describes); "
    "maxtext-to-hf: a recipe or model.yml (default: the model.yml next to --ckpt)",
  )
  p.add_argument("--out", required=True, help="directory to create")
  p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="matrices and norms (bfloat16)")
  p.add_argument("--max-shard-gb", type=float, default=5.0, help="maxtext-to-hf shard size (default 5)")
  p.add_argument("--force", action="store_true", help="replace OUT if it exists (after the new one is complete)")
  p.add_argument("overrides", nargs="*", metavar="key=value", help="model config overrides, as for train")
  p.set_defaults(func=_convert)


def register(sub: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
  plan_commands.register(sub, common)
  _register_bench(sub, common)
  _register_convert(sub, common)
  _register_doctor(sub, common)
  k8s_commands.register(sub, common)
