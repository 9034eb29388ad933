"""`maxtext-moe convert maxtext-to-hf`: a MaxText parameter checkpoint -> Hugging Face safetensors, streamed.

Reads one (layer, expert) slice of a leaf at a time (`orbax_io.LeafReader`), lays it out as the HF tensor
(`deepseek.LeafPlan.to_hf`) and writes bf16 shards of at most --max-shard-gb plus the index and config.json,
through `staging.staged_output`. Float32 1-D tensors (DeepSeek-V3's e_score_correction_bias) stay float32.
Reads converted checkpoints and MaxText's own training checkpoints alike.
"""

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from maxtext_moe.checkpoint import deepseek
from maxtext_moe.checkpoint.convert import model_tree
from maxtext_moe.checkpoint.host_memory import bound_host_memory
from maxtext_moe.checkpoint.safetensors_io import write_shards
from maxtext_moe.checkpoint.staging import ByteProgress, interactive, staged_output
from maxtext_moe.errors import UserError


def _stored_path(reader, leaf_path: tuple[str, ...]) -> tuple[str, ...] | None:
  """Where a checkpoint keeps a leaf: under params/<collection>/... (converted or parameter checkpoints),
  or, for a MaxText training checkpoint, MoEBiasVar leaves under nnx_aux/model/... (NNX's non-Param state)."""
  collection, rest = leaf_path[0], leaf_path[1:]
  candidates = [("params", *leaf_path)]
  if collection != "params":
    candidates += [("nnx_aux", "model", *rest), ("params", "params", *rest)]
  for path in candidates:
    try:
      reader.shape(path)
      return path
    except Exception:  # pylint: disable=broad-except  # TensorStore raises several types for a missing array
      continue
  return None


def _items_dir(ckpt_dir: str) -> Path:
  path = Path(ckpt_dir)
  if not path.exists():
    raise UserError(f"checkpoint {path} does not exist")
  items = path / "items" if (path / "items").is_dir() else path
  if not (items / "_METADATA").is_file():
    raise UserError(f"{path} is not an Orbax parameter checkpoint (no items/_METADATA); pass OUT or OUT/items")
  return items


def maxtext_to_hf(
  ckpt_dir: str, model: str, out: str, *, overrides: list[str] = (), force: bool = False, max_shard_gb: float = 5.0
) -> dict[str, Any]:
  """Writes a MaxText parameter checkpoint as Hugging Face safetensors (bf16; float32 leaves stay float32)."""
  from maxtext_moe.checkpoint.orbax_io import LeafReader

  if Path(out).exists() and not force:
    raise UserError(f"output directory {Path(out).absolute()} already exists; pass --force to replace it")
  items = _items_dir(ckpt_dir)
  cfg, plans = model_tree(model, list(overrides))
  reader = LeafReader(items)
  stored = {}  # leaf path -> where this checkpoint keeps it
  for plan in plans:
    path = stored[plan.leaf.path] = _stored_path(reader, plan.leaf.path)
    if path is None:
      raise UserError(f"{items} lacks {'/'.join(plan.leaf.path)}: is it a checkpoint of model {model}?")
    shape = reader.shape(path)
    if shape != plan.leaf.shape:
      raise UserError(
        f"{'/'.join(plan.leaf.path)} has shape {list(shape)} in {items}, model {model} has {list(plan.leaf.shape)}"
      )

  bf16 = np.dtype(ml_dtypes.bfloat16)

  def tensors() -> Iterator[tuple[str, np.ndarray]]:
    copies = {}
    for plan in plans:
      path = stored[plan.leaf.path]
      for name, index in plan.slices():
        x = plan.to_hf(reader.read(path, index))
        yield name, x if x.dtype == np.float32 and x.ndim == 1 else x.astype(bf16)
      if plan.leaf.path[1:] in (("token_embedder", "embedding"), ("decoder", "logits_dense", "kernel")):
        copies[plan.leaf.path[-2]] = plan  # the MTP layers ship copies of these two
    for k in range(cfg.mtp_num_layers):
      layer = cfg.num_decoder_layers + k
      for key, hf_name in (("token_embedder", "embed_tokens"), ("logits_dense", "shared_head.head")):
        plan = copies[key]
        yield (
          f"model.layers.{layer}.{hf_name}.weight",
          plan.to_hf(reader.read(stored[plan.leaf.path])).astype(bf16),
        )

  total = sum(int(np.prod(p.leaf.shape)) * 2 for p in plans)
  bound_host_memory()
  start = time.perf_counter()
  with staged_output(Path(out), force=force) as tmp, ByteProgress("maxtext -> hf", total, interactive()) as progress:
    tmp.mkdir()
    for nbytes in write_shards(tmp, tensors(), max_shard_bytes=int(max_shard_gb * 2**30)):
      progress.advance(nbytes)
    (tmp / "config.json").write_text(json.dumps(deepseek.hf_config_for(cfg), indent=2, sort_keys=True) + "\n")
    summary = {
      "direction": "maxtext-to-hf",
      "source": str(items),
      "model": model,
      "bytes_written": progress.done,
      "seconds": round(time.perf_counter() - start, 3),
    }
  return summary
