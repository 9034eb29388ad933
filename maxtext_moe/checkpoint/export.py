"""`maxtext-moe convert maxtext-to-hf`: a MaxText parameter checkpoint -> Hugging Face safetensors, streamed.

Reads one (layer, expert) slice of a leaf at a time (`orbax_io.LeafReader`), lays it out as the HF tensor
(`leaf_plan.LeafPlan.to_hf`) and writes shards of at most --max-shard-gb plus the index and config.json
(`families.hf_config_for`: the source config.json carried forward, every architecture field from the
model, dtype and quantization as written), and the tokenizer, through `staging.staged_output`. Reads
converted checkpoints and MaxText's own training checkpoints alike.

What it needs besides the tensors:
  - the model: --model, else the model.yml a conversion (or a run on a converted model) keeps, else, for a
    checkpoint inside a run directory RUN/checkpoints/STEP, the config MaxText recorded in RUN/tensorboard
    (every key, as text summaries), read back into a config.json (`families.hf_config_for`) whose model
    the checkpoint's shapes must then match;
  - the tokenizer: the run's (its recorded tokenizer_type/tokenizer_path), else the source checkpoint's of
    a conversion (maxtext_moe_conversion.json names it). A Hugging Face tokenizer's files are copied as
    they are; a sentencepiece model is written by transformers (`LlamaTokenizer`) as tokenizer.json with
    the .model beside it. bos/eos token ids come from it.
"""

import ast
import json
import re
import shutil
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


# What a Hugging Face tokenizer may consist of (besides Python modules named by tokenizer_config.json's
# auto_map); generation_config.json carries the ids generation stops at.
TOKENIZER_FILES = (
  "tokenizer.json",
  "tokenizer_config.json",
  "special_tokens_map.json",
  "added_tokens.json",
  "tokenizer.model",
  "tiktoken.model",
  "vocab.json",
  "merges.txt",
  "vocab.txt",
  "chat_template.jinja",
  "chat_template.json",
  "generation_config.json",
)


def _run_dir(items: Path) -> Path | None:
  """RUN for RUN/checkpoints/STEP/items, else None."""
  step = items.parent if items.name == "items" else items
  return step.parent.parent if step.parent.name == "checkpoints" else None


def _recorded_config(run: Path | None) -> dict[str, str] | None:
  """The config keys MaxText wrote to RUN/tensorboard as text summaries (str of each value), the last
  run's value where a run was resumed; None where there is no record."""
  files = sorted((run / "tensorboard").glob("events.out.tfevents.*"), key=lambda f: f.stat().st_mtime) if run else []
  if not files:
    return None
  from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
  from tensorboard.util import tensor_util

  keys: dict[str, str] = {}
  for path in files:
    for event in EventFileLoader(str(path)).Load():
      for value in event.summary.value:
        if value.metadata.plugin_data.plugin_name == "text" and value.tag.endswith("/text_summary"):
          keys[value.tag.removesuffix("/text_summary")] = tensor_util.make_ndarray(value.tensor).item().decode()
  return keys or None


def _literal(text: str) -> Any:
  """A recorded value back: a Python literal, an enum's value (`DecoderBlockType.DEEPSEEK` -> deepseek), or
  the text itself."""
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    enum = re.fullmatch(r"[A-Z][A-Za-z]*\.([A-Z0-9_]+)", text)
    return enum.group(1).lower() if enum else text


class _Recorded:
  """A recorded config with attribute access, as `families.hf_config_for` reads a resolved one."""

  def __init__(self, keys: dict[str, str]):
    self._keys = keys

  def __getattr__(self, key: str) -> Any:
    if key not in self._keys:
      raise AttributeError(key)
    return _literal(self._keys[key])


def _spec_from_record(recorded: dict[str, str], overrides: list[str], run: Path) -> model_spec.ModelSpec:
  """The model of a run's recorded config: written as the config.json it exports as, read back as a
  conversion reads one (so a model Hugging Face cannot represent is refused by name)."""
  try:
    hf = families.hf_config_for(_Recorded(recorded))
  except AttributeError as e:
    raise UserError(f"the config recorded in {run}/tensorboard lacks {e}: pass --model") from None
  return model_spec.from_hf_config(families.model_keys(hf), overrides, f"the run {run}")


def _spec(model: str | None, items: Path, overrides: list[str], recorded: dict[str, str] | None):
  if (
    model is None and recorded is not None and not any((d / model_spec.MODEL_YAML).is_file() for d in items.parents[:3])
  ):
    return _spec_from_record(recorded, overrides, _run_dir(items))
  try:
    return model_spec.for_export(model, items, overrides)
  except UserError as e:
    if model is None and _run_dir(items) is not None:
      raise UserError(f"{e} (the run directory {_run_dir(items)} has no tensorboard record of its config)") from None
    raise


def _tokenizer_source(items: Path, recorded: dict[str, str] | None) -> tuple[str, Path] | None:
  """(kind, path) of the tokenizer to export: the run's, else the conversion's source checkpoint's."""
  from maxtext_moe.checkpoint.convert import PROVENANCE

  if recorded is not None and recorded.get("tokenizer_path"):
    kind = str(_literal(recorded.get("tokenizer_type", "sentencepiece")))
    return kind, Path(recorded["tokenizer_path"])
  for directory in (items, *items.parents[:3]):
    if (directory / PROVENANCE).is_file():
      source = json.loads((directory / PROVENANCE).read_text()).get("source")
      return ("huggingface", Path(source)) if source else None
  return None


def _usable_tokenizer(found: tuple[str, Path] | None) -> tuple[tuple[str, Path] | None, list[str]]:
  """The tokenizer to export, or None and the note that says why none is (the tensors export either way)."""
  if found is None:
    return None, ["no tokenizer written: neither a run's record nor a conversion's source names one"]
  kind, path = found
  if kind not in ("huggingface", "sentencepiece"):
    return None, [f"no tokenizer written: tokenizer_type={kind} (the export writes huggingface and sentencepiece)"]
  if kind == "huggingface" and not any((path / n).is_file() for n in ("tokenizer_config.json", "tokenizer.json")):
    return None, [f"no tokenizer written: {path} is not a local directory with a Hugging Face tokenizer"]
  if kind == "sentencepiece" and not path.is_file():
    return None, [f"no tokenizer written: the sentencepiece model {path} does not exist"]
  return found, []


def _write_tokenizer(found: tuple[str, Path], tmp: Path) -> dict[str, int]:
  """The tokenizer's files into tmp; its bos/eos token ids (those it has)."""
  import transformers

  kind, path = found
  if kind == "huggingface":
    for name in TOKENIZER_FILES:
      if (path / name).is_file():
        shutil.copyfile(path / name, tmp / name)
    tok_config = (
      json.loads((path / "tokenizer_config.json").read_text()) if (path / "tokenizer_config.json").is_file() else {}
    )
    for ref in (tok_config.get("auto_map") or {}).get("AutoTokenizer") or []:
      module = path / f"{str(ref or '').split('.')[0]}.py"
      if ref and module.is_file():
        shutil.copyfile(module, tmp / module.name)
    try:
      tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp), trust_remote_code=False)
    except Exception:  # pylint: disable=broad-except  # remote code or an old format: the ids stay the source's
      return {}
  else:
    import sentencepiece

    staging = tmp / ".sentencepiece"
    staging.mkdir()
    shutil.copyfile(path, staging / "tokenizer.model")
    processor = sentencepiece.SentencePieceProcessor(model_file=str(path))
    special = {
      f"{name}_token": processor.id_to_piece(i)
      for name, i in (("bos", processor.bos_id()), ("eos", processor.eos_id()), ("unk", processor.unk_id()))
      if i >= 0
    }
    tokenizer = transformers.LlamaTokenizer.from_pretrained(str(staging), **special)
    tokenizer.save_pretrained(str(tmp))
    shutil.move(staging / "tokenizer.model", tmp / "tokenizer.model")
    staging.rmdir()
  return {
    f"{name}_token_id": getattr(tokenizer, f"{name}_token_id")
    for name in ("bos", "eos")
    if getattr(tokenizer, f"{name}_token_id", None) is not None
  }


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
  recorded = _recorded_config(_run_dir(items))
  spec = _spec(model, items, list(overrides), recorded)
  cfg, plans = model_tree(spec)
  reader = staged.reader_for(LeafReader(items), items, cfg)  # a pipelined run's: its MoE layers as one stack
  stored = _stored_paths(reader, plans, items, spec.label)
  config = families.hf_config_for(cfg, dtype=dtype, source=spec.source_config)
  tokenizer, notes = _usable_tokenizer(_tokenizer_source(items, recorded))
  total = sum(int(np.prod(p.leaf.shape)) * OUT_DTYPES[dtype].itemsize for p in plans)
  bound_host_memory()
  start = time.perf_counter()
  with staged_output(Path(out), force=force) as tmp, ByteProgress("maxtext -> hf", total, interactive()) as progress:
    tmp.mkdir()
    tensors = _tensors(reader, plans, stored, cfg, OUT_DTYPES[dtype])
    for nbytes in write_shards(tmp, tensors, max_shard_bytes=int(max_shard_gb * 2**30)):
      progress.advance(nbytes)
    if tokenizer is not None:
      config |= _write_tokenizer(tokenizer, tmp)
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    summary = {
      "direction": "maxtext-to-hf",
      "source": str(items),
      "model": spec.label,
      "dtypes": dtypes_summary(plans, dtype),
      "tokenizer": str(tokenizer[1]) if tokenizer else None,
      "notes": notes,
      "bytes_written": progress.done,
      "seconds": round(time.perf_counter() - start, 3),
    }
  return summary
