"""The `maxtext-moe` command line.

  maxtext-moe train [RECIPE] [key=value ...]    run MaxText's trainer on a recipe (default: tiny CPU model)
  maxtext-moe config RECIPE [key=value ...]     print the resolved config and what our layers changed
  maxtext-moe recipes                           list the shipped recipes
  maxtext-moe flags RECIPE [key=value ...]      print the recipe's XLA/NCCL environment as export lines
  maxtext-moe plan RECIPE [--gpus N] [--gpu-mem GiB]   per-GPU memory estimate, fit verdict, cheapest fix, FLOPs
  maxtext-moe bench {moe,convert,plan} [--json]  benchmark tables
  maxtext-moe convert hf-to-maxtext --hf DIR --model RECIPE --out DIR     HF DeepSeek-V3 -> MaxText
  maxtext-moe convert maxtext-to-hf --ckpt DIR --model RECIPE --out DIR   MaxText -> HF (bf16)

Bad input (unknown key or recipe, wrong type, impossible layout) prints one line and exits with 2.
"""

import argparse
import os
import sys

from maxtext_moe.errors import UserError

_EPILOG = """Overrides use MaxText's key=value grammar, e.g.: maxtext-moe train cpu/deepseek3-tiny steps=20
run_name=demo. A key that the model file also sets needs override_model_config=true."""


def _split(args: list[str]) -> tuple[str | None, list[str]]:
  """First argument without '=' is the recipe; the rest are key=value overrides."""
  if args and "=" not in args[0]:
    return args[0], args[1:]
  return None, args


def _cmd_train(ns: argparse.Namespace) -> int:
  from maxtext_moe.launch.train import train

  recipe, overrides = _split(ns.args)
  train(recipe, overrides, verbose=ns.verbose)
  return 0


def _cmd_config(ns: argparse.Namespace) -> int:
  from maxtext_moe.launch.show import show_config, show_keys

  if ns.keys:
    print(show_keys())
    return 0
  recipe, overrides = _split(ns.args)
  if recipe is None:
    raise UserError("config needs a RECIPE (see 'maxtext-moe recipes')")
  print(show_config(recipe, overrides, show_all=ns.all))
  return 0


def _cmd_recipes(ns: argparse.Namespace) -> int:
  from maxtext_moe.config.recipes import DEFAULT_RECIPE, list_recipes

  del ns
  for name in list_recipes():
    print(f"{name}{'  (default)' if name == DEFAULT_RECIPE else ''}")
  return 0


def _cmd_plan(ns: argparse.Namespace) -> int:
  import json

  from maxtext_moe import planner

  recipe, overrides = _split(ns.args)
  if recipe is None:
    raise UserError("plan needs a RECIPE (see 'maxtext-moe recipes')")
  if ns.gpus is not None and ns.gpus < 1:
    raise UserError(f"--gpus must be >= 1, got {ns.gpus}")
  if ns.gpu_mem is not None and ns.gpu_mem <= 0:
    raise UserError(f"--gpu-mem must be > 0 GiB, got {ns.gpu_mem}")
  if not 0 < ns.mfu <= 1:
    raise UserError(f"--mfu must be in (0, 1], got {ns.mfu}")
  result = planner.plan(recipe, overrides, gpus=ns.gpus, gpu_mem_gib=ns.gpu_mem, mfu=ns.mfu)
  print(result.table())
  if ns.json:
    print(json.dumps(result.as_dict()))
  return 0 if result.base.fits else 1


def _cmd_bench(ns: argparse.Namespace) -> int:
  if ns.which == "plan":
    from maxtext_moe.bench import plan

    plan.run(as_json=ns.json, quick=ns.quick)
    return 0
  if ns.which == "convert":
    from maxtext_moe.bench import convert

    convert.run(as_json=ns.json, workdir=ns.workdir)
    return 0
  import jax

  from maxtext_moe.bench import moe
  from maxtext_moe.launch import flags

  if jax.default_backend() == "cpu":  # measure under the environment `train` runs with on CPU
    argv = ["bench", "moe", *(["--json"] if ns.json else []), *(["--backends", *ns.backends] if ns.backends else [])]
    flags.ensure_applied(flags.profile("cpu"), argv)
  moe.run(as_json=ns.json, backends=ns.backends)
  return 0


def _cmd_flags(ns: argparse.Namespace) -> int:
  from maxtext_moe import maxtext_adapter
  from maxtext_moe.config.recipes import recipe_path
  from maxtext_moe.launch import flags

  recipe, overrides = _split(ns.args)
  if recipe is None:
    raise UserError("flags needs a RECIPE (see 'maxtext-moe recipes')")
  run_flags = flags.for_config(maxtext_adapter.resolve(recipe_path(recipe), overrides))
  if not ns.no_check:
    flags.probe(run_flags.xla_flags)
  print(run_flags.export_lines())
  return 0


def _cmd_convert(ns: argparse.Namespace) -> int:
  from maxtext_moe.checkpoint.host_memory import bound_host_memory

  bound_host_memory()  # before JAX and TensorStore start their threads
  from maxtext_moe.checkpoint import convert  # pylint: disable=wrong-import-position

  if ns.direction == "hf-to-maxtext":
    if not ns.hf:
      raise UserError("hf-to-maxtext needs --hf DIR (a Hugging Face model directory)")
    summary = convert.hf_to_maxtext(ns.hf, ns.model, ns.out, overrides=ns.overrides, dtype=ns.dtype, force=ns.force)
    print(f"maxtext-moe: wrote {summary['bytes_written'] / 1e9:.2f} GB in {summary['seconds']:.1f} s to {ns.out}")
    if summary["ignored_hf_tensors"]:
      n = len(summary["ignored_hf_tensors"])
      print(f"maxtext-moe: left out {n} HF tensors this model has no place for: {summary['ignored_summary']}")
    print(f"maxtext-moe: train from it with load_parameters_path={summary['load_parameters_path']}")
  else:
    if not ns.ckpt:
      raise UserError("maxtext-to-hf needs --ckpt DIR (a MaxText parameter checkpoint)")
    summary = convert.maxtext_to_hf(
      ns.ckpt, ns.model, ns.out, overrides=ns.overrides, force=ns.force, max_shard_gb=ns.max_shard_gb
    )
    print(f"maxtext-moe: wrote {summary['bytes_written'] / 1e9:.2f} GB in {summary['seconds']:.1f} s to {ns.out}")
  return 0


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
    prog="maxtext-moe", description="Dropless DeepSeek-V3-class MoE training on MaxText.", epilog=_EPILOG
  )
  sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

  p = sub.add_parser(
    "train",
    help="train a recipe (default: the tiny DeepSeek-V3-shaped model on CPU)",
    epilog=_EPILOG,
    description="Run MaxText's trainer on RECIPE (default cpu/deepseek3-tiny) with key=value overrides. "
    "Writes Orbax checkpoints, metrics.jsonl and loss.png under base_output_directory/run_name; "
    "rerunning with the same run_name resumes from the last checkpoint.",
  )
  p.add_argument("args", nargs="*", metavar="[RECIPE] [key=value]")
  p.add_argument("-v", "--verbose", action="store_true", help="show MaxText's own INFO logging")
  p.set_defaults(func=_cmd_train)

  p = sub.add_parser(
    "config",
    help="print a recipe's resolved config",
    epilog=_EPILOG,
    description="Resolve RECIPE plus overrides without training: print the plugin's keys and every key "
    "whose value differs from MaxText's own base.yml.",
  )
  p.add_argument("args", nargs="*", metavar="RECIPE [key=value]")
  p.add_argument("--all", action="store_true", help="print every key, not only the ones that differ")
  p.add_argument("--keys", action="store_true", help="list the plugin's own keys with their descriptions")
  p.set_defaults(func=_cmd_config)

  p = sub.add_parser(
    "flags",
    help="print a recipe's XLA/NCCL environment as export lines",
    epilog='Example, in a SLURM script: eval "$(maxtext-moe flags gb200-nvl72/deepseek3-671b)"',
    description="Resolve RECIPE plus overrides and print the `export` lines of its flag profile "
    "(configs/flags/profiles.yml, chosen by recipe_hardware or flag_profile) plus xla_flags_extra and "
    "env_extra. Every XLA flag is first checked against the installed jaxlib. `train` applies the same "
    "environment itself.",
  )
  p.add_argument("args", nargs="*", metavar="RECIPE [key=value]")
  p.add_argument("--no-check", action="store_true", help="skip checking the XLA flags against the installed jaxlib")
  p.set_defaults(func=_cmd_flags)

  p = sub.add_parser(
    "plan",
    help="estimate per-GPU memory and throughput; say whether a recipe fits and what would make it fit",
    epilog="Exit code: 0 fits, 1 does not fit, 2 bad input. Example: maxtext-moe plan gb300x1024/deepseek3-671b",
    description="Estimate one device's memory at the training step's peak for RECIPE plus overrides, by "
    "component: parameters, gradients, Adam state, saved activations under the remat/offload policy, the "
    "loss phase's logits, MoE dispatch buffers and attention; plus host memory for offloaded state. Says "
    "whether it fits the GPU's HBM (times the flag profile's XLA_PYTHON_CLIENT_MEM_FRACTION) and, if not, "
    "the cheapest change that does: an offload preset, another EP/FSDP split, or a smaller micro-batch. "
    "Prints training FLOPs per token (MaxText's count) and TFLOP/s per GPU at --mfu. Nothing is compiled; "
    "'maxtext-moe bench plan' checks the estimate against XLA's compiled memory_analysis() on CPU.",
  )
  p.add_argument("args", nargs="*", metavar="RECIPE [key=value]")
  p.add_argument("--gpus", type=int, help="number of GPUs (default: the recipe's recipe_num_devices)")
  p.add_argument("--gpu-mem", type=float, help="usable memory per GPU in GiB (default: the hardware's HBM)")
  p.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilization for the throughput line (0.4)")
  p.add_argument("--json", action="store_true", help="also print the plan as one JSON object (last line)")
  p.set_defaults(func=_cmd_plan)

  p = sub.add_parser("recipes", help="list the shipped recipes", description="List configs/recipes/<hw>/<model>.")
  p.set_defaults(func=_cmd_recipes)

  p = sub.add_parser(
    "bench",
    help="run a benchmark and print its table",
    description="moe: grouped-GEMM efficiency per backend (vs a dense matmul of equal FLOPs), MaxText "
    "RoutedMoE forward+backward time for stock sparse_matmul, stock dense_matmul and ours, and the "
    "all_to_all dispatcher's dedup ratio at EP=8. Shapes are documented in maxtext_moe/bench/moe.py. "
    "About 2-3 minutes on 2 CPU cores. convert: HF FP8 -> MaxText conversion of a synthetic ~1.5 GB "
    "checkpoint: GB/s next to a plain file copy, and peak memory over the largest tensor group "
    "(maxtext_moe/bench/convert.py). Needs ~5 GB of temporary disk. plan: the planner's per-device memory "
    "estimate against XLA's compiled memory_analysis() for tiny and 16B-proxy configs on 8 fake CPU devices "
    "(maxtext_moe/bench/plan.py); about 5 minutes on 2 cores, --quick about 1.",
  )
  p.add_argument("which", choices=["moe", "convert", "plan"], help="which benchmark")
  p.add_argument("--quick", action="store_true", help="plan: only the two tiny cases")
  p.add_argument("--workdir", help="convert: where to put the temporary checkpoints (default: the temp dir)")
  p.add_argument("--json", action="store_true", help="also print the results as one JSON object (last line)")
  p.add_argument(
    "--backends",
    nargs="+",
    choices=["tiled", "ragged_dot", "tokamax"],
    default=None,
    help="grouped-GEMM backends to measure (default: all)",
  )
  p.set_defaults(func=_cmd_bench)

  p = sub.add_parser(
    "convert",
    help="convert DeepSeek-V3 checkpoints between Hugging Face and MaxText",
    description="hf-to-maxtext: Hugging Face safetensors (BF16, or FP8 e4m3 with 128x128 weight_scale_inv "
    "blocks, dequantized on the fly) -> a MaxText Orbax parameter checkpoint at OUT/items, for "
    "load_parameters_path. maxtext-to-hf: the reverse, as bf16 safetensors shards + index + config.json. "
    "Both stream one (layer, expert) slice at a time, check config and every tensor's shape before "
    "writing, and write into a temporary directory renamed at the end.",
    epilog="Example: maxtext-moe convert hf-to-maxtext --hf /data/DeepSeek-V3 --model gb200-nvl72/deepseek3-671b "
    "--out /ckpt/dsv3",
  )
  p.add_argument("direction", choices=["hf-to-maxtext", "maxtext-to-hf"])
  p.add_argument("--hf", help="Hugging Face model directory (config.json + *.safetensors) to read")
  p.add_argument("--ckpt", help="MaxText parameter checkpoint to read (OUT of hf-to-maxtext, or OUT/items)")
  p.add_argument("--model", required=True, help="recipe whose model to use, e.g. gb200-nvl72/deepseek3-671b")
  p.add_argument("--out", required=True, help="directory to create")
  p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="hf-to-maxtext weight dtype")
  p.add_argument("--max-shard-gb", type=float, default=5.0, help="maxtext-to-hf shard size (default 5)")
  p.add_argument("--force", action="store_true", help="replace OUT if it exists (after the new one is complete)")
  p.add_argument("overrides", nargs="*", metavar="key=value", help="model config overrides, as for train")
  p.set_defaults(func=_cmd_convert)
  return parser


def _quiet_env() -> None:
  """Less start-up noise from XLA's C++ logging and transformers (set before jax is imported)."""
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
  os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")


def main(argv: list[str] | None = None) -> int:
  parser = build_parser()
  ns, extra = parser.parse_known_args(argv)
  if extra:  # key=value overrides may follow convert's options; anything else is an error
    if getattr(ns, "command", None) != "convert" or any(a.startswith("-") or "=" not in a for a in extra):
      parser.error(f"unrecognized arguments: {' '.join(extra)}")
    ns.overrides = [*ns.overrides, *extra]
  _quiet_env()
  try:
    return ns.func(ns)
  except UserError as e:
    print(f"maxtext-moe: error: {e}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    print("maxtext-moe: interrupted", file=sys.stderr)
    return 130


if __name__ == "__main__":
  sys.exit(main())
