"""`maxtext-moe convert hf-to-maxtext`: a Hugging Face checkpoint of a supported family (`families`:
DeepSeek-V3 in FP8 or BF16, Qwen3-MoE, Mixtral) -> MaxText Orbax, streamed.

  1. Reads every shard's header (not the data) and the model's parameter tree from MaxText itself.
  2. Checks, before writing anything: config.json against the model, and that each needed tensor
     exists with the expected shape and a supported dtype.
  3. Writes each MaxText leaf chunk by chunk: one (layer, expert) slice at a time is read (memmap),
     dequantized if FP8, transposed/reshaped and written. Peak memory is a few slices, not the model.
  4. Writes through `staging.staged_output`, so OUT is either complete or absent. An existing OUT needs
     --force and is replaced only once the new one is done.
The reverse, maxtext-to-hf, is `export.py`.

Training loads the result with load_parameters_path=OUT/items.
"""

import collections
import functools
import json
import os
import re
import time
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from maxtext_moe.checkpoint import families, leaf_plan, model_spec
from maxtext_moe.checkpoint.families import deepseek3
from maxtext_moe.checkpoint.host_memory import bound_host_memory
from maxtext_moe.checkpoint.model_spec import ModelSpec
from maxtext_moe.checkpoint.safetensors_io import DTYPES, HFCheckpoint
from maxtext_moe.checkpoint.staging import ByteProgress, interactive, staged_output
from maxtext_moe.config import checks, model_file
from maxtext_moe.errors import UserError

OUT_DTYPES = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float32": np.dtype(np.float32)}
PROVENANCE = "maxtext_moe_conversion.json"
# Threads making chunks, leaving half the cores to TensorStore's writer. Measured with numpy making
# chunks: on 2 cores, 2 threads made chunks 1.7x faster alone (0.42 -> 0.72 GB/s) but slowed the whole
# conversion (0.28 -> 0.22 GB/s) by competing with the writer: 1 there. (XLA, which makes them now,
# runs each chunk on its own thread pool as well.)
WORKERS = max(1, min(8, (os.cpu_count() or 2) // 2))


def model_tree(spec: ModelSpec, *, max_chunk_elems: int = leaf_plan.MAX_CHUNK_ELEMS):
  """(MaxText config, LeafPlans) of a model laid out on one device."""
  from maxtext_moe.upstream import resolution
  from maxtext_moe.upstream.maxtext import model as upstream_model

  cfg = resolution.resolved(
    spec.recipe, [*upstream_model.ONE_DEVICE_OVERRIDES, *spec.overrides, *checks.WITHOUT_WEIGHTS]
  )
  if not cfg.scan_layers:
    raise UserError("conversion writes MaxText's scanned layout: drop scan_layers=false")
  abstract = [leaf_plan.AbstractLeaf(p, s, n) for p, s, n in upstream_model.param_leaves(cfg)]
  plans = leaf_plan.leaf_plans(abstract, families.for_model(cfg), cfg, max_chunk_elems=max_chunk_elems)
  return cfg, plans


def _nest(tree: dict, path: tuple[str, ...], value: Any) -> None:
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def streamed_tree(
  plans: list[leaf_plan.LeafPlan],
  dtypes: list[np.dtype],
  chunks: Callable[[leaf_plan.LeafPlan, np.dtype], Callable[[], Iterator[tuple[tuple[slice, ...], np.ndarray]]]],
  on_chunk: Callable[[int], None] = lambda nbytes: None,
) -> dict:
  """The PyTree hf_to_maxtext writes: a StreamedLeaf per plan at ("params", *its leaf path), whose chunks
  come from `chunks(plan, dtype)`."""
  from maxtext_moe.checkpoint.orbax_io import StreamedLeaf  # pylint: disable=import-outside-toplevel

  tree: dict = {}
  for plan, dtype in zip(plans, dtypes, strict=True):
    leaf = StreamedLeaf(plan.leaf.shape, dtype, plan.write_chunk_shape(), chunks(plan, dtype), on_chunk)
    _nest(tree, ("params", *plan.leaf.path), leaf)
  return tree


def leaf_dtypes(plans: list[leaf_plan.LeafPlan], out_dtype: np.dtype) -> list[np.dtype]:
  """Each leaf's output dtype (README, "dtype rules"): `out_dtype` for matrices and norms, float32 for
  DeepSeek-V3's e_score_correction_bias, which its checkpoints keep in float32 because routing
  compares biased scores that differ in their low bits."""
  return [np.dtype(np.float32) if p.float32 else out_dtype for p in plans]


def check_hf_tensors(ckpt: HFCheckpoint, plans: list[leaf_plan.LeafPlan], model: str) -> set[str]:
  """Every tensor the plans need exists with the right shape and a supported dtype. Returns their names."""
  used = set()
  for plan in plans:
    for name, _ in plan.slices():
      info = ckpt.tensors.get(name)
      if info is None:
        leaf = "/".join(plan.leaf.path)
        raise UserError(f"{ckpt.dir} lacks tensor {name}, needed for {leaf} of model {model}")
      if info.dtype not in DTYPES:
        raise UserError(f"tensor {name} has dtype {info.dtype}; expected one of {', '.join(DTYPES)}")
      if info.shape != plan.hf_shape:
        raise UserError(
          f"tensor {name} has shape {list(info.shape)} but model {model} expects {list(plan.hf_shape)}: "
          "the checkpoint is a different model"
        )
      if info.dtype == "F8_E4M3" and name + "_scale_inv" not in ckpt.tensors:
        raise UserError(f"FP8 tensor {name} has no {name}_scale_inv")
      used.add(name)
  return used


def make_chunks(
  ckpt: HFCheckpoint, plan: leaf_plan.LeafPlan, *, block: tuple[int, int], dtype: np.dtype, workers: int = 1
) -> Iterator[tuple[tuple[slice, ...], np.ndarray]]:
  """(MaxText index, chunk) for every chunk of `plan`, in order: read (memmap), dequantized if FP8, laid
  out, cast (`relayout`). With workers > 1 up to `workers` chunks are made at once in threads (XLA
  releases the GIL while it computes), so memory holds at most that many chunks more."""

  def make(name, rows, index):
    # A fresh C-ordered array, never a view of the memmap: TensorStore keeps what it is given until the
    # write commits, and a view would pin the source's mapped pages too (measured: +130 MB).
    return index, plan.to_maxtext(ckpt.weight(name, block=block, rows=rows), index, dtype)

  if workers <= 1:
    for item in plan.chunks():
      yield make(*item)
    return
  with ThreadPoolExecutor(workers) as pool:
    pending: collections.deque = collections.deque()
    for item in plan.chunks():
      pending.append(pool.submit(make, *item))
      if len(pending) >= workers:
        yield pending.popleft().result()
    while pending:
      yield pending.popleft().result()


def check_model(ckpt: HFCheckpoint, cfg: Any, spec: ModelSpec) -> None:
  """config.json against the model, every difference at once; then MTP."""
  problems = families.mismatches(ckpt.config, cfg)
  if problems:
    raise UserError(
      f"config.json of {ckpt.dir} differs from {spec.label}: {'; '.join(problems)}. Drop --model to take the "
      "model from config.json (a key the model file sets needs override_model_config=true)"
    )
  mtp = min(int(ckpt.config.get("num_nextn_predict_layers", 0) or 0), _mtp_present(ckpt))
  if cfg.mtp_num_layers > mtp:
    raise UserError(
      f"{spec.label} has mtp_num_layers={cfg.mtp_num_layers} but {ckpt.dir} holds {mtp} MTP layer(s)"
      f"{_MTP_DROPPED if _mtp_dropped(ckpt) else ''}; pass mtp_num_layers={mtp}{spec.pinned} to convert without them"
    )


_MTP_DROPPED = (
  " (config.json has num_nextn_predict_layers, the tensors are absent: transformers' save_pretrained drops them)"
)


def _without_absent_mtp(ckpt: HFCheckpoint, keys: dict[str, Any]) -> list[str]:
  """A transformers-saved DeepSeek-V3 (config.json promises MTP layers, the tensors are absent): `keys`
  set to the layers it holds, and the note that says so."""
  if not (_mtp_dropped(ckpt) and keys.get("mtp_num_layers")):
    return []
  promised, present = keys["mtp_num_layers"], _mtp_present(ckpt)
  keys["mtp_num_layers"] = present
  return [
    f"config.json says num_nextn_predict_layers={promised} but the checkpoint holds {present} MTP layer(s) "
    f"(transformers' save_pretrained drops them): converted without them (mtp_num_layers={present})"
  ]


def _mtp_present(ckpt: HFCheckpoint) -> int:
  layers = ckpt.config.get("num_hidden_layers")
  return deepseek3.mtp_layers_present(set(ckpt.tensors), int(layers)) if isinstance(layers, int) else 0


def _mtp_dropped(ckpt: HFCheckpoint) -> bool:
  """config.json promises MTP layers the checkpoint does not hold (a transformers-saved DeepSeek-V3)."""
  return int(ckpt.config.get("num_nextn_predict_layers", 0) or 0) > _mtp_present(ckpt)


def _model_yaml_keys(cfg: Any, keys: dict[str, Any]) -> dict[str, Any]:
  """The written model.yml: the config.json's keys as the resolved config has them (user overrides
  such as mtp_num_layers=0 included)."""
  return {k: v if k == "model_name" else getattr(getattr(cfg, k), "value", getattr(cfg, k)) for k, v in keys.items()}


def dtypes_summary(plans: list[leaf_plan.LeafPlan], dtype: str) -> dict[str, str]:
  """What the summary says of dtypes: `dtype` for matrices and norms, float32 for what stays float32."""
  kept = sorted({p.hf_template.rsplit(".", 1)[-1] for p in plans if p.float32})
  return {"matrices and norms": dtype, **dict.fromkeys(kept, "float32")}


def check_request(out: str, *, dtype: str, force: bool) -> None:
  """Bad requests both directions refuse before reading anything."""
  if dtype not in OUT_DTYPES:
    raise UserError(f"--dtype {dtype} is not one of {', '.join(OUT_DTYPES)}")
  if Path(out).exists() and not force:
    raise UserError(f"output directory {Path(out).absolute()} already exists; pass --force to replace it")


def _ignored(ckpt: HFCheckpoint, used: set[str]) -> list[str]:
  """HF tensors no leaf takes (an MTP module left out, ...), scales and known copies aside."""
  pattern = families.for_config_json(ckpt.config).skipped
  skipped = (n for n in ckpt.tensors if n.endswith("_scale_inv") or (pattern and pattern.match(n)))
  return sorted(set(ckpt.tensors) - used - set(skipped))


def _outputs(out: Path) -> dict[str, str]:
  return {
    "load_parameters_path": str(out.absolute() / "items"),
    "model_file": str(out.absolute() / model_spec.MODEL_YAML),
  }


def hf_to_maxtext(
  hf_dir: str,
  model: str | None,
  out: str,
  *,
  overrides: list[str] = (),
  dtype: str = "bfloat16",
  force: bool = False,
  max_chunk_elems: int = leaf_plan.MAX_CHUNK_ELEMS,
) -> dict[str, Any]:
  """Converts a Hugging Face checkpoint of a supported family to a MaxText parameter checkpoint at
  OUT/items, with OUT/model.yml and OUT/hf_config.json (`model_spec`). The model comes from config.json,
  or is `model` (a recipe or model YAML) checked against it field by field. `max_chunk_elems` bounds the
  unit written at once (tensors above it are cut into row blocks)."""
  from maxtext_moe.checkpoint.orbax_io import save_tree

  check_request(out, dtype=dtype, force=force)
  ckpt = HFCheckpoint(hf_dir)
  keys = families.model_keys(ckpt.config)
  notes = _without_absent_mtp(ckpt, keys)
  spec = (
    model_spec.from_argument(model, list(overrides))
    if model
    else model_spec.from_hf_config(keys, list(overrides), hf_dir)
  )
  cfg, plans = model_tree(spec, max_chunk_elems=max_chunk_elems)
  check_model(ckpt, cfg, spec)
  used = check_hf_tensors(ckpt, plans, spec.label)
  quant = ckpt.config.get("quantization_config") or {}
  block = tuple(quant.get("weight_block_size", (128, 128)))
  ignored = _ignored(ckpt, used)

  def chunks(plan: leaf_plan.LeafPlan, leaf_dtype: np.dtype):
    return functools.partial(make_chunks, ckpt, plan, block=block, dtype=leaf_dtype, workers=WORKERS)

  bound_host_memory()
  dtypes = leaf_dtypes(plans, OUT_DTYPES[dtype])
  total = sum(int(np.prod(p.leaf.shape)) * d.itemsize for p, d in zip(plans, dtypes, strict=True))
  start = time.perf_counter()
  with staged_output(Path(out), force=force) as tmp, ByteProgress("hf -> maxtext", total, interactive()) as progress:
    save_tree(tmp, streamed_tree(plans, dtypes, chunks, progress.advance))
    header = f"The model of {Path(hf_dir).absolute()}, read from its config.json by maxtext-moe convert."
    model_file.write(tmp / model_spec.MODEL_YAML, _model_yaml_keys(cfg, keys), header=header)
    (tmp / model_spec.SOURCE_CONFIG).write_text(json.dumps(ckpt.config, indent=2) + "\n")
    summary = {
      "direction": "hf-to-maxtext",
      "source": str(Path(hf_dir).absolute()),
      "model": spec.label,
      "overrides": list(overrides),
      "dtypes": dtypes_summary(plans, dtype),
      "leaves": len(plans),
      "bytes_written": progress.done,
      "seconds": round(time.perf_counter() - start, 3),
      "ignored_hf_tensors": ignored,
      "ignored_summary": _describe_ignored(ignored, cfg),
      "notes": notes,
      **_outputs(Path(out)),
    }
    (tmp / PROVENANCE).write_text(json.dumps(summary, indent=2) + "\n")
  return summary


def _describe_ignored(names: list[str], cfg) -> str:
  """'model.layers.61.* (19 tensors; an MTP module: pass mtp_num_layers=1 to keep it)' and the like."""
  groups = Counter(re.sub(r"^(model\.layers\.\d+)\..*", r"\1.*", n) for n in names)
  parts = []
  for prefix, count in sorted(groups.items()):
    m = re.fullmatch(r"model\.layers\.(\d+)\.\*", prefix)
    hint = families.for_model(cfg).ignored_hint(int(m.group(1)), cfg) if m else ""
    parts.append(f"{prefix} ({count} tensors{hint})")
  return ", ".join(parts)
