"""`maxtext-moe bench convert`: HF FP8 -> MaxText conversion speed and memory on a synthetic checkpoint.

The checkpoint is DeepSeek-V3-shaped but smaller (`BENCH`: D=2048, 64 experts of 2048x1024, 1 dense + 3
MoE layers, vocab 32k): about 1.5 GB of FP8 + bf16 safetensors that become about 2.8 GB of bf16 Orbax.
It is written to a temporary directory, so it sits in the page cache for both the conversion and
the baseline, a plain copy of the same files (`shutil.copyfile`) measured in the same run.

Speed is split in two, in the same run, to show what bounds it: making every chunk without writing
(read, dequantize, transpose, cast), and the writer alone (the same leaves and chunk grid through the
same Orbax/TensorStore path, given chunks that cost nothing to make). A conversion that runs at the
writer-alone rate is limited by writing, not by the Python that makes chunks. The conversion's CPU time
is also split by who spent it (Linux /proc): the kernel (buffered writes into the page cache, page
faults), XLA's threads (making chunks), TensorStore's threads, and Python with the rest.

Memory: the conversion runs in a child process that reports its resident set just before converting
(MaxText imported, model tree built) and its peak (VmHWM) after. The "largest tensor group" is the
largest group of tensors that must be in memory together to write one slice the naive way: one HF
tensor in the output dtype, here the [32000, 2048] embedding (131 MB bf16). The converter cuts such
tensors into row blocks of at most 16M elements (`leaf_plan.MAX_CHUNK_ELEMS`),
so it never holds one whole. `peak_rss_over_largest_tensor_group` =
(peak - before) / that size.
"""

import functools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

import ml_dtypes
import numpy as np

from maxtext_moe.bench.report import emit

MODEL = "cpu/deepseek3-tiny"
BENCH = [
  "override_model_config=true",
  "base_emb_dim=2048",
  "base_num_query_heads=16",
  "base_num_kv_heads=16",
  "base_mlp_dim=4096",
  "base_moe_mlp_dim=1024",
  "num_experts=64",
  "num_experts_per_tok=8",
  "n_routing_groups=8",
  "topk_routing_group=4",
  "base_num_decoder_layers=4",
  "first_num_dense_layers=1",
  "q_lora_rank=512",
  "kv_lora_rank=256",
  "qk_nope_head_dim=64",
  "qk_rope_head_dim=32",
  "v_head_dim=64",
  "vocab_size=32000",
  "mtp_num_layers=0",
]
FP8_SUFFIXES = ("_proj.weight", "proj_with_mqa.weight")  # what DeepSeek-V3 ships in FP8
SHARD_BYTES = 512 * 2**20


def _fp8(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
  b = rng.integers(0, 256, size=shape, dtype=np.uint8)
  b[(b & 0x7F) == 0x7F] = 0  # e4m3fn's NaN codes
  return b.view(ml_dtypes.float8_e4m3fn)


def _spec():
  from maxtext_moe.checkpoint.model_spec import from_argument

  return from_argument(MODEL, BENCH)


def write_synthetic(out: Path, plans, cfg) -> int:
  """A Hugging Face FP8 checkpoint with every tensor `plans` needs; returns its size in bytes."""
  from safetensors.numpy import save_file

  from maxtext_moe.checkpoint import families

  out.mkdir(parents=True)
  rng = np.random.default_rng(0)
  shard, shard_bytes, weight_map = {}, 0, {}

  def flush():
    name = f"model-{len(set(weight_map.values())) + 1:05d}.safetensors"
    save_file(shard, str(out / name))
    weight_map.update(dict.fromkeys(shard, name))

  for plan in plans:
    for name, _ in plan.slices():
      shape = plan.hf_shape
      if name.endswith(FP8_SUFFIXES) and len(shape) == 2:
        tensors = {name: _fp8(rng, shape)}
        scale = (-(-shape[0] // 128), -(-shape[1] // 128))
        tensors[name + "_scale_inv"] = rng.uniform(1e-4, 1e-3, size=scale).astype(np.float32)
      else:
        tensors = {name: rng.standard_normal(shape, dtype=np.float32).astype(ml_dtypes.bfloat16)}
      shard.update(tensors)
      shard_bytes += sum(t.nbytes for t in tensors.values())
      if shard_bytes >= SHARD_BYTES:
        flush()
        shard, shard_bytes = {}, 0
  if shard:
    flush()
  config = families.hf_config_for(cfg) | {
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
  }
  (out / "config.json").write_text(json.dumps(config))
  (out / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
  return sum(f.stat().st_size for f in out.iterdir())


def _vm(field: str) -> int:
  for line in Path("/proc/self/status").read_text().splitlines():
    if line.startswith(field + ":"):
      return int(line.split()[1]) * 1024
  return 0


def child(src: str, out: str) -> None:
  """Runs in a fresh process: convert, and print memory and time as JSON."""
  from maxtext_moe.checkpoint.host_memory import bound_host_memory

  bound_host_memory()  # as `maxtext-moe convert` does, before JAX starts its threads
  from maxtext_moe.checkpoint import convert  # pylint: disable=wrong-import-position

  _, plans = convert.model_tree(_spec())  # imports and traces first, so `before` includes them
  produce = _produce_only(src, plans)
  before = _vm("VmRSS")
  threads, times = _thread_cpu(), os.times()
  start = time.perf_counter()
  summary = convert.hf_to_maxtext(src, MODEL, out, overrides=BENCH)
  seconds = time.perf_counter() - start
  cpu = _cpu_split(threads, times)
  peak = _vm("VmHWM")
  shutil.rmtree(out)
  write_only = _write_only(src, Path(out), plans)
  result = {"seconds": seconds, "bytes": summary["bytes_written"], "rss_before": before, "rss_peak": peak}
  print(json.dumps(result | {"produce_seconds": produce, "write_only_seconds": write_only, "cpu_seconds": cpu}))


def _thread_cpu() -> dict[str, tuple[str, float]]:
  """{thread id: (name, user CPU seconds)} of this process's live threads (Linux /proc)."""
  out = {}
  for tid in os.listdir("/proc/self/task"):
    try:
      name = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
      fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
      continue  # the thread ended
    out[tid] = (name, int(fields[11]) / os.sysconf("SC_CLK_TCK"))
  return out


def _cpu_split(threads_before: dict[str, tuple[str, float]], times_before) -> dict[str, float]:
  """CPU seconds since the snapshots, by who spent them: the kernel (all threads' system time: buffered
  writes into the page cache, page faults), XLA's threads (making chunks), TensorStore's threads (user
  time), and the rest of user time: Python (the interpreter threads, including ones that have ended)."""
  now, times = _thread_cpu(), os.times()
  user = {"xla": 0.0, "tensorstore": 0.0}
  for tid, (name, secs) in now.items():
    kind = "xla" if name.startswith("tf_XLA") else "tensorstore" if name.startswith("ts_") else None
    if kind:
      user[kind] += secs - threads_before.get(tid, (name, 0.0))[1]
  total_user = times.user - times_before.user
  return {
    "kernel": times.system - times_before.system,
    "xla": user["xla"],
    "tensorstore": user["tensorstore"],
    "python_and_rest": max(0.0, total_user - user["xla"] - user["tensorstore"]),
  }


def _write_only(src: str, out: Path, plans) -> float:
  """Seconds for the converter's writer alone (the same leaves, chunk grid, dtypes and Orbax/TensorStore
  path, into the same kind of staged directory) given chunks that cost nothing to make: the speed the
  conversion would have if reading, dequantizing and transposing were free."""
  from maxtext_moe.checkpoint import convert
  from maxtext_moe.checkpoint.orbax_io import save_tree
  from maxtext_moe.checkpoint.staging import staged_output

  made: dict[tuple[tuple[int, ...], np.dtype], np.ndarray] = {}

  def ready_made(plan, dtype):
    for _, _, index in plan.chunks():
      shape = tuple(len(range(*s.indices(d))) for s, d in zip(index, plan.leaf.shape, strict=True))
      yield index, made.setdefault((shape, dtype), np.ones(shape, dtype))

  dtypes = convert.leaf_dtypes(plans, np.dtype(ml_dtypes.bfloat16))
  tree = convert.streamed_tree(plans, dtypes, lambda plan, dtype: functools.partial(ready_made, plan, dtype))
  start = time.perf_counter()
  with staged_output(out, force=False) as tmp:
    save_tree(tmp, tree)
  seconds = time.perf_counter() - start
  shutil.rmtree(out)
  return seconds


def _produce_only(src: str, plans) -> float:
  """Seconds to make every output chunk (read, dequantize, transpose, cast) without writing: the Python
  side of the conversion on its own."""
  from maxtext_moe.checkpoint import convert
  from maxtext_moe.checkpoint.convert import make_chunks
  from maxtext_moe.checkpoint.safetensors_io import HFCheckpoint

  ckpt = HFCheckpoint(src)
  start = time.perf_counter()
  for plan in plans:
    for _ in make_chunks(ckpt, plan, block=(128, 128), dtype=np.dtype(ml_dtypes.bfloat16), workers=convert.WORKERS):
      pass
  return time.perf_counter() - start


def _copy_rate(src: Path, dst: Path) -> float:
  dst.mkdir()
  start = time.perf_counter()
  total = 0
  for f in sorted(src.iterdir()):
    shutil.copyfile(f, dst / f.name)
    total += f.stat().st_size
  os.sync()
  return total / (time.perf_counter() - start)


def _table(result: dict[str, Any]) -> Any:
  from rich.table import Table

  cpu = result["conversion_cpu_seconds"]
  table = Table(title="HF FP8 -> MaxText conversion (synthetic DeepSeek-V3-shaped checkpoint, page-cached)")
  table.add_column("row")
  table.add_column("value", justify="right")
  rows = [
    ("source (FP8 + bf16 safetensors) GB", f"{result['source_gb']:.2f}"),
    ("output (bf16 Orbax) GB", f"{result['output_gb']:.2f}"),
    ("conversion seconds", f"{result['seconds']:.1f}"),
    ("conversion GB/s written", f"{result['gb_per_s']:.3f}"),
    ("plain file copy GB/s (same files, same run)", f"{result['copy_gb_per_s']:.3f}"),
    ("conversion / copy rate", f"{result['gb_per_s'] / result['copy_gb_per_s']:.2f}"),
    ("making the chunks only (no writes) GB/s", f"{result['produce_only_gb_per_s']:.3f}"),
    ("writing ready-made chunks only (the writer alone) GB/s", f"{result['write_only_gb_per_s']:.3f}"),
    ("conversion / writer-alone rate", f"{result['gb_per_s'] / result['write_only_gb_per_s']:.2f}"),
    *((f"conversion CPU seconds: {who}", f"{secs:.1f} ({secs / sum(cpu.values()):.0%})") for who, secs in cpu.items()),
    ("RSS before conversion GB (Python, JAX, MaxText)", f"{result['rss_before_gb']:.2f}"),
    ("peak RSS GB", f"{result['peak_rss_gb']:.2f}"),
    ("largest tensor group GB (the embedding, bf16)", f"{result['largest_tensor_group_gb']:.3f}"),
    ("(peak - before) / largest tensor group", f"{result['peak_rss_over_largest_tensor_group']:.2f}"),
  ]
  for row in rows:
    table.add_row(*row)
  return table


def run(*, out: IO[str], as_json: bool = False, workdir: str | None = None) -> dict[str, Any]:
  from maxtext_moe.checkpoint import convert

  cfg, plans = convert.model_tree(_spec())
  largest = max(int(np.prod(p.chunk_shape)) * 2 for p in plans)  # one whole HF tensor, bf16
  root = Path(tempfile.mkdtemp(prefix="maxtext-moe-bench-convert-", dir=workdir))
  try:
    src_bytes = write_synthetic(root / "hf", plans, cfg)
    copy_bps = _copy_rate(root / "hf", root / "copy")
    shutil.rmtree(root / "copy")
    code = "import sys; from maxtext_moe.bench.convert_speed import child; child(sys.argv[1], sys.argv[2])"
    proc = subprocess.run(
      [sys.executable, "-c", code, str(root / "hf"), str(root / "out")], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
      raise RuntimeError(f"conversion failed: {proc.stderr[-2000:]}")
    m = json.loads(proc.stdout.strip().splitlines()[-1])
  finally:
    shutil.rmtree(root, ignore_errors=True)
  result = {
    "source_gb": src_bytes / 1e9,
    "output_gb": m["bytes"] / 1e9,
    "seconds": m["seconds"],
    "gb_per_s": m["bytes"] / m["seconds"] / 1e9,
    "source_gb_per_s": src_bytes / m["seconds"] / 1e9,
    "copy_gb_per_s": copy_bps / 1e9,
    "produce_only_gb_per_s": m["bytes"] / m["produce_seconds"] / 1e9,
    "write_only_gb_per_s": m["bytes"] / m["write_only_seconds"] / 1e9,
    "conversion_cpu_seconds": m["cpu_seconds"],
    "peak_rss_gb": m["rss_peak"] / 1e9,
    "rss_before_gb": m["rss_before"] / 1e9,
    "largest_tensor_group_gb": largest / 1e9,
    "peak_rss_over_largest_tensor_group": (m["rss_peak"] - m["rss_before"]) / largest,
  }
  emit(_table(result), result, as_json=as_json, out=out, width=110)
  return result
