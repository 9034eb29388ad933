"""`maxtext-moe convert maxtext-to-hf`: a MaxText parameter checkpoint -> Hugging Face safetensors, streamed.

Reads one (layer, expert) slice of a leaf at a time (`orbax_io.LeafReader`), lays it out as the HF tensor
(`leaf_plan.LeafPlan.to_hf`) and writes shards of at most --max-shard-gb plus the index and config.json
(`families.hf_config_for`: the source config.json carried forward, every architecture field from the
model), through `staging.staged_output`. Reads converted checkpoints and MaxText's own training
checkpoints alike.
"""

import json
import time
from pathlib import Path
from typing import Any

import numpy as np

from maxtext_moe.checkpoint import families, leaf_plan, model_spec, staged
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


def _stored_paths(reader: Any, plans: list[leaf_plan.LeafPlan], items: Path, label: str) -> dict:
  """Leaf path -> where this checkpoint keeps it, every leaf present with the model's shape."""
  stored = {}
  for plan in plans:
    path = stored[plan.leaf.path] = _stored_path(reader, plan.leaf.path)
    if path is None:
      raise UserError(f"{items} lacks {'/'.join(plan.leaf.path)}: is it a checkpoint of model {label}?")
    shape = reader.shape(path)
    if shape != plan.leaf.shape:
      raise UserError(
        f"{'/'.join(plan.leaf.path)} has shape {list(shape)} in {items}, model {label} has {list(plan.leaf.shape)}"
      )
  return stored


def _tensors(reader: Any, plans: list[leaf_plan.LeafPlan], stored: dict, cfg: Any, dtype: np.dtype):
  """(HF name, array) of every tensor, in the dtype rules' dtypes; MTP layers get their copies of the
  embedding and the output head."""
  copies = {}
  for plan in plans:
    out_dtype = np.dtype(np.float32) if plan.float32 else dtype
    for name, index in plan.slices():
      yield name, plan.to_hf(reader.read(stored[plan.leaf.path], index)).astype(out_dtype)
    if plan.leaf.path[1:] in (("token_embedder", "embedding"), ("decoder", "logits_dense", "kernel")):
      copies[plan.leaf.path[-2]] = plan
  for k in range(cfg.mtp_num_layers):
    layer = cfg.num_decoder_layers + k
    for key, hf_name in (("token_embedder", "embed_tokens"), ("logits_dense", "shared_head.head")):
      plan = copies[key]
      yield f"model.layers.{layer}.{hf_name}.weight", plan.to_hf(reader.read(stored[plan.leaf.path])).astype(dtype)


def maxtext_to_hf(
  ckpt_dir: str,
  model: str | None,
  out: str,
  *,
  overrides: list[str] = (),
  force: bool = False,
  max_shard_gb: float = 5.0,
  dtype: str = "bfloat16",
) -> dict[str, Any]:
  """Writes a MaxText parameter or training checkpoint as Hugging Face safetensors shards, the index and
  config.json. The model is `model` (a recipe or model YAML) or the model.yml found next to the checkpoint
  (`model_spec.for_export`). Matrices and norms in `dtype`, the correction bias in float32."""
  from maxtext_moe.checkpoint.convert import OUT_DTYPES, check_request, dtypes_summary, model_tree
  from maxtext_moe.checkpoint.orbax_io import LeafReader

  check_request(out, dtype=dtype, force=force)
  items = _items_dir(ckpt_dir)
  spec = model_spec.for_export(model, items, list(overrides))
  cfg, plans = model_tree(spec)
  reader = staged.reader_for(LeafReader(items), items, cfg)  # a pipelined run's: its MoE layers as one stack
  stored = _stored_paths(reader, plans, items, spec.label)
  config = families.hf_config_for(cfg, dtype=dtype, source=spec.source_config)
  total = sum(int(np.prod(p.leaf.shape)) * OUT_DTYPES[dtype].itemsize for p in plans)
  bound_host_memory()
  start = time.perf_counter()
  with staged_output(Path(out), force=force) as tmp, ByteProgress("maxtext -> hf", total, interactive()) as progress:
    tmp.mkdir()
    tensors = _tensors(reader, plans, stored, cfg, OUT_DTYPES[dtype])
    for nbytes in write_shards(tmp, tensors, max_shard_bytes=int(max_shard_gb * 2**30)):
      progress.advance(nbytes)
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    summary = {
      "direction": "maxtext-to-hf",
      "source": str(items),
      "model": spec.label,
      "dtypes": dtypes_summary(plans, dtype),
      "bytes_written": progress.done,
      "seconds": round(time.perf_counter() - start, 3),
    }
  return summary
