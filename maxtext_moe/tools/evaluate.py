"""`maxtext-moe eval`: a checkpoint on held-out conversations, the way a user checks a fine-tune.

For each conversation, its last assistant turn is the reference: the prompt is everything before it, as
the trainer's SFT pipeline renders it (`upstream.maxtext.sft_data.render`). Two numbers:
- completion loss: mean cross-entropy of the reference's tokens given the prompt (teacher forcing);
- exact match: greedy decoding from the prompt reproduces the reference token for token, its end-of-turn
  marker included (so a model that does not stop is wrong).

Decoding re-runs the whole sequence once per generated token (no KV cache: MaxText's decode path is built
for its serving engine, and the completions here are a few tokens long).
"""

import math
from dataclasses import dataclass
from typing import IO, Any

import numpy as np

from maxtext_moe.errors import UserError


@dataclass
class Example:
  prompt: list[int]
  reference: list[int]


def examples(cfg: Any, split: str, limit: int | None) -> tuple[list[Example], Any]:
  """The split's conversations as (prompt, reference) token ids, and the tokenizer."""
  from maxtext_moe.sft import prepare as sft_data  # pylint: disable=import-outside-toplevel
  from maxtext_moe.upstream.maxtext import sft_data as sft  # pylint: disable=import-outside-toplevel

  sft_data.require(cfg, "eval")
  hf, _ = sft_data.checked_tokenizer(cfg)
  train, held_out = sft_data.read_splits(cfg)
  chosen = train if split == "train" else held_out
  if chosen is None:
    raise UserError("this recipe has no held-out split (eval_interval <= 0); set grain_eval_files, or --split train")
  out = []
  for _, messages in chosen.conversations[:limit]:
    chunks, is_prompt = sft.render(hf, messages)
    last = max(i for i, p in enumerate(is_prompt) if not p)
    out.append(Example([t for c in chunks[:last] for t in c], chunks[last]))
  return out, hf


def _batches(items: list[Example], size: int) -> list[list[Example]]:
  return [items[i : i + size] for i in range(0, len(items), size)]


def _score(forward: Any, batch: list[Example], rows: int, pad_id: int) -> tuple[float, int, list[list[int]]]:
  """(summed reference cross-entropy, reference tokens, greedy continuations) for one batch."""
  width = max(len(e.prompt) + len(e.reference) for e in batch)
  tokens = np.full((rows, width), pad_id, np.int32)
  for i, e in enumerate(batch):
    tokens[i, : len(e.prompt) + len(e.reference)] = e.prompt + e.reference
  logits = np.asarray(forward(tokens), np.float32)
  xent, count = 0.0, 0
  for i, e in enumerate(batch):
    for j, tok in enumerate(e.reference):
      row = logits[i, len(e.prompt) + j - 1]
      row = row - row.max()
      xent -= float(row[tok] - math.log(np.exp(row).sum()))
      count += 1
  generated: list[list[int]] = [[] for _ in batch]
  greedy = np.full((rows, width), pad_id, np.int32)
  for i, e in enumerate(batch):
    greedy[i, : len(e.prompt)] = e.prompt
  for step in range(max(len(e.reference) for e in batch)):
    logits = np.asarray(forward(greedy), np.float32)
    for i, e in enumerate(batch):
      if step < len(e.reference):
        pos = len(e.prompt) + step
        generated[i].append(int(logits[i, pos - 1].argmax()))
        greedy[i, pos] = generated[i][-1]
  return xent, count, generated


def evaluate(cfg: Any, *, split: str = "eval", limit: int | None = None) -> dict[str, Any]:
  """Completion loss and exact match of the checkpoint at load_parameters_path on `split`."""
  import jax  # pylint: disable=import-outside-toplevel

  from maxtext_moe.upstream.maxtext.model import Forward  # pylint: disable=import-outside-toplevel

  if not cfg.load_parameters_path:
    raise UserError("eval needs load_parameters_path=CKPT/items (a converted or trained checkpoint's parameters)")
  items, hf = examples(cfg, split, limit)
  forward = Forward(cfg, str(cfg.load_parameters_path))
  devices = jax.device_count()
  size = max(int(cfg.per_device_batch_size) * devices, devices)
  xent, count, right, samples = 0.0, 0, 0, []
  for batch in _batches(items, size):
    rows = -(-len(batch) // devices) * devices
    x, n, generated = _score(forward, batch, rows, hf.pad_token_id or 0)
    xent, count = xent + x, count + n
    for e, g in zip(batch, generated, strict=True):
      right += g == e.reference
      if len(samples) < 5:
        samples.append({"prompt": hf.decode(e.prompt), "expected": hf.decode(e.reference), "generated": hf.decode(g)})
  return {
    "checkpoint": str(cfg.load_parameters_path),
    "split": split,
    "conversations": len(items),
    "completion_tokens": count,
    "completion_loss": xent / max(count, 1),
    "exact_match": right / max(len(items), 1),
    "exact_matches": right,
    "samples": samples,
  }


def format_report(r: dict[str, Any], out: IO[str]) -> None:
  print(f"checkpoint        {r['checkpoint']}", file=out)
  print(f"split             {r['split']}: {r['conversations']:,} conversations", file=out)
  print(f"completion loss   {r['completion_loss']:.4f} over {r['completion_tokens']:,} tokens", file=out)
  print(
    f"exact match       {r['exact_matches']:,}/{r['conversations']:,} ({100 * r['exact_match']:.1f}%), greedy decoding",
    file=out,
  )
  for s in r["samples"]:
    print(f"  {s['prompt']!r} -> {s['generated']!r} (expected {s['expected']!r})", file=out)
