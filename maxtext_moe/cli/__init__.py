"""The `maxtext-moe` command line.

  maxtext-moe train [RECIPE] [--nodes N] [key=value ...]   run MaxText's trainer (default: tiny CPU model)
  maxtext-moe launch --nproc-per-node G [--nnodes N] -- train RECIPE ...   one process per GPU on this node
  maxtext-moe config RECIPE [key=value ...]     the resolved config (YAML) and what our layers changed
  maxtext-moe recipes                           the shipped recipes
  maxtext-moe flags RECIPE [key=value ...]      the recipe's XLA/NCCL environment as export lines
  maxtext-moe plan RECIPE [--nodes N] [--time]   per-GPU memory estimate, fit verdict, cheapest fix, FLOPs
  maxtext-moe plan MODEL --gpu GPU --nodes N --search [--write FILE.yml]   the layouts that fit, fastest first
  maxtext-moe compile RECIPE [--nodes N] [--json] [--hlo DIR]   the train step compiled by XLA:GPU
  maxtext-moe bench {moe,convert,plan} [--json]  benchmark tables
  maxtext-moe convert hf-to-maxtext --hf DIR --out DIR [--model RECIPE]   HF DeepseekV3 -> MaxText
  maxtext-moe convert maxtext-to-hf --ckpt DIR --out DIR [--model RECIPE] MaxText -> HF
  maxtext-moe doctor [--json]                   GPU/TE/NCCL facts here, and what `auto` picks and why
  maxtext-moe k8s RECIPE [--nodes N] --image IMAGE   Kubernetes manifests (JobSet or indexed Job + Service)
  maxtext-moe data show RECIPE [key=value ...]  training rows (SFT or text) as the model sees them
  maxtext-moe data check RECIPE [--nodes N] [key=value ...]  every row checked; the steps an epoch lasts
  maxtext-moe eval RECIPE load_parameters_path=... held-out completion loss and greedy exact match
  maxtext-moe report RUN_DIR [--json]           a run's plots and summary, rebuilt from its files

Each command's standard output carries only its output (`cli.output`). Bad input (unknown key or recipe,
wrong type, impossible layout) prints one line on standard error and exits with 2. A reader of standard
output that stops early (`maxtext-moe flags RECIPE | head -3`) ends a command as it ends a Unix tool:
quietly, exit 141.
"""

import argparse
import ctypes
import os
import sys
import threading
import warnings

from maxtext_moe import signals
from maxtext_moe.cli import data_commands, gpu_commands, run_commands, tool_commands
from maxtext_moe.cli.output import ReaderGone, routed_stdout, to_devnull
from maxtext_moe.errors import EXIT_NO_SPACE, EXIT_READER_GONE, EXIT_RESUMABLE, RunEnded, UserError, no_space
from maxtext_moe.stderr import hide_closed_loop_reports, last_word


def build_parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
    prog="maxtext-moe",
    description="Dropless DeepSeek-V3-class MoE training on MaxText.",
    epilog=run_commands.OVERRIDES_HELP,
  )
  sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
  common = argparse.ArgumentParser(add_help=False)
  common.add_argument("-v", "--verbose", action="store_true", help="show MaxText's own logging and notices")
  run_commands.register(sub, common)
  tool_commands.register(sub, common)
  data_commands.register(sub, common)
  gpu_commands.register(sub, common)
  return parser


def _cuda_driver() -> bool:
  """Whether this machine has an NVIDIA driver (libcuda) for JAX's CUDA plugin to start."""
  try:
    ctypes.CDLL("libcuda.so.1")
  except OSError:
    return False
  return True


def _process_defaults() -> None:
  """Settings for this process, made before jax or maxtext is imported: less start-up noise from XLA's C++
  logging and transformers, MaxText without its Google Cloud dependencies, and on a machine without an
  NVIDIA driver JAX on its CPU backend (with the jax-cuda12 plugin installed for `compile`, JAX would
  otherwise try CUDA first and print its failure as a traceback)."""
  os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "1")
  os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
  os.environ.setdefault("DECOUPLE_GCLOUD", "TRUE")
  if "JAX_PLATFORMS" not in os.environ and not _cuda_driver():
    os.environ["JAX_PLATFORMS"] = "cpu"


def _first_line(e: BaseException) -> str:
  text = str(e).strip()
  return (text.splitlines()[0] if text else type(e).__name__)[:300]


def _last_word(line: str, verbose: bool) -> None:
  """A one-line error as the last word on standard error (`maxtext_moe.stderr`); Python's own reports of
  abandoned coroutines and threads are not shown unless --verbose."""
  if not verbose:
    sys.unraisablehook = lambda unraisable: None
    threading.excepthook = lambda args: None
    warnings.simplefilter("ignore")
  last_word(line, verbose=verbose)


def _flushed_stdout() -> bool:
  """Flushes sys.stdout (argparse's --help waits in its buffer); False where its reader is gone, and then
  fd 1 leads to /dev/null, so that Python's own flush at exit says nothing."""
  try:
    sys.stdout.flush()
  except BrokenPipeError:
    to_devnull(sys.stdout.fileno())
    return False
  return True


def main(argv: list[str] | None = None) -> int:
  signals.install_early()
  try:
    code = _main(argv)
  except ReaderGone:  # the output's reader stopped early: quietly, as a Unix tool ends
    return EXIT_READER_GONE
  except signals.StopBeforeStart as e:
    return _stopped_early(e.name)
  except BaseException as e:
    if signals.received() is not None:
      return _stopped_early(signals.received())  # the stop's exception, converted on its way (an ImportError)
    if isinstance(e, SystemExit) and not _flushed_stdout():  # argparse's --help, whose reader stopped early
      return EXIT_READER_GONE
    raise
  return code if _flushed_stdout() else EXIT_READER_GONE


def _stopped_early(name: str) -> int:
  print(signals.stopped_line(name), file=sys.stderr, flush=True)
  return EXIT_RESUMABLE


def _main(argv: list[str] | None) -> int:
  parser = build_parser()
  ns, extra = parser.parse_known_args(argv)
  if not getattr(ns, "verbose", False):
    hide_closed_loop_reports()
  if extra:  # key=value overrides may follow a command's options; anything else is an error
    target = "overrides" if getattr(ns, "command", None) == "convert" else "args" if hasattr(ns, "args") else None
    if target is None or any(a.startswith("-") or "=" not in a for a in extra):
      parser.error(f"unrecognized arguments: {' '.join(extra)}")
    setattr(ns, target, [*getattr(ns, target), *extra])
  _process_defaults()
  with routed_stdout(verbose=ns.verbose) as out:
    try:
      return ns.func(ns, out)
    except UserError as e:
      _last_word(f"maxtext-moe: error: {e}", ns.verbose)
      return 2
    except RunEnded as e:
      _last_word(f"maxtext-moe: {e}", ns.verbose)
      return e.exit_code
    except KeyboardInterrupt:
      print("maxtext-moe: interrupted", file=sys.stderr)
      return 130
    except Exception as e:  # pylint: disable=broad-except  # a full disk, whatever raised it; else re-raised
      why = no_space(e)
      if why is None:
        raise
      _last_word(f"maxtext-moe: error: {why} while writing: {_first_line(e)}; free space and run it again", ns.verbose)
      return EXIT_NO_SPACE
