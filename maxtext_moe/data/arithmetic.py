"""The embedded SFT example: two-digit addition as conversations, and a character-level chat tokenizer.

Deterministic (a fixed seed; the same files on every machine), offline, and checkable: every answer is an
integer a test can verify. The held-out split asks questions the training split never contains.

Files (built once, atomically, under the cache directory; `maxtext-moe data example --out DIR` copies them):
- `train.jsonl`, `eval.jsonl`: one `{"messages": [{"role": ..., "content": ...}, ...]}` per line, the format
  the Hugging Face ecosystem uses for chat data.
- `tokenizer/`: a Hugging Face tokenizer (`tokenizers` WordLevel over single characters, 103 tokens, so it
  fits any vocabulary, the 256 of the tiny HF fixture included) whose `tokenizer_config.json` carries the
  chat template below. Single-character tokens keep the digits separate, which the tiny model needs to
  learn carrying.
"""

import json
import os
import random
import shutil
import tempfile
from pathlib import Path

from maxtext_moe.data.corpus import cache_dir

VERSION = 1
SEED = 20261130
NUM_TRAIN, NUM_EVAL = 6000, 256

PAD, UNK, BOS, EOS = "<pad>", "<unk>", "<s>", "</s>"
ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
END = "<|end|>"
SPECIALS = [PAD, UNK, BOS, EOS, *ROLE_TOKENS.values(), END]

# Each turn is <|role|>content<|end|>; the generation prompt opens the assistant's turn, so the completion
# (what carries loss) is the answer and its <|end|>: the model learns to stop.
CHAT_TEMPLATE = (
  "{% for m in messages %}"
  "{% if m['role'] not in ['system', 'user', 'assistant'] %}"
  "{{ raise_exception('unknown role ' + m['role']) }}"
  "{% endif %}"
  "{{ '<|' + m['role'] + '|>' + m['content'] + '<|end|>' }}"
  "{% endfor %}"
  "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def _question(a: int, b: int) -> str:
  return f"What is {a} + {b}?"


def conversation(a: int, b: int) -> dict:
  return {
    "messages": [
      {"role": "user", "content": _question(a, b)},
      {"role": "assistant", "content": str(a + b)},
    ]
  }


def splits(seed: int = SEED) -> tuple[list[dict], list[dict]]:
  """(train, eval) conversations: distinct (a, b) pairs, 10 <= a, b <= 99, none in both."""
  pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
  random.Random(seed).shuffle(pairs)
  held_out = pairs[:NUM_EVAL]
  train = pairs[NUM_EVAL : NUM_EVAL + NUM_TRAIN]
  return [conversation(a, b) for a, b in train], [conversation(a, b) for a, b in held_out]


def _write_jsonl(path: Path, rows: list[dict]) -> None:
  with open(path, "w", encoding="utf-8") as f:
    for row in rows:
      f.write(json.dumps(row) + "\n")


def write_tokenizer(out: Path) -> None:
  """A character-level `PreTrainedTokenizerFast` with the chat template, saved with `save_pretrained`."""
  from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
  from transformers import PreTrainedTokenizerFast

  chars = [chr(c) for c in range(32, 127)]
  vocab = {tok: i for i, tok in enumerate([*SPECIALS, *chars])}
  tok = Tokenizer(models.WordLevel(vocab, unk_token=UNK))
  tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
  tok.decoder = decoders.Fuse()
  hf = PreTrainedTokenizerFast(
    tokenizer_object=tok,
    pad_token=PAD,
    unk_token=UNK,
    bos_token=BOS,
    eos_token=EOS,
    additional_special_tokens=[*ROLE_TOKENS.values(), END],
    model_max_length=4096,
  )
  hf.chat_template = CHAT_TEMPLATE
  hf.save_pretrained(str(out))


def example_dir() -> Path:
  """The cached example directory (train.jsonl, eval.jsonl, tokenizer/), built on first use."""
  out = cache_dir() / f"sft-arithmetic-v{VERSION}"
  if (out / "tokenizer" / "tokenizer_config.json").is_file():
    return out
  out.parent.mkdir(parents=True, exist_ok=True)
  tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
  try:
    train, held_out = splits()
    _write_jsonl(tmp / "train.jsonl", train)
    _write_jsonl(tmp / "eval.jsonl", held_out)
    write_tokenizer(tmp / "tokenizer")
    try:
      os.rename(tmp, out)
    except OSError:  # another process built it first
      if not (out / "tokenizer" / "tokenizer_config.json").is_file():
        raise
  finally:
    shutil.rmtree(tmp, ignore_errors=True)
  return out


PARTS = {"train": "train.jsonl", "eval": "eval.jsonl", "tokenizer": "tokenizer"}


def example_path(part: str) -> str:
  """`${moe_sft_example:train|eval|tokenizer}` in YAML."""
  from maxtext_moe.errors import UserError

  if part not in PARTS:
    raise UserError(f"unknown SFT example part '{part}'; known: {', '.join(PARTS)}")
  return str(example_dir() / PARTS[part])
